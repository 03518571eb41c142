"""A full disk, told as the cause of a failure: the lines that say so in a job attempt's logs, and
the room left on the run directory's filesystem.

A full disk makes the failing rank raise whatever its writer says: ``torch.save`` raises C++'s
``basic_ios::clear: iostream error`` and names no disk, while ``No space left on device`` reaches
another log (submitit's, the launcher's, a peer's). And it cuts the logs themselves: a file grows only
into the blocks it already holds (tmpfs: 4 KiB pages), so every later write fails; the free space then
says what no log could. Standard library only (:mod:`orchestrator.supervise.failure_report` uses it).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.contract.checkpoints import FULL_BELOW_BYTES
from orchestrator.contract.run_dir import attempt_dirs, node_logs

#: Only the end of a huge log is read: tracebacks are written last.
MAX_READ_BYTES = 4 << 20
#: Rank logs repeat what their node log holds (``--tee``): only their ends are searched for a full
#: disk, and only so many of them.
RANK_LOG_READ_BYTES = 64 << 10
MAX_RANK_LOGS = 256
#: What a full disk or quota makes the C library say (``ENOSPC``, ``EDQUOT``).
_DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded")


def read_tail(path: Path, limit: int = MAX_READ_BYTES) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            data = fh.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()


@dataclass(frozen=True)
class DiskFull:
    """A full disk (or quota): what said so, where, and the room on the run directory's filesystem."""

    phrase: str
    """``No space left on device``, ``Disk quota exceeded``, or the filesystem found full."""
    seen_in: str = ""
    """The log that said so, relative to the run directory; "" when only the free space tells."""
    free: str = ""

    @property
    def note(self) -> str:
        """Where it was seen and the free space: ``in submitit/1_0_log.out; 0 B of 16.0 MiB free ...``."""
        return "; ".join(part for part in (f"in {self.seen_in}" if self.seen_in else "", self.free) if part)

    def __str__(self) -> str:
        return f"{self.phrase} ({self.note})" if self.note else self.phrase

    def before(self, error: str) -> str:
        """This as the cause of ``error`` (the failing rank's own line), said once."""
        if not error:
            return str(self)
        if self.phrase in error:
            return f"{error} ({self.note})" if self.note else error
        return f"{self}: {error}"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    dev = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == dev:
        path = path.parent
    return path


def free_space(run_dir: Path) -> tuple[int, int, str] | None:
    """``(available bytes, total bytes, words)`` of the filesystem holding ``run_dir``, as an
    unprivileged writer sees it; None where it cannot be read."""
    try:
        st = os.statvfs(run_dir)
        mount = _mount_point(run_dir)
    except OSError:
        return None
    avail, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return avail, total, f"{_size(avail)} of {_size(total)} free on {mount} after the failure"


def _attempt_logs(attempt_path: Path) -> list[tuple[Path, int]]:
    """The attempt's node logs (read to :data:`MAX_READ_BYTES`), then its rank logs (their ends)."""
    found = [(path, MAX_READ_BYTES) for _, path in node_logs(attempt_path)]
    ranks: list[Path] = []
    with contextlib.suppress(OSError):
        for folder in sorted(attempt_path.glob("node_*_ranks")):
            ranks += sorted(folder.rglob("*.log"))
    return found + [(path, RANK_LOG_READ_BYTES) for path in ranks[:MAX_RANK_LOGS]]


def _attempt_began(attempt_path: Path) -> float | None:
    """About when the attempt began: its oldest file (configs and pids are written once, at start)."""
    times = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(attempt_path):
            with contextlib.suppress(OSError):
                if entry.is_file():
                    times.append(entry.stat().st_mtime)
    return min(times) if times else None


def disk_full(run_dir: Path | str, scheduler_logs: Sequence[Path] = ()) -> DiskFull | None:
    """Whether the newest attempt of ``run_dir`` failed on a full disk: a line of any of its logs (node
    logs, rank logs, the scheduler's files written since it began) says ``No space left on device`` or
    ``Disk quota exceeded``; or no log could (a full disk cuts them all: a file grows only into the
    blocks it already has) but the run directory's filesystem has under :data:`FULL_BELOW_BYTES` left."""
    run_dir = Path(run_dir)
    attempts = attempt_dirs(run_dir)
    logs: list[tuple[Path, int]] = []
    began = None
    if attempts:
        logs = _attempt_logs(attempts[-1][1])
        began = _attempt_began(attempts[-1][1])
    for path in scheduler_logs:
        with contextlib.suppress(OSError):
            if began is None or path.stat().st_mtime >= began - 1:  # an earlier job's file says nothing
                logs.append((path, MAX_READ_BYTES))
    room = free_space(run_dir)
    free = room[2] if room else ""
    for path, limit in logs:
        for line in read_tail(path, limit):
            m = _DISK_FULL.search(line)
            if m and not line.startswith("[orchestrator node] exec:"):
                try:
                    where = str(path.relative_to(run_dir))
                except ValueError:
                    where = str(path)
                return DiskFull(m.group(0), where, free)
    if attempts and room is not None and room[0] < FULL_BELOW_BYTES:
        return DiskFull("the run directory's filesystem is full; its logs may be cut", "", free)
    return None
