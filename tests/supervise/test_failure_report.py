"""Failures explain themselves (orchestrator/runner/failure_reasons.py): the failing node and rank, the
first error lines, and the exact `orchestrator logs` command, in `--wait`, `status` and end_reason.

The end-to-end tests crash a real rank (tests/scripts/crash_rank.py) under real local and Slurm
jobs; the parsing tests feed the reader the log text real runs produce."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from orchestrator.supervise.failure_report import explain_failure, scan_errors
from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli, user_profile_dir

CRASH = str(REPO / "tests" / "scripts" / "crash_rank.py")
TRAIN = str(REPO / "train" / "train.py")

# What node 0's log looked like when rank 3 (node 1) raised: its own ranks died of the consequence.
NODE0_LOG = """\
[orchestrator node] host=vm node_rank=0/2 job=local-1 attempt=0
[default0]:[rank0]: Traceback (most recent call last):
[default0]:[rank0]:   File "x.py", line 27, in main
[default0]:[rank0]:     work.wait()
[default0]:[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8068
Traceback (most recent call last):
  File "launcher", line 1, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
[orchestrator node] host=vm node_rank=0 exit=1 after 7.8 s
"""
NODE1_LOG = """\
[orchestrator node] host=vm node_rank=1/2 job=local-1 attempt=0
[default1]:[rank3]: Traceback (most recent call last):
[default1]:[rank3]:   File "x.py", line 25, in main
[default1]:[rank3]:     raise ValueError("boom")
[default1]:[rank3]:     ^^^^^^^^^^^^^^^^^^^^^^^^
[default1]:[rank3]: ValueError: boom (rank 3)
[default0]:[rank2]: RuntimeError: Connection closed by peer
[orchestrator node] host=vm node_rank=1 exit=1 after 7.8 s
"""


def _attempt(run_dir: Path, logs: dict[int, str], codes: dict[int, int]) -> Path:
    path = run_dir / "logs" / "attempt_0"
    path.mkdir(parents=True)
    for node, text in logs.items():
        (path / f"node_{node}.log").write_text(text)
    for node, code in codes.items():
        (path / f"node_{node}.exit").write_text(str(code))
    return path


def test_root_cause_wins_over_its_consequences(tmp_path: Path) -> None:
    _attempt(tmp_path, {0: NODE0_LOG, 1: NODE1_LOG}, {0: 1, 1: 1})
    why = explain_failure(tmp_path, "local-1", procs_per_node=2)
    assert why is not None
    assert (why.node, why.rank) == (1, 3)
    assert why.lines[0] == "ValueError: boom (rank 3)"
    assert why.logs_command == "orchestrator logs local-1 --node 1 --rank 3"
    assert "ValueError: boom (rank 3)" in why.summary() and why.logs_command in why.summary()


def test_traceback_exception_line_and_disk_full(tmp_path: Path) -> None:
    errors = scan_errors(
        [
            "[default0]:Could not load random states",
            "[default0]:Traceback (most recent call last):",
            '[default0]:  File "ckpt.py", line 3, in save',
            "[default0]:OSError: [Errno 28] No space left on device: '/ckpt/step_4'",
        ]
    )
    assert errors[0].lines == ["OSError: [Errno 28] No space left on device: '/ckpt/step_4'"]


def test_error_only_in_the_scheduler_files_is_surfaced(tmp_path: Path) -> None:
    """A bad network_interface raises in the node entry point, before any rank exists: the node log
    says nothing useful, submitit's stderr has the traceback."""
    _attempt(tmp_path, {0: "[orchestrator node] received SIGTERM while no training runs\n"}, {})
    err = tmp_path / "submitit" / "44_1_log.err"
    err.parent.mkdir()
    err.write_text(
        "submitit ERROR (2026-11-22) - Submitted job triggered an exception\n"
        "Traceback (most recent call last):\n"
        '  File "node_entry.py", line 9, in main_ip\n'
        "orchestrator.contract.errors.RunFailure: network_interface 'ib9' does not exist on n2 (have: lo, eth0)\n"
    )
    why = explain_failure(tmp_path, "44", procs_per_node=2, scheduler_logs=[err])
    assert why is not None and why.node == 1 and why.rank is None
    assert "network_interface 'ib9' does not exist" in why.lines[0]
    assert why.logs_command == "orchestrator logs 44 --node 1"


# Node 0's log when a checkpoint save met a full disk (a real run's lines): torch.save's C++ error
# names no disk; "No space left on device" reached only submitit's log (issue #35, item 6).
SAVE_ON_FULL_DISK_LOG = """\
[orchestrator node] host=vm node_rank=0/1 job=local-1 attempt=0
[default0]:[rank0]: Traceback (most recent call last):
[default0]:[rank0]:   File "torch/serialization.py", line 1312, in _save
[default0]:[rank0]: RuntimeError: basic_ios::clear: iostream error
[orchestrator launch] rank 0 (local 0) exited with code 1
[orchestrator node] host=vm node_rank=0 exit=1 after 5.2 s
"""
SUBMITIT_ON_FULL_DISK = "submitit ERROR - Could not dump error:\n[Errno 28] No space left on device\n"


def test_a_full_disk_named_by_any_log_is_the_cause(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path, {0: SAVE_ON_FULL_DISK_LOG}, {0: 1})
    sub = tmp_path / "submitit" / "16384_0_log.out"
    sub.parent.mkdir()
    sub.write_text(SUBMITIT_ON_FULL_DISK)
    why = explain_failure(tmp_path, "local-1", scheduler_logs=[sub])
    assert why is not None and (why.node, why.rank) == (0, 0), why
    summary = why.summary()
    assert summary.startswith(
        "node 0 rank 0 failed: No space left on device (in submitit/16384_0_log.out; "
    ), summary
    rest = "RuntimeError: basic_ios::clear: iostream error; see `orchestrator logs local-1 --node 0 --rank 0`"
    assert "free on /" in summary and summary.endswith(rest), summary
    assert "No space left on device" in why.text() and "basic_ios::clear" in why.text()

    # Only a rank's own log said it (a node log cut by the full disk): still the cause. A quota too.
    sub.unlink()
    rank_log = attempt / "node_0_ranks" / "rank_1.log"
    rank_log.parent.mkdir()
    rank_log.write_text("OSError: [Errno 122] Disk quota exceeded: 'checkpoints/.tmp-step_00000010-ab'\n")
    why = explain_failure(tmp_path, "local-1")
    assert why is not None and why.disk is not None and why.disk.phrase == "Disk quota exceeded"
    assert "Disk quota exceeded (in logs/attempt_0/node_0_ranks/rank_1.log; " in why.summary()


def test_an_earlier_jobs_full_disk_is_not_this_failures_cause(tmp_path: Path) -> None:
    """A resumed run's submitit folder keeps the earlier job's files: written before this attempt
    began, their "No space left on device" is not why this attempt failed."""
    attempt = _attempt(tmp_path, {0: NODE0_LOG.replace("Connection closed by peer", "boom")}, {0: 1})
    old = tmp_path / "submitit" / "100_0_log.out"
    old.parent.mkdir()
    old.write_text(SUBMITIT_ON_FULL_DISK)
    began = min(p.stat().st_mtime for p in attempt.iterdir())
    os.utime(old, (began - 60, began - 60))
    why = explain_failure(tmp_path, "local-2", scheduler_logs=[old])
    assert why is not None and why.disk is None and "No space" not in why.summary(), why.summary()
    os.utime(old, (began + 1, began + 1))  # written during this attempt: it is the cause
    why = explain_failure(tmp_path, "local-2", scheduler_logs=[old])
    assert why is not None and why.disk is not None, why


def test_restore_mismatch_exit_status_is_quoted(tmp_path: Path) -> None:
    _attempt(tmp_path, {0: "[orchestrator node] exit=4\n"}, {0: 4})
    (tmp_path / "exit_status.json").write_text(
        json.dumps({"code": 4, "reason": "restore mismatch", "problems": ["model checksum differs"]})
    )
    why = explain_failure(tmp_path, "7")
    assert why is not None and why.node == 0
    assert why.lines == ("exit 4: restore mismatch", "model checksum differs")


# Node 0's log when rank 1 was SIGKILLed: rank 0 dies of the consequence, the launcher saw rank 1 die.
KILLED_LOG = """\
[orchestrator node] host=vm node_rank=0/1 job=local-1 attempt=0
[orchestrator launch] started 2 rank(s) by fork: pids 25754 25755 (ranks 0..1 of 2)
[orchestrator launch] rank 1 (local 1) exited with code 137: sending SIGTERM to 1 other rank(s)
[default0]:[rank 0] received SIGTERM
[default0]:[rank0]: Traceback (most recent call last):
[default0]:[rank0]:   File "train.py", line 476, in main
[default0]:[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:15267
[orchestrator node] host=vm node_rank=0 exit=137 after 5.3 s
"""


def test_a_rank_killed_by_a_signal_is_the_cause(tmp_path: Path) -> None:
    _attempt(tmp_path, {0: KILLED_LOG}, {0: 137})
    why = explain_failure(tmp_path, "local-1", procs_per_node=2)
    assert why is not None and (why.node, why.rank) == (0, 1), why
    assert "SIGKILL" in why.lines[0] and why.logs_command.endswith("--node 0 --rank 1")


def test_the_rank_that_ended_first_is_the_cause_without_error_lines(tmp_path: Path) -> None:
    log = KILLED_LOG.replace("code 137", "code 1")
    _attempt(tmp_path, {0: log}, {0: 1})
    why = explain_failure(tmp_path, "local-1", procs_per_node=2)
    assert why is not None and why.rank == 1 and "exited first, with code 1" in why.lines[0]


def test_a_rank_that_exited_outranks_a_peer_our_sigterm_ended_seen_before_it(tmp_path: Path) -> None:
    """A busy launcher reaped rank 0 (our SIGTERM, relayed by the job's stop) before rank 1, which
    exited with code 3 and no error line (``sys.exit(3)``): the order seen is no cause (issue 41
    item 8); rank 1 is, with its own code."""
    log = (
        "[orchestrator launch] rank 0 (local 0) exited with code 143: sending SIGTERM to 1 other rank(s)\n"
        "[orchestrator launch] rank 1 (local 1) exited with code 3: the cause, not rank 0 (code 143), "
        "whose death was seen first\n"
    )
    _attempt(tmp_path, {0: log}, {0: 3})
    why = explain_failure(tmp_path, "local-1", procs_per_node=2)
    assert why is not None and (why.node, why.rank) == (0, 1) and "code 3" in why.lines[0], why


def _torchrun_record(first: tuple[int, int], then: tuple[int, int]) -> str:
    """torchrun's summary: ``then`` under "Failures:", ``first`` as its "Root Cause" (``(rank, exitcode)``)."""

    def entry(rank: int, code: int) -> str:
        return f"[0]:\n  host      : vm\n  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: 9{rank})\n"

    return (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        f"Failures:\n{entry(*then)}------\nRoot Cause (first observed failure):\n{entry(*first)}======\n"
    )


_PEER_GLOO = "[default0]:[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1\n"


@pytest.mark.parametrize(
    "first, then, peer_error",
    [
        ((1, -6), (0, -15), ""),  # a quiet machine: the abort seen first, the peer stopped by torchrun
        ((0, -15), (1, -6), ""),  # loaded: torchrun's SIGTERM of the peer seen first
        ((0, 1), (1, -6), _PEER_GLOO),  # loaded: the peer's own death of the abort (gloo) seen first
        ((1, -6), (0, 1), _PEER_GLOO),
    ],
)
def test_torchrun_s_abort_is_the_cause_whichever_death_it_saw_first(
    tmp_path: Path, first: tuple[int, int], then: tuple[int, int], peer_error: str
) -> None:
    """Which death torchrun observed first depends on timing (issue 41 item 8: under load it named
    rank 0's gloo error "rank 0 exited first"); the rank killed by a signal the job did not send is
    the cause in every order, with its own code."""
    log = "[orchestrator node] host=vm node_rank=0/1 job=local-1 attempt=0\n" + peer_error
    log += _torchrun_record(first, then) + "[orchestrator node] host=vm node_rank=0 exit=1 after 5.0 s\n"
    _attempt(tmp_path, {0: log}, {0: 1})
    why = explain_failure(tmp_path, "local-1", procs_per_node=2)
    assert why is not None and (why.node, why.rank) == (0, 1), why
    assert why.lines[0].startswith("rank 1 died of SIGABRT (exit code 134)"), why.lines


def test_a_hang_is_explained_by_the_watchdog_not_by_its_sigkill(tmp_path: Path) -> None:
    """The watchdog's SIGKILL is no cause: its hang.json is, said as status and the notification say it."""
    _attempt(tmp_path, {0: KILLED_LOG}, {0: 137})
    hang = tmp_path / "hang" / "attempt_0"
    hang.mkdir(parents=True)
    reason = "hang: no rank advanced for 8 s; no single rank differs"
    (hang / "hang.json").write_text(json.dumps({"reason": reason}))
    why = explain_failure(tmp_path, "local-1", procs_per_node=2)
    assert why is not None and why.summary() == reason, why
    assert reason in why.text() and "SIGKILL" not in why.text()


def test_nothing_to_explain(tmp_path: Path) -> None:
    assert explain_failure(tmp_path, "1") is None


@pytest.mark.slow
@pytest.mark.usefixtures("reap_local_jobs")
def test_local_crashed_rank_is_explained_and_ends_the_job_fast(orch_env: dict[str, str]) -> None:
    """Rank 3 (node 1) raises while every other rank returns: node 0's torchrun would sit in its
    300 s exit barrier (profile ``launcher: torchrun``); one failed node must end the job within
    seconds, as on Slurm."""
    started = time.monotonic()
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "2", "--strategy", "ddp", "--wait", "--poll", "0.5",
         "--", CRASH, "--crash-rank", "3", "--others-succeed"],
        orch_env,
        timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    command = f"orchestrator logs {job_id} --node 1 --rank 3"
    assert "ValueError: boom from the test script (rank 3)" in res.stdout and command in res.stdout
    crashed_at = (run_dir / "logs" / "attempt_0" / "node_1.exit").stat().st_mtime
    ended_at = (run_dir / "local_state.json").stat().st_mtime
    assert ended_at - crashed_at < 30, f"job ended {ended_at - crashed_at:.1f} s after the crash"
    assert elapsed < 90
    # Node 0's ranks returned: torchrun would hold them in its exit barrier until node 1's failure
    # stopped the node; the direct launcher lets node 0 end at once. Either way it ended.
    node0 = (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    assert "stopped because node 1 failed" in node0 or "node_rank=0 exit=0" in node0, node0

    status = run_cli(["status", job_id], orch_env, timeout=60)
    assert "ValueError: boom from the test script (rank 3)" in status.stdout and command in status.stdout
    reason = json.loads(run_cli(["status", "--json", job_id], orch_env, timeout=60).stdout)["jobs"][0][
        "reason"
    ]
    assert reason.startswith("node 1 rank 3 failed: ValueError") and command in reason
    listed = json.loads(run_cli(["list", "--json"], orch_env, timeout=60).stdout)
    assert any(command in (j.get("end_reason") or "") for j in listed if j["job_id"] == job_id)
    # Followed after the fact, the job answers with its outcome and the same explanation.
    waited = run_cli(["wait", job_id, "--poll", "0.2"], orch_env, timeout=60)
    assert waited.returncode == 1 and command in waited.stdout, waited.stdout + waited.stderr
    followed = run_cli(["logs", job_id, "-f"], orch_env, timeout=60)
    assert followed.returncode == 1, followed.stderr
    # The command it names shows that rank's traceback.
    logs = run_cli(command.split()[1:], orch_env, timeout=60)
    assert logs.returncode == 0 and "ValueError: boom from the test script (rank 3)" in logs.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("reap_local_jobs")
def test_local_sigkilled_rank_is_blamed_not_its_peer(orch_env: dict[str, str]) -> None:
    """A real SIGKILL of rank 1: rank 0 then dies of gloo's "connection closed", which must not be
    named as the cause (issue #35, item 4). Without restarts (a restart in place would cure it:
    tests/schedulers/local/test_restart_in_place.py)."""
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "2", "--strategy", "ddp",
         "--max-restarts", "0", "--", TRAIN, "--preset", "tiny", "--data", "synthetic", "--max-steps", "100000"],
        orch_env,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    pids_file = run_dir / "logs" / "attempt_0" / "node_0_ranks" / "rank_pids.json"

    def training() -> int | None:
        try:
            ranks = json.loads(pids_file.read_text())["ranks"]
        except (OSError, ValueError, KeyError):
            return None
        metrics = run_dir / "metrics.jsonl"
        return int(ranks["1"]) if "1" in ranks and metrics.exists() and metrics.stat().st_size else None

    os.kill(poll(training, 90, "rank 1 training"), signal.SIGKILL)
    waited = run_cli(["wait", job_id, "--poll", "0.3", "--timeout", "90"], orch_env, timeout=120)
    assert waited.returncode == 1, waited.stdout + waited.stderr
    assert f"orchestrator logs {job_id} --node 0 --rank 1" in waited.stdout, waited.stdout
    assert "SIGKILL" in waited.stdout and "rank 0 failed" not in waited.stdout, waited.stdout
    reason = json.loads(run_cli(["status", "--json", job_id], orch_env, timeout=60).stdout)["jobs"][0][
        "reason"
    ]
    assert reason.startswith("node 0 rank 1 failed: rank 1 died of SIGKILL"), reason


