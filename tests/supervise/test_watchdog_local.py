"""The hang watchdog on the local profile (issue 27 item 5): ``--hang-timeout`` was accepted there and
did nothing (a hung job ran for over 10 minutes). Here set by the profile's ``hang_timeout`` key. A real ``train/`` job, one rank stopped for real
(SIGSTOP by the pid of its heartbeat): the job ends FAILED within hang_timeout + a bound, with
``hang.json`` naming the stopped rank and every rank's stacks."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from orchestrator.contract.heartbeat import read_heartbeats
from orchestrator.contract.restarts import read_restarts
from orchestrator.contract.run_dir import attempt_dir, hang_dir, read_json
from tests.helpers.cli import REPO, job_and_run_dir, kill_tree, poll, run_cli, user_profile_dir
from tests.helpers.hold import rank_pid

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
ARGS = [
    *("--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"),
    *("--max-steps", "5000", "--ckpt-every", "0", "--eval-every", "0", "--seed", "0"),
]
HANG_TIMEOUT = 8
#: Seconds past hang_timeout for the job to read FAILED: a poll, py-spy on two ranks, the ending.
BOUND_S = 45


def _submit(
    orch_env: dict[str, str], tmp_path: Path, args: list[str], **profile: object
) -> tuple[dict[str, str], str, Path]:
    """``train/`` on 1 node x 2 processes under the local profile with ``hang_timeout`` (and
    ``profile``'s keys): the environment that names the profile, the job id, the run directory."""
    profiles = user_profile_dir(tmp_path, "local", hang_timeout=HANG_TIMEOUT, **profile)
    env = {**orch_env, "ORCHESTRATOR_PROFILES": str(profiles)}
    res = run_cli(
        ["submit", "--profile", "local", "--strategy", "ddp", "--nodes", "1", "--procs-per-node", "2"]
        + ["--", TRAIN, *args],
        env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    return env, job_id, run_dir


@pytest.fixture
def stopped(tmp_path: Path) -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    for record in (tmp_path / "runs").glob("*/local_pids.json"):
        for pid in json.loads(record.read_text()).values():
            kill_tree(int(pid))


def test_a_stopped_rank_fails_a_local_job_with_its_stacks(
    orch_env: dict[str, str], stopped: list[int], tmp_path: Path
) -> None:
    # By the profile's hang_timeout key (the flag's precedence over it: tests/config/profile/test_keys.py).
    # Without restarts: with them node 0 would restart the job in place after the hang.
    orch_env, job_id, run_dir = _submit(orch_env, tmp_path, ARGS, max_restarts=0)

    def training() -> dict | None:
        beats = read_heartbeats(attempt_dir(run_dir, 0))
        ok = len(beats) == 2 and all(int(b.get("step") or 0) >= 3 and b.get("step_s") for b in beats.values())
        return beats if ok else None

    poll(training, 240, "both ranks past step 3", interval=0.2)
    pid = int(read_heartbeats(attempt_dir(run_dir, 0))[1]["pid"])
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)
    t_stop = time.monotonic()
    poll(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, 10, "the rank stopped", interval=0.05)

    def ended() -> dict | None:
        row = json.loads(run_cli(["status", job_id, "--json"], orch_env, timeout=60).stdout)["jobs"][0]
        return row if row["terminal"] else None

    row = poll(
        ended,
        HANG_TIMEOUT + BOUND_S,
        "the hung job to end",
        interval=1.0,
        diagnostics=lambda: "".join(p.read_text() for p in run_dir.glob("logs/attempt_0/node_0.log"))[-3000:],
    )
    took = time.monotonic() - t_stop
    print(f"[watchdog local] {row['state']} {took:.1f} s after SIGSTOP (hang_timeout {HANG_TIMEOUT})")
    assert row["state"] == "FAILED", row
    assert row["reason"].startswith("hang: "), row
    # wait gives the same reason, not the watchdog's SIGKILL of the ranks (issue 41 item 8).
    waited = run_cli(["wait", job_id, "--poll", "0.5"], orch_env, timeout=60)
    assert waited.returncode == 1 and row["reason"] in waited.stdout, waited.stdout + waited.stderr
    assert "SIGKILL" not in waited.stdout, waited.stdout
    report = read_json(hang_dir(run_dir, 0) / "hang.json")
    assert report is not None and report["culprit_rank"] == 1, report
    assert {r["rank"] for r in report["ranks"]} == {0, 1}, report
    assert "state stopped" in (hang_dir(run_dir, 0) / "rank_1.txt").read_text()
    poll(
        lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
        30,
        "the stopped rank killed",
    )


def test_a_hung_local_job_is_restarted_in_place_after_its_stacks_are_saved(
    orch_env: dict[str, str], stopped: list[int], tmp_path: Path
) -> None:
    """With ``max_restarts`` (the profile's default 3) node 0 restarts the job after the hang, as
    Slurm's batch step does: the stacks first, then the same launchers fork attempt 1's ranks, which
    train from the newest checkpoint to the end."""
    args = [a if a != "5000" else "40" for a in ARGS]
    args[args.index("--ckpt-every") + 1] = "10"
    orch_env, job_id, run_dir = _submit(orch_env, tmp_path, args)
    pid = rank_pid(run_dir, 1, min_step=12)
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)
    waited = run_cli(["wait", job_id, "--poll", "0.5", "--timeout", "240"], orch_env, timeout=300)
    logs = "\n".join(p.read_text() for p in sorted(run_dir.glob("logs/attempt_*/node_*.log")))
    assert waited.returncode == 0, waited.stdout + waited.stderr + logs[-4000:]
    report = read_json(hang_dir(run_dir, 0) / "hang.json")
    assert report is not None and report["culprit_rank"] == 1, report
    restarts = read_restarts(run_dir)
    assert [(r["failed_attempt"], r["attempt"], r["in_place"]) for r in restarts] == [(0, 1, True)], restarts
    assert restarts[0]["cause"] == report["reason"], restarts
    assert restarts[0]["step"] >= 10 and restarts[0]["step"] % 10 == 0, restarts
    launchers = [(run_dir / "logs" / f"attempt_{a}" / "node_0.pid").read_text() for a in (0, 1)]
    assert launchers[0] == launchers[1], launchers
    assert json.loads((run_dir / "final.json").read_text())["step"] == 40
