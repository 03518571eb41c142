"""Failures explain themselves on the real cluster: the crashed rank named, with its error line and the
command that shows its log."""

from __future__ import annotations

import pytest

from tests.helpers.cli import REPO, job_and_run_dir, run_cli

CRASH = str(REPO / "tests" / "scripts" / "crash_rank.py")


@pytest.mark.slow
def test_slurm_crashed_rank_is_explained(slurm_cluster: dict, orch_env: dict[str, str]) -> None:
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--nodes", "2", "--procs-per-node", "2", "--strategy", "ddp",
         "--wait", "--poll", "0.5", "--", CRASH, "--crash-rank", "3"],
        orch_env,
        timeout=240,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, _run_dir = job_and_run_dir(res.stdout)
    command = f"orchestrator logs {job_id} --node 1 --rank 3"
    assert "ValueError: boom from the test script (rank 3)" in res.stdout and command in res.stdout
    status = run_cli(["status", job_id], orch_env, timeout=60)
    assert "ValueError: boom from the test script (rank 3)" in status.stdout and command in status.stdout
