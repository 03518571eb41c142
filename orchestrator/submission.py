"""Submission: the side-effecting half of ``submit`` and ``resume`` (run directory, scheduler, registry).

Order matters: everything is validated (plan, script, the cluster's own limits) before the run
directory is created or the scheduler is touched, so a refused request leaves nothing behind. The
text submitted is the request :meth:`Scheduler.dryrun` made, the same one ``--dry-run`` prints.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import UserError
from orchestrator.plan import LaunchPlan
from orchestrator.render import accelerate_launch_command
from orchestrator.run_dir import CANCEL_MARKER, JOB_ID_FILE, SNAPSHOT_DIR, next_attempt, write_plan
from orchestrator.schedulers import get_scheduler

if TYPE_CHECKING:
    from orchestrator.schedulers.base import Request

#: What the plan's recorded command shows where the node's own config path goes.
NODE_CONFIG_PLACEHOLDER = "<node config>"


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_dir: Path
    scheduler: str
    submitit_job: Any = None


def runs_root() -> Path:
    """Where run directories go: $ORCHESTRATOR_RUNS or ./runs (must be on a shared filesystem for Slurm)."""
    return Path(os.environ.get("ORCHESTRATOR_RUNS", "runs")).absolute()


def check_script(plan: LaunchPlan) -> None:
    if not Path(plan.script).is_file():
        raise UserError(f"training script not found: {plan.script}")


def check_submittable(plan: LaunchPlan) -> None:
    """Everything that can refuse a submission without creating anything."""
    check_script(plan)
    get_scheduler(plan.profile.scheduler).check(plan)


def planned_run_dir(plan: LaunchPlan) -> Path:
    """The path a new run directory for ``plan`` gets (not created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", plan.job_name)[:40]
    return runs_root() / f"{stamp}-{safe_name}-{uuid.uuid4().hex[:6]}"


def snapshot_script(plan: LaunchPlan, run_dir: Path) -> LaunchPlan:
    """Copy the script's folder so later edits do not change a queued job."""
    source = Path(plan.script).resolve().parent
    target = run_dir / SNAPSHOT_DIR
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "runs", ".git", "*.pyc"))
    return replace(plan, script=str(target / Path(plan.script).name))


def absolute_script(plan: LaunchPlan) -> LaunchPlan:
    return replace(plan, script=str(Path(plan.script).resolve()))


def dry_run(plan: LaunchPlan) -> Request:
    """The request ``submit`` would make for ``plan`` now, in the run directory it would create."""
    check_submittable(plan)
    run_dir = planned_run_dir(plan)
    return get_scheduler(plan.profile.scheduler).dryrun(absolute_script(plan), run_dir, 0, sys.executable)


def plan_record(plan: LaunchPlan, run_dir: Path, resumed_from: str | None) -> dict[str, Any]:
    """The plan as the run directory keeps it: enough to re-submit by hand."""
    return {
        **plan.to_json(),
        "run_dir": str(run_dir),
        "python": sys.executable,
        "cwd": os.getcwd(),
        "submitted_at": time.time(),
        "command": accelerate_launch_command(NODE_CONFIG_PLACEHOLDER, plan.script, plan.script_args),
        "resumed_from": resumed_from,
    }


def submit(
    plan: LaunchPlan,
    *,
    snapshot: bool = False,
    registry: Any = None,
    existing_run_dir: Path | None = None,
    resumed_from: str | None = None,
    request: Request | None = None,
) -> Submitted:
    """Validate, create the run directory, submit, record the job.

    ``existing_run_dir`` (resume) reuses a run directory: checkpoints and metrics continue there,
    attempt numbers go on from the last one. ``request``: one made by :func:`dry_run` for this very
    plan, submitted as it is.
    """
    scheduler = get_scheduler(plan.profile.scheduler)
    check_submittable(plan)
    if existing_run_dir is None:
        run_dir = request.run_dir if request is not None else planned_run_dir(plan)
        run_dir.mkdir(parents=True)
        plan = snapshot_script(plan, run_dir) if snapshot else absolute_script(plan)
    else:
        run_dir = existing_run_dir
        plan = absolute_script(plan)
        scheduler.prepare_run_dir(registry, run_dir)
        (run_dir / CANCEL_MARKER).unlink(missing_ok=True)  # a resumed job starts a new outcome
    attempt_base = next_attempt(run_dir)
    if (
        request is None
        or request.plan != plan
        or request.run_dir != run_dir
        or request.attempt_base != attempt_base
    ):
        request = scheduler.dryrun(plan, run_dir, attempt_base, sys.executable)
    write_plan(run_dir, attempt_base, plan_record(plan, run_dir, resumed_from))
    scheduled = scheduler.schedule(request, registry)
    (run_dir / JOB_ID_FILE).write_text(scheduled.job_id)
    if registry is not None:
        registry.add_job(
            job_id=scheduled.job_id,
            name=plan.job_name,
            profile=plan.profile_name,
            scheduler=plan.profile.scheduler,
            strategy=plan.options.strategy,
            nodes=plan.nodes,
            procs_per_node=plan.procs_per_node,
            command=[plan.script, *plan.script_args],
            run_dir=run_dir,
            max_requeues=plan.max_requeues,
        )
        registry.add_attempt(
            scheduled.job_id,
            attempt=attempt_base,
            scheduler_job_id=scheduled.scheduler_job_id,
            started_from_checkpoint=resumed_from,
        )
    return Submitted(
        job_id=scheduled.job_id,
        run_dir=run_dir,
        scheduler=plan.profile.scheduler,
        submitit_job=scheduled.handle,
    )
