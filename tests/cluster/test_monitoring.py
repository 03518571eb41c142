"""status / logs / cancel against the real Slurm cluster (the registry is real SQLite, the scheduler real Slurm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, kill_tree, probe_args, run_cli, sacct_state, user_profile_dir

TRAIN = str(REPO / "train" / "train.py")


def _status(job_id: str, env: dict) -> dict:
    res = run_cli(["status", "--json", job_id], env, timeout=30)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_status_follows_pending_running_completed(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    # --begin keeps the job PENDING for a few seconds: the first state is observable, not a race.
    profiles = user_profile_dir(tmp_path, extra_sbatch={"begin": "now+4"})
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--profiles-dir",
            str(profiles),
            "--nodes",
            "2",
            *probe_args(2, tmp_path / "o"),
        ],
        orch_env,
    )
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.split("submitted job ")[1].split()[0]
    seen: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = _status(job_id, orch_env)["jobs"][0]["state"]
        if not seen or seen[-1] != state:
            seen.append(state)
        if state == "COMPLETED":
            break
        time.sleep(0.3)
    assert seen[0] == "PENDING" and seen[-1] == "COMPLETED" and "RUNNING" in seen, seen
    hist = run_cli(["list", "--json"], orch_env).stdout
    assert job_id in hist


def test_cancel_shows_cancelled_and_logs_follow_stops(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--nodes",
            "2",
            "--",
            TRAIN,
            "--preset",
            "tiny",
            "--data",
            "synthetic",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--max-steps",
            "100000",
            "--log-every",
            "1",
        ],
        orch_env,
    )
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.split("submitted job ")[1].split()[0]
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    follower = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "logs", job_id, "-f", "--interval", "0.2"],
        cwd=REPO,
        env=orch_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            m = run_dir / "metrics.jsonl"
            if m.exists() and m.read_text().count('"train"') >= 2:
                break
            time.sleep(0.3)
        else:
            pytest.fail("training did not start")
        cancel = run_cli(["cancel", job_id], orch_env)
        assert cancel.returncode == 0, cancel.stderr
        assert sacct_state(job_id, timeout=90).startswith("CANCELLED")
        out, _ = follower.communicate(timeout=90)  # -f ends by itself when the job ends
        assert "[orchestrator node]" in out and "node_rank=0" in out
        assert _status(job_id, orch_env)["jobs"][0]["state"] == "CANCELLED"
    finally:
        kill_tree(follower.pid)
        subprocess.run(["scancel", job_id], timeout=30)


def test_status_answers_stale_when_accounting_is_down(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--nodes",
            "1",
            "--wait",
            "--poll",
            "0.5",
            *probe_args(1, tmp_path / "o"),
        ],
        orch_env,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job_id = res.stdout.split("submitted job ")[1].split()[0]
    base = Path(slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_BASE", "/tmp/orchestrator-slurm"))
    dbd = int((base / "run" / "slurmdbd.pid").read_text())
    ctld = int((base / "run" / "slurmctld.pid").read_text())
    # SIGSTOP: a hung daemon is worse than a dead one (clients block instead of failing fast).
    os.kill(dbd, signal.SIGSTOP)
    try:
        started = time.monotonic()
        answer = _status(job_id, orch_env)
        assert time.monotonic() - started < 25
        assert answer["jobs"][0]["state"] == "COMPLETED"  # the registry's answer: not stale
        os.kill(ctld, signal.SIGSTOP)
        try:
            started = time.monotonic()
            answer = _status(job_id, orch_env)
            elapsed = time.monotonic() - started
        finally:
            os.kill(ctld, signal.SIGCONT)
        job = answer["jobs"][0]
        assert answer["stale"] is True and job["stale"] is True
        assert job["state"] == "COMPLETED"  # the registry's last known state
        assert elapsed < 25, elapsed
    finally:
        os.kill(dbd, signal.SIGCONT)
