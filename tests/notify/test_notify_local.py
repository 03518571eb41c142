"""Notifications of a ``local`` job, end to end through the CLI (issue 41 item 1): node 0 owns the
run's events. The receiver is down for the first 60 s while the job is submitted, preempted (USR2),
resumed as a new job and completed; ``status`` runs meanwhile in a shell without the secret. Every
event then arrives exactly once, in order, with its name; no command waited on the receiver."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrator.rundir.summary import iter_metrics
from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli, user_profile_dir
from tests.helpers.run_dirs import trains
from tests.helpers.webhook import SECRET, Receiver

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]
TRAIN = str(REPO / "train" / "train.py")
TINY = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"]
#: How long the receiver is down (the issue's figure).
OUTAGE_S = 60.0
HOOK_ENV = "ORCHESTRATOR_TEST_HOOK"


def test_a_receiver_down_for_60_s_gets_every_event_of_a_preempted_resumed_job_once_in_order(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    down = Receiver()
    port, url = down.port, down.url
    down.close()  # connection refused until it comes back on the same port
    outage_ends = time.monotonic() + OUTAGE_S
    profiles = user_profile_dir(tmp_path, "local", notify={"webhook_env": HOOK_ENV, "timeout_s": 180})
    with_secret = {**orch_env, HOOK_ENV: url}
    without_secret = dict(orch_env)  # another shell: the variable is not set there
    common = ["--profile", "local", "--profiles-dir", str(profiles)]
    res = run_cli(
        [
            "submit",
            *common,
            "--nodes",
            "1",
            "--procs-per-node",
            "1",
            "--",
            TRAIN,
            *TINY,
            "--max-steps",
            "400",
        ],
        with_secret,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    first, run_dir = job_and_run_dir(res.stdout)
    poll(lambda: len(trains(run_dir)) >= 3, 120, "3 train steps")
    assert run_cli(["cancel", first, "--signal", "USR2"], with_secret, timeout=60).returncode == 0
    waited = run_cli(["wait", first, "--timeout", "120"], without_secret, timeout=150)
    assert waited.returncode == 1 and "PREEMPTED" in waited.stdout, waited.stdout + waited.stderr
    shown = run_cli(["status", first, "--json"], without_secret, timeout=60)
    assert shown.returncode == 0 and json.loads(shown.stdout)["jobs"][0]["state"] == "PREEMPTED", shown.stdout
    resumed = run_cli(["resume", first], with_secret, timeout=60)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    second = resumed.stdout.split("submitted job ")[1].split()[0]
    done = run_cli(["wait", second, "--timeout", "240"], without_secret, timeout=270)
    assert done.returncode == 0, done.stdout + done.stderr
    assert run_cli(["status", "--json"], without_secret, timeout=60).returncode == 0
    assert time.monotonic() < outage_ends, "the job outlived the outage: the test proves nothing"
    log = run_dir / "notify" / "notify.log"
    assert "started: webhook try 1 failed" in log.read_text(), log.read_text()

    time.sleep(max(0.0, outage_ends - time.monotonic()))  # the outage itself, not a synchronisation
    up = Receiver(port=port)
    try:
        name = json.loads((run_dir / "job.json").read_text())["job_name"]
        resumed_at = next(e["step"] for e in iter_metrics(run_dir) if e.get("event") == "resume")
        expected = [
            f"{name}: job {first} started",
            f"{name}: job {first} preempted (checkpointed on a signal and stopped); "
            f"`orchestrator resume {first}` continues it",
            f"{name}: continued as job {second} (attempt 1)",
            f"{name}: job {second} resumed from step {resumed_at} (attempt 1)",
            f"{name}: job {second} completed",
        ]
        # The owners retry with backoff (at most 30 s apart) while they wait, up to notify.timeout_s.
        poll(lambda: len(up.texts()) >= len(expected), 90, "every event", diagnostics=lambda: log.read_text())
        assert up.texts() == expected, up.texts()
    finally:
        up.close()
    everything = b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())
    assert SECRET.encode() not in everything
    modes = {oct(p.stat().st_mode & 0o777) for p in (run_dir / "notify").rglob("*")}
    assert modes <= {"0o600", "0o700"}, modes
