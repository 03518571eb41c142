"""Submitting a sweep: the side-effecting half of ``orchestrator sweep`` (directories, scheduler, registry).

A sweep is one directory of run directories (``<sweep_dir>/task_<i>``), one per grid point, each an
ordinary run: its own plan, job id, attempts, metrics and checkpoints, so ``status``, ``logs``,
``resume`` and a requeue work on one task alone. On Slurm the tasks are one job array
(:meth:`Scheduler.dryrun_array`: ``--array=0-N%K``), the task ``<array>_<i>`` running in ``task_<i>``.

Everything that can refuse the sweep (the plans, the script, the cluster's limits, the run root) is
checked before the sweep directory is made. Unlike ``submit``, the array is not recorded as a
two-phase intent: a sweep command killed between sbatch and the registry leaves the array running
unrecorded (its tasks' run directories are complete; the scheduler lists it).

A sweep's budget (``--budget``, the profile's ``budget``) is one budget for all its tasks
(:mod:`orchestrator.config.sweep_budget`): kept in ``sweep.json``; a sweep with one is started by
our starter, a job per task, on every scheduler (not a job array, whose tasks Slurm starts itself),
which gives each task its cap as it starts it or refuses it.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.config.plan import LaunchPlan
from orchestrator.config.sweep_plan import sweep_plans
from orchestrator.contract.errors import OrchestratorError, UserError
from orchestrator.contract.permissions import run_umask, umask
from orchestrator.contract.run_dir import (
    JOB_ID_FILE,
    SWEEP_FILE,
    reserve_attempt,
    set_current_plan,
    write_json_atomic,
)
from orchestrator.contract.run_name import name_run
from orchestrator.notify.events import prepare as prepare_notify
from orchestrator.runner.submission import (
    _job_fields,
    _make_run_dir,
    _record_job,
    absolute_script,
    check_runs_root,
    check_submittable,
    plan_record,
    planned_run_dir,
)
from orchestrator.schedulers import get_scheduler

if TYPE_CHECKING:
    from orchestrator.registry.store import Registry
    from orchestrator.schedulers.base import Request


@dataclass(frozen=True)
class SubmittedSweep:
    sweep_id: str
    sweep_dir: Path
    job_ids: list[str]
    points: list[dict[str, str]]


def task_dir(sweep_dir: Path, task: int) -> Path:
    return Path(sweep_dir) / f"task_{task}"


def _checked(
    base: LaunchPlan, grid: Mapping[str, Sequence[str]], max_parallel: int
) -> list[tuple[dict[str, str], LaunchPlan]]:
    if max_parallel < 1:
        raise UserError(f"--max-parallel: expected an integer >= 1, got {max_parallel}")
    points = sweep_plans(base, grid)
    check_submittable(points[0][1])
    if _as_array(base):
        get_scheduler(base.profile.scheduler).check_array(len(points))  # MaxArraySize: arrays only
    check_runs_root()
    return points


def dry_run_sweep(
    base: LaunchPlan, grid: Mapping[str, Sequence[str]], max_parallel: int
) -> tuple[Request | None, list[tuple[dict[str, str], LaunchPlan]]]:
    """What :func:`submit_sweep` would submit now: the array request (None where the tasks are not
    one job array: a scheduler without arrays, or a sweep with a budget) and each task's parameters
    and plan."""
    points = _budgeted(base, _checked(base, grid, max_parallel))
    if not _as_array(base):
        return None, points
    sweep_dir = planned_run_dir(base)
    scheduler = get_scheduler(base.profile.scheduler)
    plans = [absolute_script(p) for _, p in points]
    return scheduler.dryrun_array(plans, sweep_dir, max_parallel, sys.executable), points


def _as_array(base: LaunchPlan) -> bool:
    """Whether the sweep's tasks are one job array. Not with a budget: the scheduler would start an
    array's tasks itself, and the sweep's budget needs to decide before each task whether it starts
    and with what cap (:mod:`orchestrator.config.sweep_budget`), which our starter does
    (:mod:`orchestrator.runner.local_sweep`, a job per task)."""
    return get_scheduler(base.profile.scheduler).has_arrays and base.budget is None


def _budgeted(
    base: LaunchPlan, points: list[tuple[dict[str, str], LaunchPlan]]
) -> list[tuple[dict[str, str], LaunchPlan]]:
    """The tasks' plans without the sweep's budget: the starter gives each its own cap as it starts it."""
    if base.budget is None:
        return points
    return [(params, replace(plan, budget=None)) for params, plan in points]


def submit_sweep(
    base: LaunchPlan, grid: Mapping[str, Sequence[str]], max_parallel: int, registry: Registry
) -> SubmittedSweep:
    scheduler = get_scheduler(base.profile.scheduler)
    points = _budgeted(base, _checked(base, grid, max_parallel))
    share = base.profile.share_with_group
    sweep_dir = planned_run_dir(base)
    if not _as_array(base):
        return _start_without_array(base, grid, points, max_parallel, registry, sweep_dir)
    with umask(run_umask(share)):
        _make_run_dir(sweep_dir, share)
        try:
            plans: list[LaunchPlan] = []
            dirs: list[Path] = []
            for i, (_, plan) in enumerate(points):
                path = task_dir(sweep_dir, i)
                path.mkdir(mode=0o750 if share else 0o700)
                plan = absolute_script(plan)
                record = plan_record(plan, path, None)
                reserve_attempt(path, record)
                prepare_notify(path, record)
                plans.append(plan)
                dirs.append(path)
            request = scheduler.dryrun_array(plans, sweep_dir, max_parallel, sys.executable)
            assert request is not None  # _checked: the scheduler has arrays
            write_json_atomic(
                sweep_dir / SWEEP_FILE,
                {
                    "grid": {k: list(v) for k, v in grid.items()},
                    "max_parallel": max_parallel,
                    "budget": None if base.budget is None else str(base.budget),
                    "tasks": [
                        {"task": i, "params": p, "run_dir": str(d)}
                        for i, ((p, _), d) in enumerate(zip(points, dirs, strict=True))
                    ],
                },
            )
            scheduled = scheduler.schedule_array(request, dirs, registry)
        except (OrchestratorError, OSError) as exc:
            shutil.rmtree(sweep_dir, ignore_errors=True)  # nothing reached the scheduler
            if isinstance(exc, OSError):
                raise UserError(f"cannot write sweep directory {sweep_dir}: {exc.strerror or exc}") from None
            raise
    job_ids = [s.job_id for s in scheduled]
    for path, plan, done in zip(dirs, plans, scheduled, strict=True):
        (path / JOB_ID_FILE).write_text(done.job_id)
        name_run(path, done.job_id)
        set_current_plan(path, 0)
        _record_job(registry, done.job_id, done.scheduler_job_id, 0, _job_fields(plan, path, None), "sweep")
    sweep_id = job_ids[0].split("_", 1)[0]
    registry.add_sweep(
        sweep_id=sweep_id,
        name=base.job_name,
        scheduler=base.profile.scheduler,
        sweep_dir=sweep_dir,
        grid=grid,
        max_parallel=max_parallel,
        tasks=[(i, j, p) for i, (j, (p, _)) in enumerate(zip(job_ids, points, strict=True))],
    )
    data = json.loads((sweep_dir / SWEEP_FILE).read_text())
    write_json_atomic(sweep_dir / SWEEP_FILE, {**data, "sweep_id": sweep_id, "job_ids": job_ids})
    return SubmittedSweep(sweep_id, sweep_dir, job_ids, [p for p, _ in points])


def _start_without_array(
    base: LaunchPlan,
    grid: Mapping[str, Sequence[str]],
    points: list[tuple[dict[str, str], LaunchPlan]],
    max_parallel: int,
    registry: Registry,
    sweep_dir: Path,
) -> SubmittedSweep:
    """A scheduler without arrays (local), or a sweep with a budget: the tasks' run directories and
    plans now, and a detached :mod:`orchestrator.runner.local_sweep` that submits them, a job each,
    ``max_parallel`` at a time."""
    from orchestrator.runner import local_sweep

    share = base.profile.share_with_group
    with umask(run_umask(share)):
        _make_run_dir(sweep_dir, share)
        tasks = []
        for i, (params, plan) in enumerate(points):
            path = task_dir(sweep_dir, i)
            path.mkdir(mode=0o750 if share else 0o700)
            tasks.append(
                {"task": i, "params": params, "run_dir": str(path), "plan": absolute_script(plan).to_json()}
            )
        sweep_id = f"sweep-{sweep_dir.name.rsplit('-', 1)[-1]}"
        grid_lists = {k: list(v) for k, v in grid.items()}
        write_json_atomic(
            sweep_dir / SWEEP_FILE,
            {
                "sweep_id": sweep_id,
                "grid": grid_lists,
                "max_parallel": max_parallel,
                "budget": None if base.budget is None else str(base.budget),
                "tasks": tasks,
            },
        )
        registry.add_sweep(
            sweep_id=sweep_id,
            name=base.job_name,
            scheduler=base.profile.scheduler,
            sweep_dir=sweep_dir,
            grid=grid,
            max_parallel=max_parallel,
            tasks=[],
        )
        local_sweep.start(sweep_dir, sweep_id)
    return SubmittedSweep(sweep_id, sweep_dir, [], [p for p, _ in points])
