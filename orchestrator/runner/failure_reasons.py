"""Failures of registered jobs explained (:mod:`orchestrator.supervise.failure_report` reads the
logs) and recorded as their ``end_reason``, once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from orchestrator.supervise.failure_report import Explanation, explain_failure, scan_errors

__all__ = [
    "EXPLAINED_STATES",
    "Explanation",
    "explain_failure",
    "explain_job",
    "record_explanations",
    "scan_errors",
]


def explain_job(job: object) -> Explanation | None:
    """:func:`explain_failure` for a registry record, with its scheduler's own log files."""
    from orchestrator.schedulers import get_scheduler

    run_dir = Path(getattr(job, "run_dir"))  # noqa: B009
    job_id = str(getattr(job, "job_id"))  # noqa: B009
    try:
        scheduler_logs = get_scheduler(str(getattr(job, "scheduler"))).log_files(run_dir, job_id)  # noqa: B009
    except Exception:  # an unknown scheduler name in an old registry: the node logs still speak
        scheduler_logs = []
    return explain_failure(
        run_dir,
        job_id,
        procs_per_node=int(getattr(job, "procs_per_node", 1) or 1),
        scheduler_logs=scheduler_logs,
    )


#: Ended states that a failure explains (CANCELLED, COMPLETED, PREEMPTED and TIMEOUT say why by
#: themselves: their ranks die of the stop signal, which is no error of theirs).
EXPLAINED_STATES = frozenset({"FAILED", "OUT_OF_MEMORY", "NODE_FAIL"})


def record_explanations(registry: object, jobs: Sequence[object], states: dict[str, str]) -> dict[str, str]:
    """For each ended, failed job with no ``end_reason`` yet: explain it and record the explanation as
    its ``end_reason`` (once: later calls read the registry). Returns ``{job_id: end_reason}`` set now.

    ``states``: ``{job_id: state name}`` as just queried."""
    recorded: dict[str, str] = {}
    for job in jobs:
        job_id = str(getattr(job, "job_id"))  # noqa: B009
        if states.get(job_id) not in EXPLAINED_STATES or getattr(job, "end_reason", None):
            continue
        why = explain_job(job)  # a hang's own reason when the watchdog ended it, as everywhere
        text = (
            why.summary()
            if why is not None
            else f"no error found in its logs; see `orchestrator logs {job_id}`"
        )
        try:
            registry.set_end_reason(job_id, text)  # type: ignore[attr-defined]
        except Exception:  # a read-only or vanished registry: show it anyway, record it next time
            pass
        recorded[job_id] = text
    return recorded
