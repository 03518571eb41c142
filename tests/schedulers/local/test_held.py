"""A local job's allocation (``orchestrator cost``) from its own records: each node's
``node_<N>.held.json``, read whatever JSON it holds; the living processes of a running job; the files'
times of a job whose nodes were killed before they could write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry
from orchestrator.schedulers.local.held import local_allocations, read_held
from orchestrator.schedulers.local.scheduler import LocalScheduler
from tests.helpers.cli import REPO, kill_tree, poll

T0 = 1_800_000_000.0


def _held(attempt: Path, node: int, text: str) -> None:
    attempt.mkdir(parents=True, exist_ok=True)
    (attempt / f"node_{node}.held.json").write_text(text)


def _job(registry: Registry, run: Path, job_id: str = "local-1", state: JobState = JobState.COMPLETED):
    run.mkdir(parents=True, exist_ok=True)
    (run / "job_id").write_text(job_id)
    return registry.add_job(
        job_id=job_id,
        name="n",
        profile="local",
        scheduler="local",
        strategy="ddp",
        nodes=2,
        procs_per_node=2,
        command=["train.py"],
        run_dir=run,
        submitted_at=T0 - 2,
        state=state,
    )


def record(node: int, start: object, end: object, job: str = "local-1", **kw: object) -> str:
    return json.dumps(
        {"job_id": job, "node": node, "pid": 1, "start": start, "end": end, "cpus": 2, "gpus": 0, **kw}
    )


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2]",
        "null",
        '"x"',
        "{not json",
        record(0, "x", T0),
        record(0, T0, None),
        record(0, T0, [1]),
        record(0, True, T0),
        '{"start": NaN, "end": 1800000000}',
        record(0, T0 + 10, T0),  # ends before it starts
    ],
)
def test_a_record_of_any_shape_is_read_or_left_out(tmp_path: Path, text: str) -> None:
    _held(tmp_path, 0, text)
    _held(tmp_path, 1, record(1, T0, T0 + 5, cpus="two", gpus=None))
    (only,) = read_held(tmp_path)
    assert (only["start"], only["end"], only["cpus"], only["gpus"]) == (T0, T0 + 5, 0, 0)


def test_a_jobs_allocation_spans_its_nodes_on_their_resources(tmp_path: Path) -> None:
    run = tmp_path / "run"
    attempt = run / "logs" / "attempt_0"
    _held(attempt, 0, record(0, T0 + 0.1, T0 + 30.0))
    _held(attempt, 1, record(1, T0 + 0.2, T0 + 31.5))
    _held(run / "logs" / "attempt_1", 0, record(0, T0 + 50, T0 + 60, job="local-2"))  # a later job's
    with Registry.open(tmp_path / "home") as registry:
        job = _job(registry, run)
        found = LocalScheduler().allocations_of([job], 10.0)
    assert found is not None
    (alloc,) = found["local-1"]
    assert (alloc.start, alloc.end, alloc.cpus, alloc.gpus, alloc.nodes) == (T0 + 0.1, T0 + 31.5, 4, 0, 2)
    assert (alloc.submit, alloc.state) == (T0 - 2, "COMPLETED")


def test_a_job_killed_before_its_nodes_wrote_is_estimated_from_its_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    attempt = run / "logs" / "attempt_0"
    attempt.mkdir(parents=True)
    for name, at in (("node_0.pid", T0 + 1), ("node_0.log", T0 + 20)):
        (attempt / name).write_text("x")
        os.utime(attempt / name, (at, at))
    (run / "job.json").write_text(json.dumps({"profile": {"gpus_per_node": 0, "cpus_per_task": 2}}))
    with Registry.open(tmp_path / "home") as registry:
        job = _job(registry, run, state=JobState.FAILED)
        other = _job(registry, tmp_path / "other", job_id="local-9")
        (tmp_path / "other" / "job_id").write_text("local-10")  # a later job owns that run now
        found = local_allocations([job, other])
    (alloc,) = found["local-1"]
    assert (alloc.start, alloc.end) == (T0 + 1, T0 + 20)
    assert (alloc.cpus, alloc.gpus) == (2 * 2 * 2, 0)  # 2 nodes x 2 processes x 2 CPUs each
    assert found["local-9"] == []


def test_a_running_job_is_billed_from_its_living_processes(tmp_path: Path) -> None:
    """While the job's processes hold the run (orchestrator.contract.run_alive), its allocation runs
    from its node processes' own start until now (``end`` None)."""
    run = tmp_path / "run"
    (run / "logs" / "attempt_0").mkdir(parents=True)
    node = (
        "import sys, time; from orchestrator.contract import run_alive; "
        f"run_alive.hold({str(run)!r}); print('held', flush=True); time.sleep(60)"
    )
    controller = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {node!r}])"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert controller.stdout is not None and controller.stdout.readline().strip() == "held"
        (run / "local_pids.json").write_text(json.dumps({"controller": controller.pid}))
        with Registry.open(tmp_path / "home") as registry:
            job = _job(registry, run, state=JobState.RUNNING)
            (alloc,) = poll(lambda: local_allocations([job])["local-1"], 30, "the running allocation")
        assert alloc.end is None and alloc.state == "RUNNING"
        assert alloc.start is not None and controller_start(controller.pid) <= alloc.start <= time.time()
        assert alloc.cpus == 2 * 2  # no profile recorded: one CPU per process
    finally:
        kill_tree(controller.pid)
        controller.wait(10)


def controller_start(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()
