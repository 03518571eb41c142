"""Follow a run's node logs by byte offset: tail, cat and ``-f`` without re-reading files.

Logs live at ``<run_dir>/logs/attempt_<A>/node_<N>.log``. A multi-day job's logs reach gigabytes,
and ``logs -f`` polls every fraction of a second, so every read starts where the previous one
stopped (per file: inode + offset), ``--tail K`` seeks from the end, and a line is only emitted
once its newline has been written (a half-written line is held back until it is complete).

Requeues add ``attempt_<A+1>/`` while we follow, and a node's log may appear only when that node
starts; both are picked up on the next poll because the directory listing is repeated each poll
(a handful of ``scandir`` calls, far cheaper than reading files).

Nothing is read through a symlink that leads out of the run directory (``logs`` itself, an
``attempt_<A>`` folder or a ``node_<N>.log``, dangling or not): such a path is skipped on every poll
and named in :attr:`LogFollower.refused`, which ``logs`` and the dashboard print as a note. A link
that stays inside the run is followed.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from orchestrator.contract.run_dir import LOGS_DIR, NODE_LOG_RE, attempt_dirs, node_logs

#: Rank prefixes put on lines by launchers: torchrun ``--tee`` writes ``[default<local_rank>]:``,
#: our launcher / ``[rank<R>]:`` style writes the global rank.
_RANK_PREFIX = re.compile(r"^\[(rank|default)(\d+)\]")
READ_CHUNK = 1 << 20


def leaves(path: Path | str, root: Path | str) -> bool:
    """Whether ``path`` resolves (every symlink on the way, a dangling last one included) to a place
    outside the directory ``root`` (itself resolved)."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real != top and not real.startswith(top.rstrip(os.sep) + os.sep)


def refusal(path: Path | str) -> str:
    """The note printed for a path that :func:`leaves` the run directory."""
    return f"skipped {path}: a symlink that leads out of the run directory (not read)"


@dataclass(frozen=True)
class LogLine:
    """One complete line (without its newline) and where it came from."""

    attempt: int
    node: int
    text: str
    #: byte offset just after this line's newline in its file (-1: a last line without one); a
    #: reader that loses the stream resumes there (:meth:`LogFollower.start_at`)
    end: int = -1


@dataclass
class _FileCursor:
    inode: int
    offset: int
    partial: bytes = b""


