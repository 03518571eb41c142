"""After a failed step: tell a lost node from a failed program and, with ``--auto-resume``, come back without it.

Called by :mod:`orchestrator.schedulers.slurm.batch_step` in the batch script of a Slurm job once the training
step has failed. Why there and not in the client: nobody has to keep a terminal open, and the
batch host is the one place that sees the step end the moment it does.

A failed step has three kinds of causes and only one of them is worth a new attempt without
a node:

* a node died (power, kernel, network, slurmd): its peers fail within seconds on a broken
  collective, long before Slurm declares the node DOWN (``SlurmdTimeout``, 300 s by default);
* the program failed by itself (a Python error): every node still answers; a new attempt
  would fail the same way, so nothing is submitted and the job stays FAILED;
* someone killed the training processes: every node still answers; ``orchestrator resume``
  is the user's call.

So every node of the allocation is probed with a tiny step of its own (``srun --overlap -w
NODE true``, bounded): a node that cannot run one is lost. When the batch host itself dies
this code never runs; Slurm then ends the job NODE_FAIL and requeues it by itself
(``--requeue``), and the DOWN node is not scheduled again.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.config.plan import LaunchPlan
from orchestrator.contract.run_dir import (
    DECISIONS_FILE,
    EXIT_REQUEUE,
    read_current_plan_json,
    requeue_recorded_since,
)
from orchestrator.schedulers.slurm.cancel_verdict import SlurmView, requeued_by_slurm
from orchestrator.schedulers.slurm.environment import (
    allocation_nodes,
    batch_restarts,
    cancelled_by_user,
    clean_submit_environment,
    slurm_view,
)
from orchestrator.schedulers.slurm.node_probe import (
    PROBE_TIMEOUT_S,
    ProbeResult,
    back_in_service,
    probe_nodes,
)


@dataclass
class Decision:
    """What the after-step check concluded; appended to ``auto_resume.jsonl``."""

    job_id: str
    step_status: int
    action: str
    """``resubmitted`` | ``none`` (not a node failure) | ``refused`` (a node was lost, but no new attempt:
    ``--auto-resume`` off, or the bound reached)."""
    reason: str
    lost_nodes: list[str] = field(default_factory=list)
    new_job_id: str | None = None
    checkpoint: str | None = None
    exclude_nodes: list[str] = field(default_factory=list)
    time: float = field(default_factory=time.time)


def decide(
    job_id: str,
    step_status: int,
    probes: list[ProbeResult],
    plan: LaunchPlan,
    resubmissions_so_far: int,
    cancelled: str | None,
    auto_resume: bool = True,
    back_in_service: frozenset[str] = frozenset(),
) -> Decision:
    """Pure: the facts in, what to do out (tested without a cluster).

    ``back_in_service``: nodes lost in an earlier restart of this allocation, or excluded by an earlier
    job of the run, that Slurm now places jobs on again (a node restarted by its admin). They are
    not excluded from the new job: a long run's excluded nodes would otherwise only grow, until the
    partition cannot hold the job (a probe still calls such a node lost: it left the allocation)."""
    lost = sorted(p.node for p in probes if not p.alive)
    if cancelled:
        return Decision(job_id, step_status, "none", cancelled, lost)
    if lost and not auto_resume:
        return Decision(
            job_id,
            step_status,
            "refused",
            f"node(s) {', '.join(lost)} lost; --auto-resume is off: `orchestrator resume {job_id}` continues "
            "from the last complete checkpoint",
            lost,
        )
    if not lost:
        return Decision(
            job_id,
            step_status,
            "none",
            "every node still answers: the program failed (or was killed) by itself; not resubmitted "
            "(`orchestrator resume` starts a new attempt from the last checkpoint)",
        )
    if resubmissions_so_far >= plan.max_requeues:
        return Decision(
            job_id,
            step_status,
            "refused",
            f"node(s) {', '.join(lost)} lost, but {resubmissions_so_far} auto-resume(s) reached max_requeues "
            f"({plan.max_requeues})",
            lost,
        )
    exclude, reason = excluded(plan.exclude_nodes, lost, back_in_service)
    return Decision(job_id, step_status, "resubmitted", reason, lost, exclude_nodes=exclude)


def excluded(
    before: tuple[str, ...] | list[str], lost: list[str], back_in_service: frozenset[str]
) -> tuple[list[str], str]:
    """Pure: the nodes a new job excludes, and the reason's words for it."""
    back = sorted((set(before) | set(lost)) & back_in_service)
    exclude = sorted((set(before) | set(lost)) - back_in_service)
    reason = f"node(s) {', '.join(lost)} lost"
    if back:
        reason += f"; {', '.join(back)} back in service (Slurm), not excluded"
    return exclude, reason


