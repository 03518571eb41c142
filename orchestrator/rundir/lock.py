"""The run lock: one command at a time changes a run (submit into it, resume, auto-resume, cancel).

Standard library only, like :mod:`orchestrator.contract.run_dir`, whose ``.run.lock`` file it holds.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from orchestrator.contract.errors import UserError
from orchestrator.contract.run_dir import RUN_LOCK_FILE


class RunLocked(Exception):
    """Another command holds the run's lock; ``holder`` says which (pid and command)."""

    def __init__(self, run_dir: Path, holder: str) -> None:
        super().__init__(f"run directory {run_dir} is locked by {holder or 'another command'}")
        self.holder = holder


_HELD: dict[str, int] = {}


@contextlib.contextmanager
def run_lock(run_dir: Path, timeout_s: float = 120.0, what: str = "") -> Iterator[None]:
    """Hold the run's lock (``flock`` on ``.run.lock``) across a check and the change it allows.

    Re-entrant within a process. Waits up to ``timeout_s`` for a holder to finish (a submission
    takes seconds), then raises :class:`RunLocked` naming it. The kernel drops the lock when the
    holder dies, so a killed command never leaves the run locked.
    """
    import fcntl

    key = str(Path(run_dir).absolute())
    if key in _HELD:
        yield
        return
    path = Path(run_dir) / RUN_LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:  # a full disk, a read-only or vanished run directory: one line, no traceback
        raise UserError(f"cannot lock run directory {run_dir}: {exc.strerror or exc}") from None
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    try:
                        holder = Path(path).read_text(encoding="utf-8").strip()
                    except OSError:
                        holder = ""
                    raise RunLocked(Path(run_dir), holder) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
        info = f"pid {os.getpid()} ({what or ' '.join(sys.argv[:3])})".encode()
        with contextlib.suppress(OSError):  # who holds it is a courtesy; the flock is the lock (ENOSPC)
            os.ftruncate(fd, 0)
            os.pwrite(fd, info, 0)
        _HELD[key] = fd
        try:
            yield
        finally:
            del _HELD[key]
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)
