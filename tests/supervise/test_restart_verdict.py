"""Which failures a restart inside the allocation cures (issue 42): a rank killed by a signal, a
collective error, a consequence with no error of its own; never a Python exception the script
raised (it would raise again) or a full disk. The logs are the launcher's and ranks' own lines, as
recorded from real runs (tests/supervise/test_failure_report.py holds the end-to-end ones); the
cluster test (tests/cluster/test_restart_in_allocation.py) restarts a real job."""

from __future__ import annotations

from pathlib import Path

from orchestrator.supervise.failure_report import restart_verdict

HEADER = "[orchestrator node] host=vm node_rank=0/1 job=7 attempt=0\n"
KILLED = (
    HEADER
    + "[orchestrator launch] rank 1 (local 1) exited with code 137: sending SIGTERM to 1 other rank(s)\n"
    "[default0]:[rank0]: Traceback (most recent call last):\n"
    "[default0]:[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1\n"
)
RAISED = (
    HEADER + "[default1]:[rank1]: Traceback (most recent call last):\n"
    '[default1]:[rank1]:     raise ValueError("boom")\n'
    "[default1]:[rank1]: ValueError: boom\n"
    "[default0]:[rank0]: RuntimeError: Connection closed by peer\n"
)
COLLECTIVE = (
    HEADER + "[default1]:[rank1]: Traceback (most recent call last):\n"
    "[default1]:[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
    "unhandled system error\n"
)
CONSEQUENCE_ONLY = HEADER + "[default0]:[rank0]: RuntimeError: Connection reset by peer\n"


def attempt(run_dir: Path, log: str, code: int) -> None:
    path = run_dir / "logs" / "attempt_0"
    path.mkdir(parents=True)
    (path / "node_0.log").write_text(log)
    (path / "node_0.exit").write_text(str(code))


def test_a_rank_killed_by_a_signal_is_restarted(tmp_path: Path) -> None:
    attempt(tmp_path, KILLED, 137)
    verdict = restart_verdict(tmp_path, "7", procs_per_node=2)
    assert verdict.cause is not None and "rank 1 died of SIGKILL" in verdict.cause, verdict


def test_a_python_exception_is_not_restarted(tmp_path: Path) -> None:
    attempt(tmp_path, RAISED, 1)
    verdict = restart_verdict(tmp_path, "7", procs_per_node=2)
    assert verdict.cause is None
    assert (
        verdict.refusal is not None and "ValueError: boom" in verdict.refusal and "rank 1" in verdict.refusal
    )


def test_a_collective_error_is_restarted(tmp_path: Path) -> None:
    attempt(tmp_path, COLLECTIVE, 1)
    verdict = restart_verdict(tmp_path, "7", procs_per_node=2)
    assert verdict.cause is not None and verdict.cause.startswith("a collective error on node 0 rank 1"), (
        verdict
    )


def test_a_consequence_without_a_cause_is_restarted(tmp_path: Path) -> None:
    """A node task lost (killed from outside): its peers' logs hold only consequences."""
    attempt(tmp_path, CONSEQUENCE_ONLY, 1)
    verdict = restart_verdict(tmp_path, "7", procs_per_node=2)
    assert verdict.cause is not None and "without an error of its own" in verdict.cause, verdict


def test_a_full_disk_and_nothing_logged_are_not_restarted(tmp_path: Path) -> None:
    assert restart_verdict(tmp_path / "empty", "7").cause is None
    attempt(tmp_path, KILLED + "OSError: [Errno 28] No space left on device\n", 137)
    verdict = restart_verdict(tmp_path, "7", procs_per_node=2)
    assert verdict.cause is None and verdict.refusal == "the disk is full"


def test_a_rank_that_exits_by_itself_is_not_restarted(tmp_path: Path) -> None:
    """``raise SystemExit("boom")``: exit code 1, a message but no traceback, no peer's failure."""
    log = (
        HEADER
        + "[orchestrator launch] rank 0 (local 0) exited with code 1\n[default0]:boom: failed by itself\n"
    )
    attempt(tmp_path, log, 1)
    verdict = restart_verdict(tmp_path, "7", procs_per_node=1)
    assert (
        verdict.cause is None
        and verdict.refusal is not None
        and "rank 0 exited first, with code 1" in verdict.refusal
    )


RAISED_ON_NODE_0 = (
    "[orchestrator node] host=vm node_rank=0/2 job=7 attempt=0\n"
    "[default1]:[rank1]: Traceback (most recent call last):\n"
    "[default1]:[rank1]: ValueError: direct boom (rank 1)\n"
    "[orchestrator launch] rank 1 (local 1) exited with code 1: sending SIGTERM to 1 other rank(s)\n"
)
STOPPED_NODE_1 = (
    "[orchestrator node] host=vm node_rank=1/2 job=7 attempt=0\n"
    "[orchestrator node] stopped because node 0 failed (exit 1): one failed node ends the job\n"
    "[orchestrator launch] rank 3 (local 1) exited with code 137\n"
    "[default1]:[rank3]: RuntimeError: Connection closed by peer\n"
)


def test_a_node_the_job_stopped_is_never_the_cause(tmp_path: Path) -> None:
    """Issue 41 item 8: node 1 was stopped by the job because node 0 failed; its rank died of our own
    SIGKILL and its launcher logged that death. Whatever the order the deaths were seen in, the
    cause is rank 1's ValueError, and it is not restarted."""
    from orchestrator.supervise.failure_report import explain_failure

    path = tmp_path / "logs" / "attempt_0"
    path.mkdir(parents=True)
    (path / "node_0.log").write_text(RAISED_ON_NODE_0)
    (path / "node_1.log").write_text(STOPPED_NODE_1)
    (path / "node_0.exit").write_text("1")
    (path / "node_1.exit").write_text("143")
    why = explain_failure(tmp_path, "7", procs_per_node=2)
    assert why is not None and (why.node, why.rank) == (0, 1) and "ValueError: direct boom" in why.lines[0], (
        why
    )
    assert restart_verdict(tmp_path, "7", procs_per_node=2).cause is None


TORCHRUN_ROOT_IS_THE_PEER = (
    "[orchestrator node] host=vm node_rank=0/1 job=7 attempt=0\n"
    "[default0]:[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    "Failures:\n"
    "[1]:\n"
    "  rank      : 1 (local_rank: 1)\n"
    "  exitcode  : -6 (pid: 124)\n"
    "Root Cause (first observed failure):\n"
    "[0]:\n"
    "  rank      : 0 (local_rank: 0)\n"
    "  exitcode  : 1 (pid: 123)\n"
)


def test_a_signal_death_outranks_torchruns_first_observed_peer(tmp_path: Path) -> None:
    """Issue 47: under load torchrun observed rank 0 (dead of the connection rank 1's abort closed)
    before rank 1's SIGABRT, and named rank 0 its root cause. The abort is the cause, whatever the
    order; it is what a restart cures."""
    from orchestrator.supervise.failure_report import explain_failure

    attempt(tmp_path, TORCHRUN_ROOT_IS_THE_PEER, 1)
    why = explain_failure(tmp_path, "7", procs_per_node=2)
    assert why is not None and why.rank == 1 and "rank 1 died of SIGABRT" in why.lines[0], why
    verdict = restart_verdict(tmp_path, "7", procs_per_node=2)
    assert verdict.cause is not None and "SIGABRT" in verdict.cause, verdict
