"""Submission: the side-effecting half of ``submit`` (run directory, scheduler, registry).

Order matters: everything is validated (plan, script, partition size via sinfo)
before the run directory is created or the scheduler is touched, so a refused
request leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import RunFailure, UserError
from orchestrator.plan import LaunchPlan
from orchestrator.render import render_sbatch
from orchestrator.run_dir import CANCEL_MARKER, LOCAL_STATE_FILE, local_state

SINFO_TIMEOUT_S = 15.0


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
    script = Path(plan.script)
    if not script.is_file():
        raise UserError(f"training script not found: {plan.script}")


def partition_nodes(partition: str) -> int:
    """How many nodes a partition has, asking sinfo (bounded)."""
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-p", partition, "-o", "%D"],
            capture_output=True,
            text=True,
            timeout=SINFO_TIMEOUT_S,
        )
    except FileNotFoundError:
        raise UserError("sinfo not found: this profile needs a Slurm cluster (or use --profile local)") from None
    except subprocess.TimeoutExpired:
        raise RunFailure(f"sinfo did not answer within {SINFO_TIMEOUT_S:.0f} s: is slurmctld up?") from None
    if proc.returncode != 0:
        raise RunFailure(f"sinfo failed: {proc.stderr.strip() or proc.returncode}")
    counts = [int(x) for x in proc.stdout.split() if x.isdigit()]
    if not counts:
        raise UserError(f"--profile: partition '{partition}' does not exist on this cluster (sinfo knows nothing of it)")
    return sum(counts)


def check_cluster(plan: LaunchPlan) -> None:
    if plan.profile.scheduler != "slurm":
        return
    assert plan.profile.partition is not None
    available = partition_nodes(plan.profile.partition)
    if plan.nodes > available:
        raise UserError(
            f"--nodes: {plan.nodes} nodes requested but partition '{plan.profile.partition}' has {available}"
        )


def new_run_dir(plan: LaunchPlan) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", plan.job_name)[:40]
    run_dir = runs_root() / f"{stamp}-{safe_name}-{uuid.uuid4().hex[:6]}"
    run_dir.mkdir(parents=True)
    return run_dir


def snapshot_script(plan: LaunchPlan, run_dir: Path) -> LaunchPlan:
    """Copy the script's folder so later edits do not change a queued job."""
    source = Path(plan.script).resolve().parent
    target = run_dir / "snapshot"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "runs", ".git", "*.pyc"))
    from dataclasses import replace

    return replace(plan, script=str(target / Path(plan.script).name))


def absolute_script(plan: LaunchPlan) -> LaunchPlan:
    from dataclasses import replace

    return replace(plan, script=str(Path(plan.script).resolve()))


def _slurm_executor_class() -> Any:
    """A submitit SlurmExecutor whose sbatch text is our Jinja template (golden-tested)."""
    import submitit

    class TemplateSlurmExecutor(submitit.SlurmExecutor):
        plan: LaunchPlan
        run_dir: Path

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            text = render_sbatch(self.plan, command, str(self.run_dir), str(self.folder), sys.executable)
            (self.run_dir / "sbatch.sh").write_text(text)
            return text

    return TemplateSlurmExecutor


def _time_minutes(limit: str) -> int:
    days = 0
    if "-" in limit:
        d, limit = limit.split("-", 1)
        days = int(d)
    parts = [int(p) for p in limit.split(":")]
    if len(parts) == 1 and days == 0:
        return parts[0]
    while len(parts) < 3:
        parts.append(0)
    hours, minutes, seconds = parts[:3]
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def next_attempt(run_dir: Path) -> int:
    """Attempts are numbered across every scheduler job that used this run directory."""
    numbers = [int(p.name.split("_", 1)[1]) for p in (run_dir / "logs").glob("attempt_*") if p.name.split("_", 1)[1].isdigit()]
    return max(numbers) + 1 if numbers else 0


