"""The state of jobs now: one batched query per scheduler, written back to the registry.

This is what ``status``, ``logs -f``, ``wait`` and ``submit --wait`` poll.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.contract import run_alive
from orchestrator.contract.job_states import JobState
from orchestrator.contract.run_dir import JOB_ID_FILE
from orchestrator.schedulers.query import QueryResult, SchedulerState, combine, state_record

if TYPE_CHECKING:
    from orchestrator.registry.store import JobRecord, Registry

#: A job recorded in a terminal state at least this long ago is over for good and is not asked
#: about again (source ``final``): Slurm's controller forgets an ended job after MinJobAge (300 s by
#: default; its plain queue listing never shows one: schedulers/slurm/query.py), after which
#: nothing -- not even a requeue -- can bring it back. ``status`` over a
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


def settle(job: JobRecord, st: SchedulerState, ends_for_good: bool) -> SchedulerState:
    """The two rules every scheduler's answer passes through.

    An ended state is final: a job recorded as ended stays ended where nothing can run it again
    under its id (``ends_for_good``). Measured before this rule: moving a COMPLETED local job's run
    directory turned it PENDING ("local launcher has not started"), recorded as such, and ``wait``
    never returned. A job has ended only when its processes are gone: an end reported while a
    process of the run still holds the run's lock (:mod:`orchestrator.contract.run_alive`) reads
    RUNNING, naming the pids."""
    if job.last_state.is_terminal() and not st.state.is_terminal():
        if ends_for_good:
            return replace(
                st, state=job.last_state, raw_state=job.last_state.value, reason=st.reason or job.reason
            )
        return st
    if st.state.is_terminal() and not job.last_state.is_terminal() and _newest_of_its_run(job):
        living = run_alive.holders(job.run_dir)
        if living is not None:
            where = f"pid {', '.join(map(str, living))}" if living else "a process on another host"
            return replace(
                st,
                state=JobState.RUNNING,
                raw_state=JobState.RUNNING.value,
                reason=f"{st.state.value} reported, but {where} of the run still runs",
            )
    return _budget_stopped(job, st)


def _budget_stopped(job: JobRecord, st: SchedulerState) -> SchedulerState:
    """A job its budget stopped ends BUDGET on every scheduler: Slurm calls its exit 1 FAILED, and
    ``wait``, ``list`` and a sweep read the registry this records (``budget_stop.json`` names it)."""
    if not st.state.is_terminal() or st.state in (JobState.COMPLETED, JobState.BUDGET, JobState.CANCELLED):
        return st
    from orchestrator.contract.budget_records import budget_stop

    marker = budget_stop(Path(job.run_dir))
    if marker is None or marker.get("job_id") != job.job_id:
        return st
    why = f"{marker.get('reason') or 'budget'}; continue with resume --budget MORE"
    return replace(st, state=JobState.BUDGET, reason=why)


def _newest_of_its_run(job: JobRecord) -> bool:
    """Whether the run directory's ``job_id`` file names ``job`` (a resume hands it to a new job)."""
    try:
        return (Path(job.run_dir) / JOB_ID_FILE).read_text().strip() in ("", job.job_id)
    except OSError:
        return False


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
    calls: dict[str, int] = {}
    ranks: dict[str, int] = {}
    for name, group in by_scheduler.items():
        scheduler = get_scheduler(name)
        ranks.update(scheduler.source_ranks)
        result = scheduler.query(group, timeout_s, fallback)
        for job in group:
            st = result.states.get(job.job_id)
            if st is not None:
                states[job.job_id] = settle(job, st, scheduler.kind.ends_for_good)
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
    return combine(states, errors, calls, ranks)
