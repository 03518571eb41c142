"""A job's memory checkpoint folders on a node go at the batch step's end: this job's, in every
allocation, and no other job's or run's (``orchestrator/schedulers/slurm/clear_memory.py``); and at a
node task's start, the folders of the user's jobs that hold no allocation any more. The cluster
test of a spare's swap runs it on the nodes (``tests/cluster/test_restart_in_allocation.py``)."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.contract.env import MEMORY_CKPT_ROOT_ENV
from orchestrator.contract.memory_checkpoints import node_memory_ckpt_dir
from orchestrator.schedulers.slurm.clear_memory import clear_job_memory
from orchestrator.schedulers.slurm.node import ended_jobs_folders


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


def test_a_node_task_removes_the_folders_of_ended_and_pending_jobs_on_its_host(tmp_path: Path) -> None:
    """What a node task removes at its start (``SlurmNodeEnvironment.ended_jobs_memory``): other jobs'
    folders on its host whose job holds no allocation (ended, or pending again after a requeue); not a
    running job's, not its own job's (its earlier allocations are ``stale_memory_keys``'), not another
    host's, not a folder it cannot read as a Slurm job's."""
    run = tmp_path / "run"

    def name(job: str, key: str) -> str:
        return node_memory_ckpt_dir(tmp_path, run, job, key).name

    ended, pending = name("100", "a0-n1"), name("101", "a2-n1")
    running, array_task = name("102", "a0-n1"), name("103_4", "a0-n1")
    own, elsewhere, local = name("104", "a0-n1"), name("100", "a0-n2"), name("local-3", "node0")
    names = [ended, pending, running, array_task, own, elsewhere, local, "not-a-folder-of-ours"]
    # squeue's "%A %i %T": 101 is pending, 102 and the array's task 103_4 run (its own id 105)
    alive = {"102", "105", "103_4"}
    assert ended_jobs_folders(names, "n1", "104", alive) == [ended, pending]
    assert ended_jobs_folders(names, "n1", "104", None) == [ended, pending, running, array_task]
    assert ended_jobs_folders(names, "n3", "104", alive) == []
