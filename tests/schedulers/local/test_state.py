"""A local job's state, read from its run directory: pids, exit files, the final record, cancel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.contract.job_states import JobState
from orchestrator.contract.run_dir import write_cancel_marker
from orchestrator.schedulers.local.state import local_state


def _spawn_group_leader() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_local_state_lifecycle(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    rd.mkdir()
    assert local_state(rd).state is JobState.PENDING
    proc = _spawn_group_leader()
    try:
        (rd / "local_pids.json").write_text(json.dumps({"0": proc.pid}))
        ls = local_state(rd)
        assert ls.state is JobState.RUNNING and ls.alive_pids == (proc.pid,)
    finally:
        proc.kill()
        proc.wait(30)
    # dead and nothing recorded: FAILED; with node exit files: from their codes
    assert local_state(rd).state is JobState.FAILED
    (rd / "job.json").write_text(json.dumps({"nodes": 2}))
    att = rd / "logs" / "attempt_0"
    att.mkdir(parents=True)
    (att / "node_0.exit").write_text("0")
    assert local_state(rd).state is JobState.FAILED  # node 1 has not reported
    (att / "node_1.exit").write_text("0\n")
    assert local_state(rd).state is JobState.COMPLETED
    (att / "node_1.exit").write_text("137")
    ls = local_state(rd)
    assert ls.state is JobState.FAILED and ls.exit_code == 137 and "node 1" in (ls.reason or "")
    write_cancel_marker(rd, "SIGTERM", "tester")
    assert local_state(rd).state is JobState.CANCELLED
    (rd / "local_state.json").write_text(
        json.dumps({"state": "OUT_OF_MEMORY", "exit_code": 9, "reason": "oom"})
    )
    ls = local_state(rd)
    assert (ls.state, ls.exit_code, ls.reason) == (JobState.OUT_OF_MEMORY, 9, "oom")


def test_recycled_pid_does_not_look_alive(tmp_path: Path) -> None:
    """A pid file older than the process now holding that pid means the job's process is gone."""
    rd = tmp_path / "run"
    rd.mkdir()
    pids = rd / "local_pids.json"
    pids.write_text(json.dumps({"0": os.getpid()}))
    import psutil

    old = psutil.Process().create_time() - 3600
    os.utime(pids, (old, old))  # the file predates the process that now has this pid
    assert local_state(rd).state is JobState.FAILED
    os.utime(pids, None)
    assert local_state(rd).state is JobState.RUNNING
