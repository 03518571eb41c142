"""A user's DDP loop with ``ResumableLoop`` (examples/accelerate_cnn.py) resumes bit-exactly on CPU at
world size 4 (issue 27, item 9): after ``cancel --signal USR2`` and ``orchestrator resume``, every loss of
the 96 steps equals an uninterrupted run's, to the bit.

At three or more ranks the ring all-reduce's summation order depends on DDP's gradient-bucket layout,
which DDP rebuilt after the first iteration of each process: before the loop fixed the layout
(orchestrator/rank/loop.py: fix_ddp_buckets) a resumed run drifted by ~1e-7 relative.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.contract.attempt_start import read_attempt_start
from tests.helpers.cli import REPO, job_and_run_dir, kill_tree, poll, run_cli
from tests.helpers.train_launch import losses

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

LOOP = str(REPO / "examples" / "accelerate_cnn.py")
WORLD_4 = ["--profile", "local", "--nodes", "2", "--procs-per-node", "2", "--strategy", "ddp"]
ARGS = ["--epochs", "3", "--save-every", "20"]


def test_a_resumed_ddp_loop_at_world_4_equals_an_uninterrupted_run(orch_env: dict[str, str]) -> None:
    reference = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", *WORLD_4, "--wait", "--", LOOP, *ARGS],
        cwd=REPO, env=orch_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        ref_out, ref_err = reference.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(reference.pid)
        raise AssertionError("the uninterrupted run did not finish in 300 s") from None
    assert reference.returncode == 0, ref_out + ref_err
    ref_dir = job_and_run_dir(ref_out)[1]

    res = run_cli(["submit", *WORLD_4, "--", LOOP, *ARGS], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    poll(lambda: (run_dir / "checkpoints" / "step_00000020" / "COMPLETE.json").exists(), 180, "step 20 saved")
    assert run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60).returncode == 0
    res = run_cli(["wait", job_id, "--timeout", "120"], orch_env, timeout=150)
    assert "PREEMPTED" in res.stdout, res.stdout + res.stderr
    res = run_cli(["resume", job_id], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    new_job = res.stdout.split("submitted job ")[1].split()[0]
    res = run_cli(["wait", new_job, "--timeout", "300"], orch_env, timeout=330)
    assert res.returncode == 0, res.stdout + res.stderr
    start = read_attempt_start(run_dir, 1)
    assert start is not None and 20 <= start["step"] < 96, start

    want, got = losses(ref_dir), losses(run_dir)
    assert sorted(want) == list(range(1, 97)) and sorted(got) == sorted(want), (sorted(want), sorted(got))
    differ = [(step, want[step], got[step]) for step in want if want[step] != got[step]]
    assert differ == [], f"resumed at step {start['step']}: {len(differ)} of 96 losses differ: {differ[:5]}"