@contextlib.contextmanager
def standard_streams_to(log: Path) -> Iterator[None]:
    """Point fds 0-2 at /dev/null and ``log`` while the local job's controller is started.

    submitit's LocalExecutor starts a controller that outlives the CLI with ``Popen`` and no
    redirection, so it would inherit the CLI's stdout: ``JOB=$(orchestrator submit --profile local ...)``
    or a pipe into ``tee`` would then block until the whole job ends (measured: the 19 s of a 150-step
    run), and the controller could write into the caller's terminal later."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    try:
        with open(os.devnull, "rb") as null_in, open(log, "ab") as out:
            os.dup2(null_in.fileno(), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        yield
    finally:
        for fd, copy in zip((0, 1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def record_handed_over_local_job(registry: Any, run_dir: Path) -> None:
    """Before a resumed local job takes over ``run_dir``, write the previous job's outcome (read from
    the files about to be replaced) into the registry: afterwards only the registry knows it."""
    try:
        previous = (run_dir / "job_id").read_text().strip()
    except OSError:
        return
    if previous:
        try:
            registry.record_state(previous, local_state(run_dir).state, source="run_dir")
        except UserError:
            pass  # not in this registry (another ORCHESTRATOR_HOME): nothing to keep


def submit(
    plan: LaunchPlan,
    *,
    snapshot: bool = False,
    registry: Any = None,
    existing_run_dir: Path | None = None,
    resumed_from: str | None = None,
) -> Submitted:
    """Validate, create the run directory, submit through submitit, record the job.

    ``existing_run_dir`` (resume) reuses a run directory: checkpoints and metrics continue there,
    attempt numbers go on from the last one.
    """
    from orchestrator.node_entry import NodeTask

    check_script(plan)
    check_cluster(plan)
    if existing_run_dir is None:
        run_dir = new_run_dir(plan)
        plan = snapshot_script(plan, run_dir) if snapshot else absolute_script(plan)
    else:
        run_dir = existing_run_dir
        plan = absolute_script(plan)
        if plan.profile.scheduler == "local" and registry is not None:
            record_handed_over_local_job(registry, run_dir)
        for stale in (LOCAL_STATE_FILE, CANCEL_MARKER):
            (run_dir / stale).unlink(missing_ok=True)  # a resumed job starts a new outcome
    attempt_base = next_attempt(run_dir)
    folder = run_dir / "submitit"
    job_key = registry.allocate_local_id() if (registry is not None and plan.profile.scheduler == "local") else ""
    job_json = {
        **plan.to_json(),
        "run_dir": str(run_dir),
        "python": sys.executable,
        "cwd": os.getcwd(),
        "submitted_at": time.time(),
        "command": ["accelerate", "launch", "--config_file", "<node config>", plan.script, *plan.script_args],
    }
    if existing_run_dir is None:
        (run_dir / "job.json").write_text(json.dumps(job_json, indent=2))
    else:
        job_json["resumed_from"] = resumed_from
        (run_dir / f"job.attempt_{attempt_base}.json").write_text(json.dumps(job_json, indent=2))
    task = NodeTask(plan_json=plan.to_json(), run_dir=str(run_dir), job_key=job_key, attempt_base=attempt_base)
    minutes = max(1, _time_minutes(plan.time_limit))
    import submitit

    if plan.profile.scheduler == "slurm":
        executor = _slurm_executor_class()(folder=folder, max_num_timeout=plan.max_requeues)
        executor.plan = plan
        executor.run_dir = run_dir
        executor.update_parameters(nodes=plan.nodes, ntasks_per_node=1, time=minutes)
        try:
            job = executor.submit(task)
        except subprocess.CalledProcessError as exc:
            output = (exc.output or b"").decode(errors="replace").strip() if isinstance(exc.output, bytes) else exc.output
            raise RunFailure(f"sbatch refused the job: {output or exc}") from None
        job_id = str(job.job_id)
    else:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(tasks_per_node=plan.nodes, timeout_min=minutes, signal_delay_s=plan.profile.signal.seconds_before)
        folder.mkdir(parents=True, exist_ok=True)
        with standard_streams_to(folder / "controller.log"):
            job = executor.submit(task)
        job_id = job_key or f"local-{job.job_id}"
        (run_dir / "local_pids.json").write_text(json.dumps({"controller": int(job.job_id)}))
    (run_dir / "job_id").write_text(job_id)
    if registry is not None:
        registry.add_job(
            job_id=job_id,
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
        registry.add_attempt(job_id, attempt=attempt_base, scheduler_job_id=str(job.job_id), started_from_checkpoint=resumed_from)
    return Submitted(job_id=job_id, run_dir=run_dir, scheduler=plan.profile.scheduler, submitit_job=job)
