"""The state of jobs now: one batched query per scheduler, written back to the registry.

This is what ``status``, ``logs -f``, ``wait`` and ``submit --wait`` poll.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orchestrator.contract.job_states import JobState
from orchestrator.schedulers.query import QueryResult, SchedulerState, combine, state_record

if TYPE_CHECKING:
    from orchestrator.registry.store import JobRecord, Registry

#: A job recorded in a terminal state at least this long ago is over for good and is not asked
#: about again (source ``final``): Slurm forgets an ended job after MinJobAge (300 s by default),
#: after which nothing -- not even a requeue -- can bring it back. ``status`` over a
#: registry of thousands of finished jobs thus asks the scheduler only about the live ones.
FINAL_AFTER_S = 3600.0


def _final(job: JobRecord) -> SchedulerState:
    """The recorded end of a job that ended over :data:`FINAL_AFTER_S` ago."""
    return state_record(
        job_id=job.job_id,
        state=job.last_state,
        raw_state=job.last_state.value,
        source="final",
        reason=job.reason,
        node_list=job.node_list,
        exit_code=job.exit_code,
        start=None,
        elapsed=None,
    )


def refresh_states(registry: Registry, jobs: Sequence[JobRecord], timeout_s: float = 5.0) -> QueryResult:
    """Current state of ``jobs`` (one batched query per scheduler), written back to the registry
    (history grows only on change, plus node list / exit code / reason).

    This is what ``status``, ``logs -f`` and ``submit --wait`` poll.
    """
    from orchestrator.schedulers import get_scheduler

    by_scheduler: dict[str, list[JobRecord]] = {}
    states: dict[str, SchedulerState] = {}
    settled = time.time() - FINAL_AFTER_S
    for job in jobs:
        if job.last_state_at <= settled and job.last_state.is_terminal():
            states[job.job_id] = _final(job)
        else:
            by_scheduler.setdefault(job.scheduler, []).append(job)
    fallback = {j.job_id: j.last_state for j in jobs}
    errors: list[str] = []
    calls = {"squeue": 0, "sacct": 0}
    for name, group in by_scheduler.items():
        result = get_scheduler(name).query(group, timeout_s, fallback)
        states.update(result.states)
        errors.extend(result.errors)
        for key, count in result.calls.items():
            calls[key] = calls.get(key, 0) + count
    by_source: dict[str, dict[str, JobState]] = {}
    for job_id, st in states.items():
        if not st.stale and st.source != "final":  # the registry's own values: nothing new to record
            by_source.setdefault(st.source, {})[job_id] = st.state
    info = {
        j: (s.node_list, s.exit_code, s.reason)
        for j, s in states.items()
        if not s.stale and s.source != "final" and (s.node_list or s.exit_code or s.reason)
    }
    # One read of what the registry holds for both comparisons (1,000 ids: a query per 500 each).
    current = registry.scheduler_columns({j for batch in by_source.values() for j in batch}.union(info))
    for source, batch in by_source.items():
        registry.record_states(batch, source=source, current=current)
    registry.set_scheduler_info(info, current=current)
    return combine(states, errors, calls)
