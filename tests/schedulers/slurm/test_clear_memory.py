"""A job's memory checkpoint folders on a node go at the batch step's end: this job's, in every
allocation, and no other job's or run's (``orchestrator/schedulers/slurm/clear_memory.py``). The cluster
test of a spare's swap runs it on the nodes (``tests/cluster/test_restart_in_allocation.py``)."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.contract.env import MEMORY_CKPT_ROOT_ENV
from orchestrator.contract.memory_checkpoints import node_memory_ckpt_dir
from orchestrator.schedulers.slurm.clear_memory import clear_job_memory


def test_only_this_jobs_folders_go(tmp_path: Path) -> None:
    root, run, other_run = tmp_path / "shm", tmp_path / "run", tmp_path / "run2"
    ours = [node_memory_ckpt_dir(root, run, "123", key) for key in ("a0-n1", "a0-n2", "a1-n1")]
    theirs = [
        node_memory_ckpt_dir(root, run, "1234", "a0-n1"),  # a job id that starts with ours
        node_memory_ckpt_dir(root, other_run, "123", "a0-n1"),  # the same job id in another run
    ]
    for folder in ours + theirs:
        folder.mkdir(parents=True)
        (folder / "w2-r0-s00000004.pt").write_bytes(b"x")
    removed = clear_job_memory(run, "123", {MEMORY_CKPT_ROOT_ENV: str(root)})
    assert sorted(removed) == sorted(ours)
    assert not any(f.exists() for f in ours) and all(f.exists() for f in theirs)
    assert (root / f"orchestrator-{os.getuid()}").is_dir()