def read_decisions(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / DECISIONS_FILE).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def append_decision(run_dir: Path, decision: Decision) -> None:
    with open(run_dir / DECISIONS_FILE, "a") as fh:
        fh.write(json.dumps(decision.__dict__) + "\n")


def current_plan(run_dir: Path) -> LaunchPlan:
    """The plan of the newest submission into this run directory: what a new attempt continues."""
    return LaunchPlan.from_json(read_current_plan_json(run_dir))


def resubmit(
    run_dir: Path,
    plan: LaunchPlan,
    decision: Decision,
    after_job: str | None = None,
    how: str = "auto-resumed",
) -> None:
    """A new attempt without the lost nodes, from the last complete checkpoint (or from the start);
    ``after_job``: it starts once that job has ended."""
    from orchestrator.contract.run_dir import last_complete_checkpoint
    from orchestrator.registry.store import Registry
    from orchestrator.runner.submission import submit

    checkpoint = last_complete_checkpoint(run_dir)
    decision.checkpoint = str(checkpoint.path) if checkpoint else None
    new_plan = fewer_spares_if_needed(replace(plan, exclude_nodes=tuple(decision.exclude_nodes)), decision)
    registry = Registry.open()
    clean_submit_environment()
    submitted = submit(
        new_plan,
        registry=registry,
        existing_run_dir=run_dir,
        resumed_from=decision.checkpoint,
        after_job=after_job,
    )
    decision.new_job_id = submitted.job_id
    registry.set_end_reason(decision.job_id, f"{decision.reason}; {how} as job {submitted.job_id}")


def spares_that_fit(plan: LaunchPlan, partition_nodes: list[str]) -> int:
    """Pure: how many of the plan's spare nodes the partition still holds beside its training nodes,
    once the excluded nodes are left out."""
    left = [n for n in partition_nodes if n not in set(plan.exclude_nodes)]
    return max(0, min(plan.profile.spare_nodes, len(left) - plan.nodes))


def fewer_spares_if_needed(plan: LaunchPlan, decision: Decision) -> LaunchPlan:
    """The plan with as many spares as the partition holds once the lost nodes are excluded: a job
    asking for more would wait for a dead node to come back (a partition of nodes + spares nodes,
    as the chaos benchmark's). The reason says so."""
    from orchestrator.config.profile.records import ClusterProfile
    from orchestrator.schedulers.slurm.environment import partition_node_cpus

    if not plan.profile.spare_nodes or not plan.profile.partition:
        return plan
    try:
        fit = spares_that_fit(plan, list(partition_node_cpus(plan.profile.partition)))
    except Exception:  # noqa: BLE001 (sinfo unanswered: submit as planned; the scheduler's check decides)
        return plan
    if fit >= plan.profile.spare_nodes:
        return plan
    profile = ClusterProfile.model_validate({**plan.profile.model_dump(), "spare_nodes": fit})
    decision.reason += (
        f"; {fit} spare node(s) instead of {plan.profile.spare_nodes}: the partition's nodes left"
    )
    return replace(plan, profile=profile)


def continue_in_new_job(
    run_dir: Path, job_id: str, plan: LaunchPlan, restarts: int, asked: SlurmView | None = None
) -> bool:
    """``requeue_as: new_job``: training checkpointed on a stop signal; instead of ``scontrol
    requeue`` (which Slurm holds for cred_expire + 1 s, 121 s by default), submit a successor into the
    same run, depending on this job (``afterany``), so it starts as soon as this one has ended.

    Bounded by ``max_requeues`` together with this job's own requeues and the run's earlier
    resubmissions (auto-resume's too); recorded in ``auto_resume.jsonl``. True when handed over.
    ``asked``: Slurm's view of the job just taken (:func:`cancelled_by_user`)."""
    previous = [d for d in read_decisions(run_dir) if d.get("action") == "resubmitted"]
    used = len(previous) + restarts
    cancelled = cancelled_by_user(run_dir, job_id, asked)
    if cancelled:
        decision = Decision(job_id, EXIT_REQUEUE, "none", f"not requeued: {cancelled}")
    elif used >= plan.max_requeues:
        decision = Decision(
            job_id, EXIT_REQUEUE, "refused", f"not requeued: {used} requeues reached max_requeues"
        )
    else:
        decision = Decision(
            job_id,
            EXIT_REQUEUE,
            "resubmitted",
            f"stopped by a signal; requeue {used + 1}/{plan.max_requeues} as a new job (requeue_as: new_job)",
            exclude_nodes=list(plan.exclude_nodes),
        )
        try:
            resubmit(run_dir, plan, decision, after_job=job_id, how="continued")
        except Exception as exc:  # noqa: BLE001 (a failed submission must leave the job FAILED, explained)
            decision.action, decision.reason = "refused", f"{decision.reason}; submission failed: {exc}"
    print(
        f"[orchestrator node] {decision.reason}"
        + (f" -> job {decision.new_job_id}" if decision.new_job_id else ""),
        file=sys.stderr,
        flush=True,
    )
    if decision.action != "resubmitted":
        with contextlib.suppress(Exception):
            from orchestrator.registry.store import Registry

            Registry.open().set_end_reason(job_id, decision.reason)
    append_decision(run_dir, decision)
    return decision.action == "resubmitted"


