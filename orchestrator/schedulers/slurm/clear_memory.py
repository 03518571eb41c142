"""``python -m orchestrator.schedulers.slurm.clear_memory RUN_DIR JOB_ID``: remove this node's memory checkpoint
folders of a job (``contract.memory_checkpoints``).

With spare nodes a node task that ends badly keeps its folder, for the new step a spare's swap
starts (``NodeEnvironment.memory_outlives_task``). When the job ends after a failure or a swap, the
batch step runs this on every node still in the allocation (one task each), so that no node keeps
the job's state in its memory (``/dev/shm`` lives until a reboot, where a site does not run Slurm's
``job_container/tmpfs``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from orchestrator.contract.memory_checkpoints import (
    job_memory_ckpt_prefix,
    memory_ckpt_root,
    user_memory_ckpt_dir,
)
from orchestrator.schedulers.slurm.environment import srun_on_every_node


def clear_job_memory(run_dir: Path, job_id: str, environ: dict[str, str]) -> list[Path]:
    """Remove every folder of ``job_id`` under this node's memory root; returns those removed."""
    parent = user_memory_ckpt_dir(memory_ckpt_root(environ))
    prefix = job_memory_ckpt_prefix(run_dir, job_id)
    removed = []
    for folder in sorted(parent.glob(f"{prefix}*")):
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


#: How long the nodes may take to remove a failed job's memory checkpoints.
CLEAR_MEMORY_TIMEOUT_S = 30.0


def clear_memory_on(run_dir: Path, job_id: str, nodes: list[str], say: Callable[[str], None]) -> None:
    """With spare nodes a node task that ended badly keeps its memory checkpoints for the step a swap
    starts (``NodeEnvironment.memory_outlives_task``). At the end, after a failure or a swap (the nodes
    left out may still hold theirs), every node still in removes the job's (this module's ``main``,
    one task per node), best effort and bounded."""
    if not nodes:
        return
    argv = [
        *srun_on_every_node(nodes),
        sys.executable,
        "-m",
        "orchestrator.schedulers.slurm.clear_memory",
        str(run_dir),
        job_id,
    ]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=CLEAR_MEMORY_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        say(f"memory checkpoints not removed from the nodes: {exc}")
        return
    if done.returncode != 0:
        say(f"memory checkpoints not removed from every node: {(done.stderr or '').strip()[-300:]}")


def main(argv: list[str] | None = None) -> int:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.contract.run_dir import read_current_plan_json

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m orchestrator.schedulers.slurm.clear_memory RUN_DIR JOB_ID", file=sys.stderr)
        return 2
    run_dir, job_id = Path(args[0]), args[1]
    profile_env = LaunchPlan.from_json(read_current_plan_json(run_dir)).profile.env
    environ = {**os.environ, **{k: str(v) for k, v in profile_env.items()}}
    clear_job_memory(run_dir, job_id, environ)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
