"""Notifications on the real cluster: the batch step on the nodes sends to a webhook receiver on the
host's address of the cluster network, each event once. Three jobs at once, one node each: one
preempted (``cancel --signal USR2``: checkpoint, Slurm requeue) that resumes and completes, one
whose rank raises, one whose webhook is down (it completes all the same; the retries are logged)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from orchestrator.rundir.summary import iter_metrics
from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli, sacct_state, user_profile_dir
from tests.helpers.slurm_cluster import require_cluster, slurm
from tests.helpers.webhook import SECRET, Receiver

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
CRASH = str(REPO / "tests" / "scripts" / "crash_rank.py")
TINY = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"]


def _submit(env: dict[str, str], profiles: Path, *argv: str) -> tuple[str, Path]:
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "1", "--", *argv],
        env,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return job_and_run_dir(res.stdout)


def _steps(run_dir: Path) -> int:
    return sum(1 for e in iter_metrics(run_dir) if e.get("event") == "train")


def test_preempted_failed_and_unreachable_jobs_notify_each_event_once(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    cluster = require_cluster()
    host = cluster.controller_addr if cluster.netns else "127.0.0.1"
    receiver = Receiver(host)
    dead = Receiver(host)
    dead_url = dead.url
    dead.close()  # its port now refuses connections
    (tmp_path / "live.url").write_text(receiver.url + "\n")
    (tmp_path / "dead.url").write_text(dead_url + "\n")
    (tmp_path / "live").mkdir()
    (tmp_path / "dead").mkdir()
    live = user_profile_dir(tmp_path / "live", notify={"webhook_file": str(tmp_path / "live.url")})
    down = user_profile_dir(
        tmp_path / "dead", notify={"webhook_file": str(tmp_path / "dead.url"), "timeout_s": 3}
    )
    jobs: list[str] = []
    try:
        preempted, p_dir = _submit(orch_env, live, TRAIN, *TINY, "--max-steps", "40", "--ckpt-every", "1000")
        failed, f_dir = _submit(orch_env, live, CRASH, "--crash-rank", "0")
        unheard, u_dir = _submit(orch_env, down, TRAIN, *TINY, "--max-steps", "3")
        jobs = [preempted, failed, unheard]
        poll(lambda: _steps(p_dir) >= 3, 240, "3 train steps of the job to preempt")
        sent = run_cli(["cancel", preempted, "--signal", "USR2"], orch_env, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        states = {j: sacct_state(j, timeout=240) for j in jobs}
    finally:
        for j in jobs:
            slurm("scancel", j, check=False)
    assert states == {preempted: "COMPLETED", failed: "FAILED", unheard: "COMPLETED"}, states

    def heard() -> Counter[str]:
        return Counter(receiver.texts())

    poll(lambda: sum(heard().values()) >= 6, 30, "6 notifications", diagnostics=lambda: str(heard()))
    # status on the login host sees the same events: all claimed already, nothing sent twice
    shown = run_cli(["status", preempted, failed, unheard, "--json"], orch_env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    rows = {r["job_id"]: r for r in json.loads(shown.stdout)["jobs"]}
    resumed_at = next(e["step"] for e in iter_metrics(p_dir) if e.get("event") == "resume")
    receiver.close()
    name = "ddp-1n"
    assert heard() == Counter(
        [
            f"{name}: job {preempted} started",
            f"{name}: job {preempted} requeued (attempt 1)",
            f"{name}: job {preempted} resumed from step {resumed_at} (attempt 1)",
            f"{name}: job {preempted} completed",
            f"{name}: job {failed} started",
            f"{name}: job {failed} FAILED: {rows[failed]['reason']}",
        ]
    ), heard()
    assert "ValueError: boom from the test script" in rows[failed]["reason"]
    # Receiver down: the job completed, every try is in the run's notification log, without the URL.
    log = (u_dir / "notify" / "notify.log").read_text()
    assert "started: webhook try 1 failed" in log and "started: webhook FAILED after" in log, log
    assert f"end.{unheard}: webhook FAILED after" in log, log
    # The secret is in no file of any run directory (sbatch.sh, logs, claims) nor the registry's folder.
    for folder in (p_dir, f_dir, u_dir, Path(orch_env["ORCHESTRATOR_HOME"])):
        leaked = [p for p in folder.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
        assert leaked == [], leaked
