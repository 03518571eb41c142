"""Holding a training rank still while a test acts, so that training cannot run past the phase.

A test that signals a job "after step 5" raced the training: on a fast or idle machine the run could
reach its last step before the signal (or the requeue, or Slurm's time-limit signal) arrived, and the
phase the test meant to exercise never happened. Here the rank is stopped (SIGSTOP) at the event the
test waits for; the action is taken; and the rank runs on only once the signal the action sends is
pending in it (``/proc/<pid>/status``), or something else woke it (Slurm sends SIGCONT with a kill).
The other ranks wait for it in their next collective, so the whole job stands still meanwhile.

Every wait is bounded; the rank is always continued, even when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

from orchestrator.contract.heartbeat import read_heartbeats
from orchestrator.contract.run_dir import attempt_dirs
from tests.helpers.cli import poll


def pending_signals(pid: int) -> set[int]:
    """Signals pending in process ``pid`` (the process's and its main thread's), empty if it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return set()
    mask = 0
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("ShdPnd", "SigPnd"):
            mask |= int(value.strip(), 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def _state(pid: int) -> str:
    """One-letter process state (``T`` stopped), ``""`` once it is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return "" if state in ("Z", "X") else state


def rank_pid(run_dir: Path, rank: int, min_step: int = 0, timeout: float = 240.0) -> int:
    """PID of ``rank`` in the newest attempt, once its heartbeat says it reached ``min_step``."""

    def found() -> int | None:
        attempts = attempt_dirs(run_dir)
        if not attempts:
            return None
        record = read_heartbeats(attempts[-1][1]).get(rank) or {}
        if int(record.get("step", -1)) >= min_step and _state(int(record.get("pid", 0))):
            return int(record["pid"])
        return None

    return poll(found, timeout, f"rank {rank} at step {min_step} or later (heartbeat)")


@contextlib.contextmanager
def held(pid: int, until: Iterable[signal.Signals], timeout: float = 120.0) -> Iterator[None]:
    """Stop ``pid``; run the body (the action); then wait, bounded, until one of ``until`` is pending in
    it, it was continued by someone else, or it is gone; continue it in any case."""
    wanted = {int(s) for s in until}
    os.kill(pid, signal.SIGSTOP)
    try:
        poll(lambda: _state(pid) in ("T", ""), 10, f"pid {pid} stopped")
        yield
        poll(
            lambda: bool(wanted & pending_signals(pid)) or _state(pid) != "T",
            timeout,
            f"{'/'.join(signal.Signals(s).name for s in sorted(wanted))} pending in the held rank {pid}",
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
