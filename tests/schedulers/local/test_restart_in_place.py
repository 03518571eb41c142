"""Restarts inside a local job (``max_restarts`` on ``--profile local``): node 0 decides what Slurm's
batch step decides, the nodes keep their launchers and fork the next attempt's ranks in place.

Before, ``max_restarts`` (3 by default) did nothing on the local profile: a killed rank failed the
job. Real local jobs through ``orchestrator submit``: two simulated nodes of one process each, real
gloo, a real SIGKILL of rank 1 (node 1); the restarted attempt re-trains the steps after the
checkpoint with losses equal to the ones the first attempt logged for them, to the bit."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from orchestrator.contract.restarts import read_restarts
from orchestrator.registry.store import Registry
from tests.helpers.cli import REPO, job_and_run_dir, run_cli, status_row, user_profile_dir
from tests.helpers.hold import rank_pid
from tests.helpers.run_dirs import launcher_pids, trains

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

TRAIN = str(REPO / "train" / "train.py")
CRASH = str(REPO / "tests" / "scripts" / "crash_rank.py")
CKPT_EVERY = 10
RUN_ARGS = [
    *("--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"),
    *("--max-steps", "40", "--ckpt-every", str(CKPT_EVERY)),
]
TWO_NODES = ["--profile", "local", "--strategy", "ddp", "--nodes", "2", "--procs-per-node", "1"]


@pytest.mark.parametrize("launcher", ["direct", "torchrun"])
def test_a_killed_rank_of_a_local_job_trains_again_in_place(
    orch_env: dict[str, str], tmp_path: Path, launcher: str
) -> None:
    """``launcher: torchrun``: torchrun's agent runs in
    the kept launcher, so the same launcher starts a new agent and its ranks."""
    profiles = user_profile_dir(tmp_path, "local", launcher=launcher)
    res = run_cli(
        ["submit", *TWO_NODES, "--profiles-dir", str(profiles), "--", TRAIN, *RUN_ARGS], orch_env, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    os.kill(rank_pid(run_dir, 1, min_step=CKPT_EVERY + 2), signal.SIGKILL)
    killed_at = time.time()
    waited = run_cli(["wait", job_id, "--poll", "0.5", "--timeout", "180"], orch_env, timeout=240)
    logs = "\n".join(p.read_text() for p in sorted(run_dir.glob("logs/attempt_*/node_*.log")))
    assert waited.returncode == 0, waited.stdout + waited.stderr + logs[-4000:]

    # One restart, decided by node 0, from a complete checkpoint, in the same job.
    restarts = read_restarts(run_dir)
    assert len(restarts) == 1, (restarts, logs[-4000:])
    restart = restarts[0]
    assert (restart["job_id"], restart["failed_attempt"], restart["attempt"]) == (job_id, 0, 1), restart
    assert "rank 1 died of SIGKILL" in restart["cause"] and restart["in_place"] is True, restart
    assert restart["step"] >= CKPT_EVERY and restart["step"] % CKPT_EVERY == 0, restart
    start = json.loads((run_dir / "logs" / "attempt_1" / "start.json").read_text())
    assert start["step"] == restart["step"], (start, restart)
    node0 = (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    assert "restart 1/3 in place (attempt 1" in node0, node0[-3000:]
    # In place: each node's launcher (its pid) outlived the failed ranks and forked attempt 1's.
    assert launcher_pids(run_dir, 0) == launcher_pids(run_dir, 1)
    assert [a.attempt for a in Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])).attempts(job_id)] == [0, 1]
    row = status_row(orch_env, job_id)
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, row

    # Exact: every step trained twice (after the checkpoint, before the kill) has the same loss in
    # both attempts, and the run reached its last step once more after the restart.
    seen: dict[int, list[float]] = {}
    for event in trains(run_dir):
        seen.setdefault(event["step"], []).append(event["loss"])
    again = {step: losses for step, losses in seen.items() if len(losses) > 1}
    assert again and min(again) == restart["step"] + 1, sorted(again)
    assert all(len(set(losses)) == 1 for losses in again.values()), again
    assert max(seen) == 40 and len(seen[40]) == 1, sorted(seen)
    back = min(e["time"] for e in trains(run_dir) if e["time"] > restart["time"])  # attempt 1's first
    print(f"[restart local] kill -9 of rank 1 to its next trained step: {back - killed_at:.1f} s")


def test_max_restarts_on_a_local_job_then_the_death_is_the_reason(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """A rank that aborts every time: one restart (``max_restarts: 1``), then the job ends FAILED naming
    the abort, and both nodes, waiting with their launchers kept, are told why they end."""
    profiles = user_profile_dir(tmp_path, "local", max_restarts=1)
    res = run_cli(
        ["submit", *TWO_NODES, "--profiles-dir", str(profiles), "--wait", "--poll", "0.5",
         "--", CRASH, "--crash-rank", "1", "--abort"],
        orch_env, timeout=180,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    restarts = read_restarts(run_dir)
    assert [(r["failed_attempt"], r["attempt"], r["in_place"]) for r in restarts] == [(0, 1, True)], restarts
    assert "SIGABRT" in restarts[0]["cause"], restarts
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["attempt_0", "attempt_1"]
    for node in (0, 1):
        log = (run_dir / "logs" / "attempt_1" / f"node_{node}.log").read_text()
        assert "not restarted in place: 1 restart(s) reached max_restarts" in log, log[-2000:]
    row = status_row(orch_env, job_id)
    assert row["state"] == "FAILED" and row["restarts"] == 1 and "SIGABRT" in (row["reason"] or ""), row