def superseded_by(run_dir: Path, job_id: str) -> str | None:
    """The job that already took over from ``job_id`` (Slurm may still requeue a NODE_FAIL job
    whose batch script ended before the node was declared down)."""
    for d in read_decisions(run_dir):
        if d.get("job_id") == job_id and d.get("action") == "resubmitted" and d.get("new_job_id"):
            return str(d["new_job_id"])
    return None


def after_failed_step(
    run_dir: Path,
    job_id: str,
    step_status: int,
    step_started: float,
    probes: list[ProbeResult] | None,
    auto_resume: bool,
    probe_timeout: float = PROBE_TIMEOUT_S,
    left_out: list[str] | None = None,
) -> Decision | None:
    """Classify a failed step and act on it; the decision is appended to ``auto_resume.jsonl``.

    ``probes`` are the supervisor's, when it already probed (srun hung on a lost node); ``left_out``:
    the nodes earlier restarts of this allocation left out (lost then, maybe back in service now)."""
    started = time.time()

    def say(line: str) -> None:
        print(
            f"[orchestrator auto-resume] {time.strftime('%H:%M:%S')} job {job_id}: {line}",
            file=sys.stderr,
            flush=True,
        )

    if requeue_recorded_since(run_dir, step_started):
        plan = current_plan(run_dir)
        if plan.profile.container.runtime == "none":
            say("training checkpointed on a signal: the requeue is node 0's decision")
        else:  # node 0 ran inside a container image, without Slurm's commands: act here
            say("training checkpointed on a signal; node 0 ran in a container: requeueing from here")
            act_on_requeue(plan, run_dir, job_id, batch_restarts())
        return None
    if probes is None:
        if not auto_resume:
            return None  # srun ended by itself: no node hung it; nothing to decide
        probes = probe_nodes(allocation_nodes(), probe_timeout)
        for p in probes:
            say(f"probe {p.node}: {'alive' if p.alive else 'LOST'} ({p.detail})")
    plan = current_plan(run_dir)
    previous = [d for d in read_decisions(run_dir) if d.get("action") == "resubmitted"]
    earlier = sorted(set(left_out or []) | set(plan.exclude_nodes))
    decision = decide(
        job_id,
        step_status,
        probes,
        plan,
        len(previous),
        cancelled_by_user(run_dir, job_id),
        auto_resume,
        back_in_service=back_in_service(earlier),
    )
    if decision.action == "resubmitted":
        try:
            resubmit(run_dir, plan, decision)
        except Exception as exc:  # noqa: BLE001 (the batch script must still end with the step's status)
            decision.action, decision.reason = "refused", f"{decision.reason}; resubmission failed: {exc}"
    else:
        with contextlib.suppress(Exception):
            from orchestrator.registry.store import Registry

            Registry.open().set_end_reason(job_id, decision.reason)
    say(
        f"{decision.action}: {decision.reason}"
        + (
            f" -> job {decision.new_job_id} excluding {','.join(decision.exclude_nodes)}"
            if decision.new_job_id
            else ""
        )
        + f" (decided in {time.time() - started:.1f} s)"
    )
    append_decision(run_dir, decision)
    return decision


