"""Which processes of a run are alive: a lock every training process holds, and death with the parent.

One rule for "a job has ended", whatever the scheduler: its processes are gone. A scheduler's word
(a final record in the run directory, the scheduler's accounting) says how it ended; it has ended
only once no process of the run still holds :data:`ALIVE_FILE`. Every process of a run takes its own shared ``flock`` on
it (the node entry, the launcher, each rank), so the kernel keeps the truth: a process killed by
``kill -9`` drops its lock as it dies, a stray one keeps it, and ``/proc/locks`` names each holder's
pid. Measured before this: ``kill -9`` of a local job's controller made ``status`` say FAILED while
the node entry, the launcher and both ranks trained on under PPID 1, and ``resume`` started a second
training in the same run directory.

Orphans do not outlive their parent: each process of the chain (node entry, launcher, rank) asks the
kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), so killing any link kills everything
below it. Standard library only: the node and the ranks import it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

#: In the run directory: held (shared) by every live process of the run.
ALIVE_FILE = ".alive.lock"
#: Linux ``prctl`` option: the signal this process gets when its parent dies.
PR_SET_PDEATHSIG = 1

_held: dict[str, int] = {}


def hold(run_dir: Path | str) -> int | None:
    """Take this process's own shared lock on the run's :data:`ALIVE_FILE` (kept until it exits; a
    second call in the same process is a no-op). None where the run directory cannot hold it."""
    import fcntl

    key = str(Path(run_dir).absolute())
    if key in _held:
        return _held[key]
    try:
        fd = os.open(Path(run_dir) / ALIVE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    _held[key] = fd
    return fd


def release(run_dir: Path | str) -> None:
    """Drop this process's lock: its part of the run is over (a local job's node 0 that stays only
    to send the run's last notifications must not make the run read as running)."""
    fd = _held.pop(str(Path(run_dir).absolute()), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def forget_inherited() -> None:
    """In a forked child: drop the parent's lock descriptors (the child takes its own with
    :func:`hold`, so that ``/proc/locks`` names it)."""
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


def holders(run_dir: Path | str) -> list[int] | None:
    """None when no process holds the run's lock (every process of the run is gone); otherwise the
    live pids on this host that hold it (empty when the holders are elsewhere, or are processes
    that inherited a lock whose taker died)."""
    import fcntl

    path = Path(run_dir) / ALIVE_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        except OSError:
            return None
        else:
            return None  # nobody else holds it (closing our descriptor drops ours)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return _lock_pids(st.st_dev, st.st_ino) or _openers(st.st_dev, st.st_ino)


def _lock_pids(dev: int, ino: int) -> list[int]:
    """Pids of ``/proc/locks`` entries on that file that still run."""
    wanted = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    pids: set[int] = set()
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        if fields[5] != wanted:
            continue
        with contextlib.suppress(ValueError):
            pid = int(fields[4])
            if _running(pid):
                pids.add(pid)
    return sorted(pids)


def _openers(dev: int, ino: int) -> list[int]:
    """Pids (of this user's processes) with the file open: a process that inherited a lock whose
    taker died (a rank's forked child) is in ``/proc/locks`` under the dead taker's pid only."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    st = os.stat(fd.path)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) == (dev, ino) and _running(int(entry.name)):
                    found.append(int(entry.name))
                    break
    return sorted(found)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; if ``parent`` (the pid
    the caller knows as its parent) is gone already, the same signal now. False where the
    kernel offers no such thing (not Linux): the run's lock still tells the truth there."""
    libc = _libc()
    try:
        if libc is None or libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except AttributeError:
        return False
    if os.getppid() != parent:  # died before the request: it will never fire
        os.kill(os.getpid(), sig)
    return True


_LIBC: list[object] = []


def _libc() -> Any:
    """The C library, loaded once (a forked rank then calls into it without loading anything)."""
    if not _LIBC:
        import ctypes

        try:
            _LIBC.append(ctypes.CDLL("libc.so.6", use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]