class LogFollower:
    """Yields new complete lines from the node logs of one run, selected by attempt/node/rank.

    ``attempt=None`` means "the newest attempt that exists now, and every later one" -- what a
    user following a job that may be requeued wants. ``rank=R`` selects node ``R // procs_per_node``
    and drops lines whose rank prefix names another rank (unprefixed lines are kept: they are the
    node's launcher output, which belongs to every rank on it).
    """

    def __init__(
        self,
        run_dir: Path | str,
        *,
        attempt: int | None = None,
        node: int | None = None,
        rank: int | None = None,
        procs_per_node: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.attempt = attempt
        self.rank = rank
        self.procs_per_node = procs_per_node
        self.local_rank: int | None = None
        if rank is not None:
            ppn = procs_per_node or 1
            rank_node = rank // ppn
            if node is not None and node != rank_node:
                raise ValueError(f"rank {rank} runs on node {rank_node}, not node {node}")
            node = rank_node
            self.local_rank = rank % ppn
        self.node = node
        existing = attempt_dirs(self.run_dir)
        self.min_attempt = attempt if attempt is not None else (existing[-1][0] if existing else 0)
        self._cursors: dict[Path, _FileCursor] = {}
        #: ``{(attempt, node): (inode, offset)}``: where the last :meth:`tail` began in each file
        self.window_starts: dict[tuple[int, int], tuple[int, int]] = {}
        #: paths not read because they lead out of the run directory (kept across polls, in order)
        self.refused: dict[Path, None] = {}

    def start_at(self, min_attempt: int, offsets: dict[tuple[int, int], tuple[int, int]]) -> None:
        """Continue a follow another process began: the same first attempt, and each file from the
        offset its reader had printed up to (``(inode, offset)``; inode -1: any). A file replaced
        since (another inode) or not listed starts from byte 0, as :meth:`stream` does."""
        self.min_attempt = min_attempt
        for a, n, path in self.sources():
            if (a, n) not in offsets:
                continue
            inode, offset = offsets[(a, n)]
            try:
                st = path.stat()
            except OSError:
                continue
            if inode in (-1, st.st_ino) and offset <= st.st_size:
                self._cursors[path] = _FileCursor(st.st_ino, offset)

    # ------------------------------------------------------------------ selection
    def sources(self) -> list[tuple[int, int, Path]]:
        """``[(attempt, node, path)]`` of log files currently matching the selection."""
        out: list[tuple[int, int, Path]] = []
        if self._outside(self.run_dir / LOGS_DIR):
            return out
        for a, adir in attempt_dirs(self.run_dir):
            if a < self.min_attempt or (self.attempt is not None and a != self.attempt):
                continue
            if self._outside(adir):
                continue
            for n, path in self._node_logs(adir):
                if self.node is None or n == self.node:
                    out.append((a, n, path))
        return out

    def _node_logs(self, adir: Path) -> list[tuple[int, Path]]:
        """The attempt's node logs that stay inside the run; a symlinked one that leaves it (dangling
        too: its target could appear later) is refused. Only symlinks are resolved (the listing
        says which), so a poll costs no more system calls than before for a run without them."""
        try:
            links = {e.name for e in os.scandir(adir) if NODE_LOG_RE.match(e.name) and e.is_symlink()}
        except OSError:
            links = set()
        refused = {name for name in links if self._outside(adir / name, link=True)}
        return [(n, path) for n, path in node_logs(adir) if path.name not in refused]

    def _outside(self, path: Path, link: bool | None = None) -> bool:
        """Whether ``path`` (whose parents inside the run were checked already) is a symlink that
        leads out of the run; such a path is added to :attr:`refused`."""
        if not (os.path.islink(path) if link is None else link) or not leaves(path, self.run_dir):
            return False
        self.refused[path] = None
        return True

    def _keep(self, text: str) -> bool:
        if self.rank is None:
            return True
        m = _RANK_PREFIX.match(text)
        if m is None:
            return True
        kind, value = m.group(1), int(m.group(2))
        return value == (self.rank if kind == "rank" else self.local_rank)

    # ------------------------------------------------------------------ reading
    def tail(self, k: int) -> list[LogLine]:
        """The last ``k`` complete lines of each selected file; later polls continue after them.

        The size is taken first and only bytes before it are read, so a line written meanwhile is
        neither lost nor printed twice: it comes with the next poll.
        """
        lines: list[LogLine] = []
        for a, n, path in self.sources():
            try:
                st = path.stat()
                with open(path, "rb") as fh:
                    data, start = _read_tail_upto(fh, k, st.st_size, keep=self._keep)
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1  # a torn last line is left for the next poll
            self._cursors[path] = _FileCursor(st.st_ino, start + cut)
            kept = [(t, e) for t, e in zip(_decode_lines(data[:cut]), _line_ends(data[:cut], start))
                    if self._keep(t)]  # fmt: skip
            shown = kept[-k:] if k > 0 else []
            before = len(kept) - len(shown) - 1  # the kept line just before the shown ones
            window = start + cut if not shown else kept[before][1] if before >= 0 else start
            self.window_starts[(a, n)] = (st.st_ino, window)
            lines.extend(LogLine(a, n, t, e) for t, e in shown)
        return lines

    def poll(self, final: bool = False) -> list[LogLine]:
        """New complete lines since the last call (from byte 0 for files never seen before).

        ``final=True`` also emits a trailing line that lacks its newline: the writer is gone.
        """
        return list(self.stream(final))

    def stream(self, final: bool = False) -> Iterator[LogLine]:
        """Generator form of :meth:`poll`: prints a multi-GB log without holding it in memory."""
        for a, n, path in self.sources():
            try:
                st = path.stat()
            except OSError:
                continue
            cur = self._cursors.get(path)
            if cur is None or cur.inode != st.st_ino or st.st_size < cur.offset:
                cur = _FileCursor(st.st_ino, 0)  # new, replaced or truncated file: start over
                self._cursors[path] = cur
            if st.st_size > cur.offset:
                try:
                    fh = open(path, "rb")  # noqa: SIM115 (closed below; a generator may pause here)
                except OSError:
                    continue
                try:
                    fh.seek(cur.offset)
                    remaining = st.st_size - cur.offset
                    while remaining > 0:
                        chunk = fh.read(min(READ_CHUNK, remaining))
                        if not chunk:
                            break
                        remaining -= len(chunk)
                        base = cur.offset - len(cur.partial)  # where ``data`` begins in the file
                        cur.offset += len(chunk)
                        data = cur.partial + chunk
                        cut = data.rfind(b"\n") + 1
                        cur.partial = data[cut:]
                        for t, e in zip(_decode_lines(data[:cut]), _line_ends(data[:cut], base)):
                            if self._keep(t):
                                yield LogLine(a, n, t, e)
                finally:
                    fh.close()
            if final and cur.partial:
                text = cur.partial.decode("utf-8", errors="replace")
                cur.partial = b""
                if self._keep(text):
                    yield LogLine(a, n, text)

    def follow(
        self,
        is_done: Callable[[], bool],
        *,
        interval: float = 0.25,
        max_interval: float = 2.0,
        done_check_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> Iterator[LogLine]:
        """Yield lines as they are written until ``is_done()`` says the job is terminal.

        Polling backs off from ``interval`` to ``max_interval`` while nothing is written and snaps
        back when output arrives. ``is_done`` (a scheduler query) is asked at most every
        ``done_check_s`` seconds, and only when there was nothing to read; after it returns True
        one last poll drains what the job wrote before it ended.
        """
        delay = interval
        last_check: float | None = None
        while True:
            new = self.poll()
            yield from new
            if new:
                delay = interval
                continue
            now = clock()
            if last_check is None or now - last_check >= done_check_s:
                last_check = now
                if is_done():
                    yield from self.poll(final=True)
                    return
            sleep(delay)
            delay = min(max_interval, delay * 1.5)


def _decode_lines(data: bytes) -> list[str]:
    if not data:
        return []
    text = data.decode("utf-8", errors="replace")
    if text.endswith("\n"):
        text = text[:-1]
    return [_as_shown(ln) for ln in text.split("\n")]


def _line_ends(data: bytes, base: int) -> list[int]:
    """File offsets just after each newline of ``data``, which begins at offset ``base``."""
    ends, at = [], data.find(b"\n")
    while at >= 0:
        ends.append(base + at + 1)
        at = data.find(b"\n", at + 1)
    return ends


def _as_shown(line: str) -> str:
    """A line as a terminal shows it: what follows its last carriage return. tqdm redraws its bar
    with ``\r`` and no newline, so one "line" held every redraw (thousands of characters); a rank
    prefix (``[rank1]:``) at its start is kept, since ``--rank`` selects by it."""
    line = line.rstrip("\r")
    if "\r" not in line:
        return line
    last = line.rpartition("\r")[2]
    m = _RANK_PREFIX.match(line)
    if m is None or _RANK_PREFIX.match(last):
        return last
    prefix = line[: line.find("]") + 1]
    prefix += ":" if line[len(prefix) : len(prefix) + 1] == ":" else ""
    return f"{prefix} {last.lstrip()}" if prefix.endswith(":") else prefix + last


def _read_tail_upto(
    fh: BinaryIO, k: int, end: int, keep: Callable[[str], bool], chunk: int = 64 * 1024
) -> tuple[bytes, int]:
    """Read backwards from ``end`` until ``k`` kept complete lines are in the buffer.

    Returns ``(bytes, start_offset)``; the buffer begins at a line start (or file start).
    """
    pos = end
    buf = b""
    while pos > 0:
        step = min(chunk, pos)
        pos -= step
        fh.seek(pos)
        buf = fh.read(step) + buf
        cut = buf.rfind(b"\n") + 1
        body = buf[:cut]
        # Lines fully inside the buffer: everything after the first newline (unless at file start).
        first_nl = body.find(b"\n") + 1 if pos > 0 else 0
        if k <= 0 or sum(1 for t in _decode_lines(body[first_nl:]) if keep(t)) >= k:
            break
    if pos > 0:
        first_nl = buf.find(b"\n") + 1
        return buf[first_nl:], pos + first_nl
    return buf, 0
