"""Restarts inside a local job: node 0 does what Slurm's batch step does for a restart in place.

A local job's simulated nodes are processes of one submitit controller, and nothing beside them
supervises the job. Without this, ``max_restarts`` (3 by default) did nothing on ``--profile local``:
a killed rank failed the job, where the same job on Slurm trained on in a second. Now the nodes
keep their launchers as on Slurm (:mod:`orchestrator.node.restart_in_place`), and node 0, once it
kept its own, waits for every node's mark and exit file, decides with the batch step's rules (a
cancel, the budget's stop, ``max_restarts``, the hang watchdog's report, the failure report's verdict:
:func:`orchestrator.supervise.failure_report.restart_verdict`), records the restart
(``restarts.jsonl``, the registry's attempt) and writes the word every node waits for, its own
included. A stop signal reaches every node's relay, and a node that took one ends its task: the
others are told to end too (:func:`orchestrator.contract.in_place.ended_in_place`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.contract.in_place import ended_in_place, next_attempt_file, node_kept_file, tell_nodes
from orchestrator.contract.restarts import read_restarts
from orchestrator.contract.run_dir import (
    HANG_REPORT_FILE,
    attempt_dir,
    cancel_requested,
    hang_dir,
    read_json,
)

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan

#: How long node 0 waits for the other simulated nodes to keep their launchers. They stop their ranks
#: within about a second of node 0's exit file (``failed_peer``); a rank that ignores the SIGTERM is
#: killed after the local kill wait (30 s by default).
PEERS_KEPT_WAIT_S = 60.0
POLL_S = 0.05


def decide(
    plan: LaunchPlan,
    run_dir: Path,
    job_id: str,
    attempt: int,
    stop_signals: Sequence[int],
    say: Callable[[str], None],
) -> int | None:
    """The attempt every node starts in place, once the word is written; None when the job ends
    (the word says why). Called by node 0 after it kept its own launcher."""
    path = attempt_dir(run_dir, attempt)
    seen = len(stop_signals)
    deadline = time.monotonic() + PEERS_KEPT_WAIT_S
    while True:
        code, _ = ended_in_place(run_dir, attempt, plan.nodes)
        if code is not None:
            break
        if next_attempt_file(path).exists():
            return None  # a node ended its task: ended_in_place told every node to end
        if len(stop_signals) != seen or time.monotonic() > deadline:
            why = "a stop signal came" if len(stop_signals) != seen else "a node did not keep its launcher"
            tell_nodes(run_dir, attempt, None, why)
            return None
        time.sleep(POLL_S)
    cause, refusal = restart_cause(plan, run_dir, job_id, attempt)
    if cause is None:
        tell_nodes(run_dir, attempt, None, refusal)
        return None
    from orchestrator.schedulers.base import record_restart

    following, step = record_restart(run_dir, job_id, attempt, cause, True, say)
    done = restarts_of(run_dir, job_id)
    say(
        f"restart {done}/{plan.max_restarts} in place (attempt {following}, from step {step}; "
        f"by the launchers the nodes kept): {cause}"
    )
    tell_nodes(run_dir, attempt, following)
    return following


def restart_cause(plan: LaunchPlan, run_dir: Path, job_id: str, attempt: int) -> tuple[str | None, str]:
    """(the cause a restart cures, or None; why not), in the batch step's order: a cancel ends the
    job, then what failed, then whether ``max_restarts`` allows one more."""
    from orchestrator.contract.budget_records import budget_stop
    from orchestrator.supervise.failure_report import restart_verdict

    if cancel_requested(run_dir):
        return None, "cancelled by user (orchestrator cancel)"
    if budget_stop(run_dir, attempt) is not None:
        return None, "the budget stopped the run"
    hang = read_json(hang_dir(run_dir, attempt) / HANG_REPORT_FILE)
    if hang is not None and isinstance(hang.get("reason"), str):
        cause: str | None = hang["reason"]
        refusal = ""
    else:
        verdict = restart_verdict(run_dir, job_id, procs_per_node=plan.procs_per_node)
        cause, refusal = verdict.cause, verdict.refusal or ""
    done = restarts_of(run_dir, job_id)
    if cause is not None and done >= plan.max_restarts:
        return None, f"{done} restart(s) reached max_restarts ({cause})"
    return cause, refusal


def restarts_of(run_dir: Path, job_id: str) -> int:
    """How many restarts ``restarts.jsonl`` records for this job (``max_restarts`` counts per job)."""
    return sum(1 for r in read_restarts(run_dir) if r.get("job_id") == job_id)


def end_kept_nodes(plan: LaunchPlan, run_dir: Path, attempt: int) -> None:
    """Node 0 ends its task without having kept its launcher (its ranks finished, a stop came): nodes
    that kept theirs wait for a word that would never come; they are told to end now, not after their
    wait's bound (on Slurm the batch step does this: ``ended_in_place``)."""
    path = attempt_dir(run_dir, attempt)
    kept = any(node_kept_file(path, node).exists() for node in range(plan.nodes))
    if kept and not next_attempt_file(path).exists():
        tell_nodes(run_dir, attempt, None, "node 0 ended its task")
