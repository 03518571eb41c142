"""Job dependencies (``--after JOB[:ok|any]``) as ``status`` and ``wait`` say them.

Slurm says ``Dependency`` while a job waits and ``DependencyNeverSatisfied`` when the job it waits
for ended so that it never can (``afterok`` on a job that FAILED); the batch script's
``--kill-on-invalid-dep=yes`` then cancels the waiting job instead of leaving it pending forever.
These words name neither the job waited for nor why, so they are replaced by a sentence that does,
from the plan the run directory keeps.
"""

from __future__ import annotations

from pathlib import Path

WAITING = "Dependency"
NEVER = "DependencyNeverSatisfied"
#: How :func:`explain`'s sentences start (``status`` shows them under its table).
PREFIXES = ("waiting for job", "dependency never satisfied")
_KIND = {"afterok": "to complete", "afterany": "to end"}


def dependencies(run_dir: Path) -> list[tuple[str, str]]:
    """``[(kind, job)]`` of the run's current plan, e.g. ``[("afterok", "123")]``."""
    from orchestrator.run_dir import read_current_plan_json

    try:
        after = read_current_plan_json(Path(run_dir)).get("after") or []
    except (OSError, ValueError):
        return []
    return [tuple(str(a).split(":", 1)) for a in after if ":" in str(a)]  # type: ignore[misc]


def explain(run_dir: Path, reason: str | None, ended: bool = False) -> str | None:
    """The scheduler's ``reason`` with the dependency spelled out; any other reason unchanged.
    ``ended``: the job is over, so it never ran (Slurm keeps the reason ``Dependency`` on a job it
    cancelled for ``--kill-on-invalid-dep``)."""
    if reason not in (WAITING, NEVER):
        return reason
    deps = dependencies(run_dir)
    if not deps:
        return reason
    named = ", ".join(f"job {job} {_KIND.get(kind, kind)}" for kind, job in deps)
    if reason == WAITING and not ended:
        return f"waiting for {named}"
    return f"dependency never satisfied: waited for {named}, which ended otherwise; cancelled ({NEVER})"
