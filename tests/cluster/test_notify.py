"""Notifications on the real cluster: the batch step on the nodes owns each run's events and sends
them to a webhook receiver on the host's address of the cluster network, once each, in order, even
when the receiver is down for a minute (issue 41 item 1)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrator.rundir.summary import iter_metrics
from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli, sacct_state, user_profile_dir
from tests.helpers.run_dirs import trains
from tests.helpers.slurm_cluster import require_cluster, slurm
from tests.helpers.webhook import SECRET, Receiver

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
CRASH = str(REPO / "tests" / "scripts" / "crash_rank.py")
#: How long the receiver is down (the issue's figure).
OUTAGE_S = 60.0
HOOK_ENV = "ORCHESTRATOR_TEST_HOOK"
TINY = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"]


def _submit(env: dict[str, str], profiles: Path, *argv: str) -> tuple[str, Path]:
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "1", "--", *argv],
        env,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return job_and_run_dir(res.stdout)


def test_a_receiver_down_for_60_s_gets_every_event_of_each_job_once_in_order(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    """The batch step owns each run's events. The receiver is down for the first 60 s: the job to
    preempt starts, is stopped by USR2 (checkpoint, Slurm requeue: the next attempt's batch step sends
    what the first left), resumes and completes; the other's rank raises. ``status`` runs meanwhile in
    a shell without the secret. Then every event arrives once, in order, with its name."""
    cluster = require_cluster()
    host = cluster.controller_addr if cluster.netns else "127.0.0.1"
    down = Receiver(host)
    port, url = down.port, down.url
    down.close()  # connection refused until it comes back on the same port
    outage_ends = time.monotonic() + OUTAGE_S
    profiles = user_profile_dir(tmp_path, notify={"webhook_env": HOOK_ENV, "timeout_s": 180})
    with_secret = {**orch_env, HOOK_ENV: url}
    without_secret = dict(orch_env)
    jobs: list[str] = []
    receiver = None
    try:
        preempted, p_dir = _submit(
            with_secret, profiles, TRAIN, *TINY, "--max-steps", "40", "--ckpt-every", "1000"
        )
        failed, f_dir = _submit(with_secret, profiles, CRASH, "--crash-rank", "0")
        jobs = [preempted, failed]
        poll(lambda: len(trains(p_dir)) >= 3, 240, "3 train steps of the job to preempt")
        sent = run_cli(["cancel", preempted, "--signal", "USR2"], without_secret, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        poll(lambda: (p_dir / "logs" / "attempt_1").is_dir(), 180, "the requeued attempt")
        shown = run_cli(["status", preempted, failed, "--json"], without_secret, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert time.monotonic() < outage_ends, "the requeue came after the outage: the test proves nothing"
        for run_dir in (p_dir, f_dir):
            log = run_dir / "notify" / "notify.log"
            poll(
                lambda log=log: log.exists() and "started: webhook try 1 failed" in log.read_text(),
                60,
                "a try",
            )
        time.sleep(max(0.0, outage_ends - time.monotonic()))  # the outage itself, not a synchronisation
        receiver = Receiver(host, port=port)
        states = {j: sacct_state(j, timeout=300) for j in jobs}
    finally:
        for j in jobs:
            slurm("scancel", j, check=False)
    assert receiver is not None
    try:
        assert states == {preempted: "COMPLETED", failed: "FAILED"}, states
        shown = run_cli(["status", preempted, failed, "--json"], without_secret, timeout=60)
        rows = {r["job_id"]: r for r in json.loads(shown.stdout)["jobs"]}
        resumed_at = next(e["step"] for e in iter_metrics(p_dir) if e.get("event") == "resume")
        name = "ddp-1n"
        expected = {
            preempted: [
                f"{name}: job {preempted} started",
                f"{name}: job {preempted} requeued (attempt 1)",
                f"{name}: job {preempted} resumed from step {resumed_at} (attempt 1)",
                f"{name}: job {preempted} completed",
            ],
            failed: [
                f"{name}: job {failed} started",
                f"{name}: job {failed} FAILED: {rows[failed]['reason']}",
            ],
        }
        poll(
            lambda: len(receiver.texts()) >= 6,
            60,
            "6 notifications",
            diagnostics=lambda: str(receiver.texts()),
        )
        texts = receiver.texts()
        for job, events in expected.items():
            assert [t for t in texts if f"job {job} " in t] == events, texts
        assert len(texts) == 6, texts
        assert "ValueError: boom from the test script" in rows[failed]["reason"]
    finally:
        receiver.close()
    # The secret is in no file of any run directory (sbatch.sh, logs, events) nor the registry's folder.
    for folder in (p_dir, f_dir, Path(orch_env["ORCHESTRATOR_HOME"])):
        leaked = [p for p in folder.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
        assert leaked == [], leaked