@pytest.mark.slow
@pytest.mark.usefixtures("reap_local_jobs")
def test_an_aborted_rank_under_torchrun_is_blamed_not_the_peer_torchrun_stopped(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """A real SIGABRT of rank 1 under torchrun (``launcher: torchrun``):
    torchrun SIGTERMs rank 0 and lists it first, under "Failures:", and rank 1 under "Root Cause".
    The job must name rank 1's abort, never rank 0's SIGTERM."""
    profiles = user_profile_dir(tmp_path, "local", launcher="torchrun")
    res = run_cli(
        ["submit", "--profile", "local", "--profiles-dir", str(profiles), "--nodes", "1", "--procs-per-node", "2",
         "--strategy", "ddp", "--max-restarts", "0", "--wait", "--poll", "0.3",
         "--", CRASH, "--crash-rank", "1", "--abort"],
        orch_env,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    log = (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    assert log.index("Failures:") < log.index("Root Cause"), log  # the order this test is about
    assert "rank 1 died of SIGABRT (exit code 134): aborted by native code" in res.stdout, res.stdout
    assert f"orchestrator logs {job_id} --node 0 --rank 1" in res.stdout and "rank 0 died" not in res.stdout


def test_logs_points_at_an_error_only_the_scheduler_saw(orch_env: dict[str, str], tmp_path: Path) -> None:
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import Registry

    run_dir = tmp_path / "runs" / "r"
    _attempt(run_dir, {0: "[orchestrator node] received SIGTERM while no training runs\n"}, {})
    (run_dir / "local_state.json").write_text(json.dumps({"state": "FAILED", "exit_code": 1}))
    err = run_dir / "submitit" / "controller.log"
    err.parent.mkdir()
    err.write_text(
        'Traceback (most recent call last):\n  File "x", line 1\nOSError: [Errno 28] No space left on device\n'
    )
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        reg.add_job(
            job_id="local-5", name="t", profile="local", scheduler="local", strategy="ddp", nodes=1,
            procs_per_node=2, command=["python"], run_dir=run_dir, state=JobState.FAILED,
        )  # fmt: skip
    res = run_cli(["logs", "local-5"], orch_env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "received SIGTERM while no training runs" in res.stdout
    assert f"in {err}: OSError: [Errno 28] No space left on device" in res.stderr
    status = run_cli(["status", "local-5"], orch_env, timeout=60)
    assert "No space left on device" in status.stdout
