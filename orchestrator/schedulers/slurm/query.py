"""Ask Slurm what state jobs are in: one batched call, bounded in time, never hanging.

``status`` over 1,000 jobs must not run 1,000 ``squeue`` processes (each one is an RPC to
slurmctld; a few hundred per second are enough to make a cluster admin unhappy). So:

1. ONE ``squeue -h -j id1,id2,...`` for every id asked;
2. at most ONE ``sacct -j ...`` for the ids squeue does not list, which also gives exit code,
   reason, node list and times. Without ``-t`` squeue lists pending, running and completing jobs
   only (measured, Slurm 22.05): a job that has ended is sacct's at once, not after MinJobAge;
3. for whatever is still unknown -- or if squeue/sacct are missing, fail, or time out -- the
   registry's last known state, and the result is marked ``stale``.

Every subprocess runs in its own session with a deadline; on expiry the whole process group is
killed, so a wrapper script that left a grandchild holding the pipe cannot hang us either.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from orchestrator.contract.errors import OrchestratorError
from orchestrator.contract.job_states import JobState
from orchestrator.schedulers.query import (
    STATE_DEFAULTS,
    CommandResult,
    QueryResult,
    SchedulerState,
    combine,
    run_bounded,
)
from orchestrator.schedulers.slurm.states import from_slurm, normalize_slurm_state

if TYPE_CHECKING:
    from orchestrator.registry.store import Registry

SQUEUE_FORMAT = "%i|%T|%r|%N|%S|%M"
#: Slurm's sources of a job's state: the live queue, then accounting (a job squeue has forgotten).
SOURCE_RANKS = {"squeue": 0, "sacct": 1}
SACCT_FIELDS = "JobID,State,ExitCode,Reason,NodeList,Start,End,Elapsed"
#: Slurm job ids we pass to squeue/sacct: plain, array task (123_4) or het component (123+1).
_SLURM_ID_RE = re.compile(r"^\d+(?:_\d+)?(?:\+\d+)?$")
#: Fraction of ``timeout_s`` squeue may use; sacct gets the rest.
SQUEUE_SHARE = 0.6

_NULLS = frozenset({"", "(null)", "None", "Unknown", "N/A"})


def _opt(text: str) -> str | None:
    text = text.strip()
    return None if text in _NULLS else text


def parse_squeue(output: str) -> dict[str, SchedulerState]:
    """Parse ``squeue -h -o '%i|%T|%r|%N|%S|%M'`` output."""
    states: dict[str, SchedulerState] = {}
    mapped: dict[str, tuple[JobState, str]] = {}  # a few distinct state words in 1,000 lines
    for line in output.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        if len(parts) < 6:
            parts += [""] * (6 - len(parts))
        job_id, raw, reason, nodes, start, elapsed = map(str.strip, parts[:6])
        known = mapped.get(raw)
        if known is None:
            known = mapped[raw] = (from_slurm(raw), normalize_slurm_state(raw))
        # Not SchedulerState(...): its frozen __init__ is most of the cost of a 1,000-line answer.
        # The fields already stripped, _opt is a set lookup.
        state = states[job_id] = SchedulerState.__new__(SchedulerState)
        state.__dict__.update(
            STATE_DEFAULTS,
            job_id=job_id,
            state=known[0],
            raw_state=known[1],
            source="squeue",
            reason=None if reason in _NULLS else reason,
            node_list=None if nodes in _NULLS else nodes,
            start=None if start in _NULLS else start,
            elapsed=None if elapsed in _NULLS else elapsed,
        )
    return states


_ARRAY_RANGE_RE = re.compile(r"^(\d+)_\[([0-9,\-]+)(?:%\d+)?\]$")


def _array_task_ids(job_id: str) -> list[str]:
    """``123_[0-3,7%2]`` (sacct's line for array tasks that never started) -> ``123_0`` ... ``123_7``."""
    m = _ARRAY_RANGE_RE.match(job_id)
    if not m:
        return []
    ids: list[str] = []
    for part in m.group(2).split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            ids.extend(f"{m.group(1)}_{i}" for i in range(int(first), int(last or first) + 1))
    return ids


def parse_sacct(output: str) -> dict[str, SchedulerState]:
    """Parse ``sacct -n -P -X -o JobID,State,ExitCode,Reason,NodeList,Start,End,Elapsed`` output.

    With ``-X`` there is one line per allocation; if the same id appears twice the later line
    (the most recent incarnation of a requeued job) wins.
    """
    states: dict[str, SchedulerState] = {}
    for line in output.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        parts += [""] * (8 - len(parts))
        job_id, raw, exit_code, reason, nodes, start, end, elapsed = (p.strip() for p in parts[:8])
        if "." in job_id:  # a step (batch/extern/0) slipped through: the allocation line counts
            continue
        for task_id in _array_task_ids(job_id):  # a job array's tasks not yet split: one line
            states[task_id] = SchedulerState(
                job_id=task_id,
                state=from_slurm(raw),
                raw_state=raw.strip(),
                source="sacct",
                reason=_opt(reason),
                node_list=None,
                exit_code=_opt(exit_code),
                start=_opt(start),
                end=_opt(end),
                elapsed=_opt(elapsed),
            )
        states[job_id] = SchedulerState(
            job_id=job_id,
            state=from_slurm(raw),
            raw_state=raw.strip(),
            source="sacct",
            reason=_opt(reason),
            node_list=_opt(nodes) if nodes.strip() != "None assigned" else None,
            exit_code=_opt(exit_code),
            start=_opt(start),
            end=_opt(end),
            elapsed=_opt(elapsed),
        )
    return states


def _squeue_says_none_known(res: CommandResult) -> bool:
    """``squeue -j <one finished id>`` exits 1 with "Invalid job id specified": not a failure,
    just "I don't know this job" -- which sends it on to sacct like any other aged-out id."""
    return res.returncode == 1 and "invalid job id" in res.stderr.lower()


def query_states(
    job_ids: Iterable[str],
    timeout_s: float = 5.0,
    registry: Registry | None = None,
    fallback: Mapping[str, JobState] | None = None,
) -> QueryResult:
    """States of Slurm jobs ``job_ids`` with one squeue call and at most one sacct call.

    ``timeout_s`` bounds the whole query (sacct gets what squeue left). Ids neither tool answers
    fall back to ``fallback[id]``, else the registry's last state, else UNKNOWN -- all stale.
    """
    ids = list(dict.fromkeys(str(j) for j in job_ids))
    deadline = time.monotonic() + timeout_s
    errors: list[str] = []
    calls = {"squeue": 0, "sacct": 0}
    states: dict[str, SchedulerState] = {}
    queryable = [j for j in ids if _SLURM_ID_RE.match(j)]

    if queryable:
        calls["squeue"] += 1
        # squeue gets 60% of the budget so a hung slurmctld still leaves sacct (slurmdbd) a chance.
        res = run_bounded(
            # -r: one line per array task (a sweep's pending tasks are otherwise one "123_[2-9%2]").
            ["squeue", "-h", *(["-r"] if any("_" in j for j in queryable) else []), "-j", ",".join(queryable)]
            + ["-o", SQUEUE_FORMAT],
            timeout_s * SQUEUE_SHARE,
        )
        if res.error is None:
            found = parse_squeue(res.stdout)
            asked = set(queryable)  # once, not per answer: 1,000 ids made this quadratic
            states.update({j: s for j, s in found.items() if j in asked})
        elif not _squeue_says_none_known(res):
            errors.append(res.error)

    missing = [j for j in queryable if j not in states]
    remaining = deadline - time.monotonic()
    if missing and remaining > 0.05:
        calls["sacct"] += 1
        # An array's tasks that never started are one accounting record, found only by the array's id.
        arrays = sorted({j.split("_", 1)[0] for j in missing if "_" in j})
        res = run_bounded(
            ["sacct", "-n", "-P", "-X", "-j", ",".join([*missing, *arrays]), "-o", SACCT_FIELDS], remaining
        )
        if res.error is None:
            found = parse_sacct(res.stdout)
            asked = set(missing)
            states.update({j: s for j, s in found.items() if j in asked})
        else:
            errors.append(res.error)
    elif missing:
        errors.append("no time left for sacct")

    last_known: dict[str, JobState] = dict(fallback or {})
    for job_id in ids:
        if job_id in states:
            continue
        if job_id not in last_known and registry is not None:
            # Unknown to the registry too: report UNKNOWN below.
            with contextlib.suppress(OrchestratorError):
                last_known[job_id] = registry.get(job_id).last_state
        prev = last_known.get(job_id, JobState.UNKNOWN)
        states[job_id] = SchedulerState(
            job_id=job_id, state=prev, raw_state=prev.value, source="registry", stale=True
        )

    return combine(states, errors, calls, SOURCE_RANKS, empty="squeue")
