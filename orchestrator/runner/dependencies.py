"""Job dependencies (``--after JOB[:ok|any]``) as ``status`` and ``wait`` say them.

Slurm says ``Dependency`` while a job waits and ``DependencyNeverSatisfied`` when the job it waits
for ended so that it never can (``afterok`` on a job that FAILED); the batch script's
``--kill-on-invalid-dep=yes`` then cancels the waiting job instead of leaving it pending forever.
These words name neither the job waited for nor why, so they are replaced by a sentence that does,
from the plan the run directory keeps. Once the job is cancelled Slurm may keep either word, or
none (accounting records no reason): a cancelled job whose ``afterok`` job is known to the registry as
ended other than COMPLETED is then explained all the same.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

WAITING = "Dependency"
NEVER = "DependencyNeverSatisfied"
#: How :func:`explain`'s sentences start (``status`` shows them under its table).
PREFIXES = ("waiting for job", "dependency never satisfied")
_KIND = {"afterok": "to complete", "afterany": "to end"}


def dependencies(run_dir: Path) -> list[tuple[str, str]]:
    """``[(kind, job)]`` of the run's current plan, e.g. ``[("afterok", "123")]``."""
    from orchestrator.contract.run_dir import read_current_plan_json

    try:
        after = read_current_plan_json(Path(run_dir)).get("after") or []
    except (OSError, ValueError):
        return []
    return [tuple(str(a).split(":", 1)) for a in after if ":" in str(a)]  # type: ignore[misc]


def _failed_prerequisite(deps: list[tuple[str, str]], ask_scheduler: bool) -> tuple[str, str] | None:
    """``(job, state)`` of an ``afterok`` job that ended other than COMPLETED, by the registry, or
    (``ask_scheduler``: the only word left on why a job was cancelled) by one query of those jobs."""
    from orchestrator.contract.errors import OrchestratorError
    from orchestrator.registry.store import Registry

    with contextlib.suppress(OrchestratorError), Registry.open() as registry:
        jobs = registry.get_many([job_id for kind, job_id in deps if kind == "afterok"])
        if ask_scheduler and jobs:
            from orchestrator.runner.refresh import refresh_states

            refresh_states(registry, jobs)
            jobs = registry.get_many([j.job_id for j in jobs])
        for job in jobs:
            if job.last_state.is_terminal() and not job.last_state.is_success():
                return job.job_id, job.last_state.value
    return None


def explain(run_dir: Path, reason: str | None, ended: bool = False, cancelled: bool = False) -> str | None:
    """The scheduler's ``reason`` with the dependency spelled out; any other reason unchanged.
    ``ended``: the job is over, so it never ran (Slurm keeps ``Dependency`` on a job it cancelled for
    ``--kill-on-invalid-dep``); ``cancelled``: it ended CANCELLED, maybe with no reason left at all."""
    if reason not in (WAITING, NEVER) and not (cancelled and reason is None):
        return reason
    deps = dependencies(run_dir)
    if not deps:
        return reason
    named = ", ".join(f"job {job} {_KIND.get(kind, kind)}" for kind, job in deps)
    if reason == WAITING and not ended:
        return f"waiting for {named}"
    failed = _failed_prerequisite(deps, ask_scheduler=reason != NEVER)
    if reason != NEVER and failed is None:
        return reason  # cancelled, but nothing says it was for its dependency
    why = f"job {failed[0]} ended {failed[1]}" if failed else "it ended otherwise"
    return f"dependency never satisfied: waited for {named}, but {why}; cancelled ({NEVER})"
