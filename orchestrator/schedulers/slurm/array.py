"""Slurm job arrays: a sweep's tasks as one ``sbatch --array=0-N%K`` (:mod:`orchestrator.runner.sweep_submit`).

Kept apart from :mod:`orchestrator.schedulers.slurm.scheduler` (one job each). The array's batch script is the
single job's (:func:`orchestrator.config.render.render_sbatch` with ``array``), so a task runs exactly like a
job: its own run directory ``task_<i>``, node entry, requeue (``scontrol requeue <array>_<i>`` requeues
that task alone) and resume. Its node task is written before sbatch as ``array_task.pkl`` and linked
by the script to the name submitit looks up for the task, so no task can start before it exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.contract.errors import RunFailure, UserError
from orchestrator.contract.run_dir import ARRAY_TASK_FILE, SBATCH_FILE, SUBMITIT_DIR
from orchestrator.schedulers.base import Request, Scheduled, submission_token
from orchestrator.schedulers.slurm.environment import INHERITED_PREFIXES, SCANCEL_TIMEOUT_S, SINFO_TIMEOUT_S

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan

#: Slurm's own default when ``scontrol show config`` does not say.
DEFAULT_MAX_ARRAY_SIZE = 1001


def array_request(
    plans: Sequence[LaunchPlan], sweep_dir: Path, max_parallel: int, python: str | None = None
) -> Request:
    """The array's request: pure, like ``SlurmScheduler.dryrun`` (the plans differ only in their
    script arguments, which live in each task's plan file, not in the script)."""
    from orchestrator.config.render import render_sbatch

    plan = plans[0]
    node_python = plan.profile.python or python or sys.executable
    spec = f"0-{len(plans) - 1}%{min(max_parallel, len(plans))}"
    folder = str(Path(sweep_dir) / SUBMITIT_DIR)
    text = render_sbatch(plan, str(sweep_dir), folder, node_python, 0, array=spec)
    token = submission_token(sweep_dir, 0)
    text = text.replace("#SBATCH ", f"#SBATCH --comment={token}\n#SBATCH ", 1)
    return Request(
        plan=plan,
        run_dir=Path(sweep_dir),
        text=text,
        file_name=SBATCH_FILE,
        attempt_base=0,
        extra={"token": token, "array": spec},
    )


def max_array_size(config: str) -> int:
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize" and value.strip().isdigit():
            return int(value.strip())
    return DEFAULT_MAX_ARRAY_SIZE


def check_array_size(tasks: int) -> None:
    """Slurm refuses an array index >= ``MaxArraySize``: say so before anything is made."""
    from orchestrator.schedulers.query import run_bounded

    res = run_bounded(["scontrol", "show", "config"], SINFO_TIMEOUT_S)
    if res.error is not None:
        raise RunFailure(f"scontrol show config failed: {res.error}")
    limit = max_array_size(res.stdout)
    if tasks > limit:
        raise UserError(
            f"--grid: {tasks} tasks, but this cluster's MaxArraySize is {limit} (scontrol show config), "
            f"so one job array holds at most {limit}; split the grid into sweeps of at most {limit}"
        )


def submit_array(scheduler: str, request: Request, task_dirs: Sequence[Path]) -> list[Scheduled]:
    """sbatch the request's text as written to the sweep directory; one Scheduled per task."""
    from submitit.core.utils import DelayedSubmission

    from orchestrator.schedulers.base import node_task

    script = request.run_dir / request.file_name
    script.write_text(request.materialize())
    for task_dir in task_dirs:
        (task_dir / SUBMITIT_DIR).mkdir(parents=True, exist_ok=True)
        task = node_task(run_dir=str(task_dir), scheduler=scheduler, attempt_base=0)
        DelayedSubmission(task).dump(task_dir / SUBMITIT_DIR / ARRAY_TASK_FILE)
    # Submitted from inside an allocation, sbatch would inherit its SLURM_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_PREFIXES)}
    try:
        proc = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            capture_output=True,
            text=True,
            timeout=SCANCEL_TIMEOUT_S,
            env=env,
            cwd=request.run_dir,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RunFailure(f"sbatch of the job array failed: {exc}") from None
    array_id = proc.stdout.strip().split(";")[0]
    if proc.returncode != 0 or not array_id.isdigit():
        raise RunFailure(f"sbatch refused the job array: {proc.stderr.strip() or proc.stdout.strip()}")
    return [
        Scheduled(job_id=f"{array_id}_{i}", scheduler_job_id=f"{array_id}_{i}") for i in range(len(task_dirs))
    ]
