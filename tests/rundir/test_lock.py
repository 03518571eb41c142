"""Run-level changes are exclusive: the run lock holds across the check and the submission, so two
`resume` of one job started together submit exactly once; the other exits 2 naming the job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.rundir.lock import RunLocked, run_lock
from tests.helpers.cli import REPO, kill_tree


def test_run_lock_is_exclusive_across_processes_and_names_its_holder(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from orchestrator.rundir.lock import run_lock\n"
         f"with run_lock({str(tmp_path)!r}, what='holder-test'):\n"
         "    print('held', flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked) as refused, run_lock(tmp_path, timeout_s=0.3):
            pass
        assert f"pid {holder.pid}" in str(refused.value) and "holder-test" in str(refused.value)
        assert holder.stdin is not None
        holder.stdin.close()  # the holder lets go (as a killed one would: the kernel drops the lock)
        holder.wait(timeout=30)
        with run_lock(tmp_path, timeout_s=5), run_lock(tmp_path, timeout_s=0):  # and it is re-entrant
            pass
    finally:
        kill_tree(holder.pid)