def after_hang(
    run_dir: Path,
    job_id: str,
    reason: str,
    bad_node: str | None,
    auto_resume: bool,
    say: Any,
    bad_nodes: list[str] | None = None,
) -> None:
    """Record why the job failed and, with ``--auto-resume``, submit a new attempt from the last
    complete checkpoint without the node that differed (bounded by ``max_requeues``). Reuses the
    node-loss path below; its decision goes to the same log. The hang watchdog and the preflight end
    here.
    ``bad_nodes``: several nodes to leave out (the preflight's), instead of ``bad_node``."""
    previous = [d for d in read_decisions(run_dir) if d.get("action") == "resubmitted"]
    plan = current_plan(run_dir)
    lost = list(bad_nodes) if bad_nodes is not None else [bad_node] if bad_node else []
    if cancelled_by_user(run_dir, job_id):
        decision = Decision(job_id, 1, "none", "cancelled during a hang", lost)
    elif not auto_resume:
        decision = Decision(job_id, 1, "refused", f"{reason}; --auto-resume is off", lost)
    elif len(previous) >= plan.max_requeues:
        decision = Decision(
            job_id, 1, "refused", f"{reason}; {len(previous)} auto-resume(s) reached max_requeues", lost
        )
    else:
        earlier = [n for n in plan.exclude_nodes if n not in lost]
        exclude, _ = excluded(plan.exclude_nodes, lost, back_in_service(earlier))
        decision = Decision(job_id, 1, "resubmitted", reason, lost, exclude_nodes=exclude)
        try:
            resubmit(run_dir, plan, decision)
        except Exception as exc:  # noqa: BLE001 (the batch script must still end)
            decision.action, decision.reason = "refused", f"{reason}; resubmission failed: {exc}"
    if decision.action != "resubmitted":
        try:
            from orchestrator.registry.store import Registry

            Registry.open().set_end_reason(job_id, decision.reason)
        except Exception as exc:  # noqa: BLE001
            say(f"end reason not recorded in the registry: {exc}")
    say(
        f"{decision.action}: {decision.reason}"
        + (
            f" -> job {decision.new_job_id} excluding {','.join(decision.exclude_nodes)}"
            if decision.new_job_id
            else ""
        )
    )
    append_decision(run_dir, decision)


#: ``requeue_as: auto``: from this ``cred_expire`` on, a same-job requeue's hold (``cred_expire`` + 1 s)
#: costs more than a new job id does, and the run continues as a new job.
NEW_JOB_FROM_CRED_EXPIRE_S = 30


def requeue_mode(requeue_as: str, cred_expire_s: int | None = None) -> str:
    """``same_job`` or ``new_job``: the profile's word, or for ``auto`` the cluster's ``cred_expire``
    (asked now with ``scontrol show config`` when not given; Slurm's default 120 s when it will not say)."""
    if requeue_as != "auto":
        return requeue_as
    if cred_expire_s is None:
        from orchestrator.schedulers.slurm.discover import parse_cred_expire

        try:
            config = subprocess.run(
                ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            config = ""
        cred_expire_s = parse_cred_expire(config)
    return "new_job" if cred_expire_s >= NEW_JOB_FROM_CRED_EXPIRE_S else "same_job"


def act_on_requeue(
    plan: LaunchPlan, run_dir: Path, job_id: str, restarts: int, attempt: int | None = None
) -> bool:
    """Training asked to come back: ``scontrol requeue`` unless cancelled, stopped by its budget
    (``attempt``'s ``budget_stop.json``) or out of requeues, or a successor job with ``requeue_as:
    new_job`` (True: handed over). Node 0 runs it, or the batch step when node 0 ran inside a
    container image."""
    from orchestrator.contract.budget_records import budget_stop
    from orchestrator.contract.requeue import decide_requeue

    stopped = budget_stop(run_dir, attempt) if attempt is not None else None
    if stopped is not None:
        print(f"[orchestrator node] not requeued: {stopped.get('reason')}", file=sys.stderr, flush=True)
        return False
    view = slurm_view(job_id)
    by_slurm = requeued_by_slurm(view, restarts)
    if by_slurm is not None:
        print(f"[orchestrator node] not requeued again: {by_slurm}", file=sys.stderr, flush=True)
        return False

    if requeue_mode(plan.profile.requeue_as) == "new_job":
        return continue_in_new_job(run_dir, job_id, plan, restarts, view)
    decision = decide_requeue(restarts, plan.max_requeues, cancelled_by_user(run_dir, job_id, view))
    if not decision.requeue:
        print(f"[orchestrator node] {decision.reason}", file=sys.stderr, flush=True)
        return False
    print(f"[orchestrator node] requeueing job {job_id} ({decision.reason})", flush=True)
    subprocess.run(["scontrol", "requeue", job_id], check=False, timeout=60)
    return False
