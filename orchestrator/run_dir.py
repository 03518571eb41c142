"""Read what a run directory says about a training run, cheaply and without torch.

The training program and the launcher write the run directory; this module only reads it. The
layout contract (shared with ``train/`` and the launcher)::

    <run_dir>/job.json                      resolved submission: profile, strategy, nodes,
                                            procs_per_node, command, max_steps (if known)
    <run_dir>/metrics.jsonl                 JSON lines from rank 0 (train / eval / resume events);
                                            the last line may be torn mid-write
    <run_dir>/checkpoints/step_00000040/    one folder per checkpoint, complete only when it holds
        COMPLETE.json                       {"step", "world_size", "strategy", "files": {rel: size}}
    <run_dir>/checkpoints/.tmp*             checkpoints being written (ignored)
    <run_dir>/logs/attempt_<A>/node_<N>.log one log per node per attempt (A from 0)
    <run_dir>/logs/attempt_<A>/node_<N>.exit that node's exit code, written when it finishes
    <run_dir>/local_pids.json               local jobs only: {node: pid of its process-group leader}
    <run_dir>/local_state.json              local jobs only, written by the local launcher when all
                                            node processes have exited: {"state", "exit_code", "reason"}
    <run_dir>/cancel_requested.json         written by ``orchestrator cancel`` (who/when/signal)

``status`` polls many run directories every few seconds, so :func:`summarize` reads only the tail
of ``metrics.jsonl`` (seeking from the end) and never parses the whole file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.job_states import JobState

JOB_FILE = "job.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE.json"
LOGS_DIR = "logs"
LOCAL_PIDS_FILE = "local_pids.json"
LOCAL_STATE_FILE = "local_state.json"
CANCEL_MARKER = "cancel_requested.json"

_CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
_ATTEMPT_RE = re.compile(r"^attempt_(\d+)$")
_NODE_LOG_RE = re.compile(r"^node_(\d+)\.log$")
_NODE_EXIT_RE = re.compile(r"^node_(\d+)\.exit$")

#: How much of metrics.jsonl ``summarize`` reads at first; doubled (up to the cap) only when the
#: window holds no train event, e.g. right after a burst of eval lines.
TAIL_BYTES = 256 * 1024
TAIL_BYTES_CAP = 8 * 1024 * 1024
#: Train events used for the ETA: recent enough to follow a slowdown, many enough to smooth noise.
ETA_WINDOW = 50


# ---------------------------------------------------------------------------- small readers
def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None if missing, unreadable or half-written."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_job_json(run_dir: Path) -> dict[str, Any]:
    """``job.json`` (the resolved submission) or an empty dict if the launcher has not written it."""
    return read_json(Path(run_dir) / JOB_FILE) or {}


def read_tail_bytes(path: Path, max_bytes: int) -> tuple[bytes, bool]:
    """The last ``max_bytes`` of a file and whether that is the whole file (seek, don't scan)."""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        start = max(0, size - max_bytes)
        fh.seek(start)
        return fh.read(size - start), start == 0


def complete_lines(data: bytes, from_file_start: bool) -> list[bytes]:
    """Split a tail window into whole lines: drop the cut first line (unless the window starts at
    the file's beginning) and a torn last line (no trailing newline: still being written)."""
    lines = data.split(b"\n")
    # The element after the last "\n" is either b"" (file ends with newline) or a torn line.
    lines = lines[:-1]
    if not from_file_start and lines:
        lines = lines[1:]
    return lines


def tail_lines(path: Path, k: int, chunk: int = 64 * 1024) -> list[str]:
    """Last ``k`` complete lines of a text file, reading backwards in chunks from the end.

    A final line without newline is included here (logs of a finished process may lack one);
    callers that must skip torn lines use :func:`complete_lines`.
    """
    if k <= 0:
        return []
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        pos = fh.tell()
        buf = b""
        while pos > 0 and buf.count(b"\n") <= k:
            step = min(chunk, pos)
            pos -= step
            fh.seek(pos)
            buf = fh.read(step) + buf
    text = buf.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines[-k:]


def iter_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every complete event in metrics.jsonl, streamed (for plots; ``status`` uses the tail)."""
    path = Path(run_dir) / METRICS_FILE
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break  # torn last line: the writer is mid-line
                event = _parse_event(raw)
                if event is not None:
                    yield event
    except OSError:
        return


def _parse_event(raw: bytes) -> dict[str, Any] | None:
    raw = raw.strip()
    if not raw:
        return None
    try:
        event = json.loads(raw)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def read_metrics_tail(run_dir: Path, max_bytes: int = TAIL_BYTES) -> tuple[list[dict[str, Any]], bool]:
    """Complete events from the last ``max_bytes`` of metrics.jsonl and whether that was all of it."""
    path = Path(run_dir) / METRICS_FILE
    try:
        data, whole = read_tail_bytes(path, max_bytes)
    except OSError:
        return [], True
    events = [e for e in (_parse_event(line) for line in complete_lines(data, whole)) if e is not None]
    return events, whole


# ---------------------------------------------------------------------------- resume counting
_RESUME_NEEDLE = b'"resume"'
# (device, inode) -> (bytes scanned, resume events seen): `status --watch` rescans only new bytes.
_resume_cache: dict[tuple[int, int], tuple[int, int]] = {}
#: Keys counted by this process: what :class:`SummaryCache` carries over to the next ``status``, so
#: a live run's file is scanned once, then only its new bytes, not whole on every call.
_resume_touched: set[tuple[int, int]] = set()


def count_resumes(run_dir: Path) -> int:
    """Number of resume events in metrics.jsonl.

    A resume happens at most once per attempt, so the count is a whole-file property that a tail
    window cannot give. Rather than JSON-parse the file, count the ``"resume"`` token in complete
    lines with a byte search, and remember how far we got (per inode) so repeated polls only read
    what was appended.
    """
    path = Path(run_dir) / METRICS_FILE
    try:
        st = path.stat()
    except OSError:
        return 0
    key = (st.st_dev, st.st_ino)
    _resume_touched.add(key)
    done, count = _resume_cache.get(key, (0, 0))
    if st.st_size < done:  # truncated / rewritten: start over
        done, count = 0, 0
    if st.st_size == done:
        return count
    try:
        with open(path, "rb") as fh:
            fh.seek(done)
            carry = b""
            while True:
                chunk = fh.read(1 << 20)
                if not chunk:
                    break
                data = carry + chunk
                cut = data.rfind(b"\n") + 1
                complete, carry = data[:cut], data[cut:]
                if _RESUME_NEEDLE in complete:  # rare: split and parse only such chunks
                    count += sum(
                        1 for ln in complete.split(b"\n") if _RESUME_NEEDLE in ln and _is_resume_line(ln)
                    )
                done += len(complete)
    except OSError:
        return count
    _resume_cache[key] = (done, count)
    return count


def _is_resume_line(line: bytes) -> bool:
    event = _parse_event(line)
    return event is not None and event.get("event") == "resume"


def resume_points(run_dir: Path) -> list[dict[str, Any]]:
    """All resume events (step, checkpoint), in file order; used by the plot."""
    return [e for e in iter_metrics(run_dir) if e.get("event") == "resume"]


# ---------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint folder whose COMPLETE.json marker and listed files all check out."""

    step: int
    path: Path
    world_size: int | None
    strategy: str | None
    n_files: int
    total_bytes: int


def verify_checkpoint(ckpt_dir: Path) -> CheckpointInfo | None:
    """Return info if ``ckpt_dir`` is complete: marker present and every listed file has its size.

    A checkpoint interrupted by SIGKILL may have a marker-less folder or (on odd file systems) a
    marker written before data hit disk; checking sizes catches the second case cheaply (stat only).
    """
    marker = read_json(ckpt_dir / COMPLETE_MARKER)
    if marker is None:
        return None
    files = marker.get("files")
    if not isinstance(files, dict):
        return None
    total = 0
    for rel, size in files.items():
        rel_s = str(rel)
        # Refuse paths that escape the checkpoint folder: the marker is data, not trusted code.
        # (A string check: resolve() costs several syscalls per file, times 1,000 runs per status.)
        if rel_s.startswith(("/", "\\")) or ".." in rel_s.replace("\\", "/").split("/"):
            return None
        try:
            actual = os.stat(os.path.join(ckpt_dir, rel_s)).st_size
        except OSError:
            return None
        if not isinstance(size, int) or actual != size:
            return None
        total += actual
    m = _CHECKPOINT_RE.match(ckpt_dir.name)
    step = marker.get("step")
    if not isinstance(step, int):
        step = int(m.group(1)) if m else -1
    ws = marker.get("world_size")
    strategy = marker.get("strategy")
    return CheckpointInfo(
        step=step,
        path=ckpt_dir,
        world_size=ws if isinstance(ws, int) else None,
        strategy=strategy if isinstance(strategy, str) else None,
        n_files=len(files),
        total_bytes=total,
    )


def last_complete_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """Newest checkpoint that verifies; skips ``.tmp*`` folders and incomplete ones."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    try:
        entries = list(os.scandir(root))
    except OSError:
        return None
    candidates: list[tuple[int, Path]] = []
    for entry in entries:
        if entry.name.startswith(".tmp"):
            continue
        m = _CHECKPOINT_RE.match(entry.name)
        if m and entry.is_dir():
            candidates.append((int(m.group(1)), Path(entry.path)))
    for _, path in sorted(candidates, reverse=True):
        info = verify_checkpoint(path)
        if info is not None:
            return info
    return None


# ---------------------------------------------------------------------------- logs layout
def attempt_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """``[(attempt, path)]`` sorted by attempt number (attempt_10 after attempt_9)."""
    root = Path(run_dir) / LOGS_DIR
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    out = []
    for entry in entries:
        m = _ATTEMPT_RE.match(entry.name)
        if m and entry.is_dir():
            out.append((int(m.group(1)), Path(entry.path)))
    return sorted(out)


def node_logs(attempt_dir: Path) -> list[tuple[int, Path]]:
    """``[(node, path)]`` of ``node_<N>.log`` files in one attempt folder, sorted by node."""
    try:
        entries = list(os.scandir(attempt_dir))
    except OSError:
        return []
    out = []
    for entry in entries:
        m = _NODE_LOG_RE.match(entry.name)
        if m and entry.is_file():
            out.append((int(m.group(1)), Path(entry.path)))
    return sorted(out)


# ---------------------------------------------------------------------------- summary
@dataclass(frozen=True)
class RunSummary:
    """What ``status`` shows for one run; every field may be None before the first event."""

    run_dir: Path
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    val_step: int | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    world_size: int | None = None
    strategy: str | None = None
    peak_mem_mb: float | None = None
    last_event_time: float | None = None
    checkpoint: CheckpointInfo | None = None
    resumes: int = 0
    attempts: int = 0
    job: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["run_dir"] = str(self.run_dir)
        if self.checkpoint is not None:
            data["checkpoint"] = {**asdict(self.checkpoint), "path": str(self.checkpoint.path)}
        return data


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def estimate_seconds_per_step(train_events: list[dict[str, Any]]) -> float | None:
    """Wall-clock seconds per step over the recent train events of the current attempt.

    Uses the slope of (time, step) so eval and checkpoint pauses are included (an ETA that ignores
    them is optimistic); falls back to the median ``step_time_s`` when there is only one point.
    """
    window = train_events[-ETA_WINDOW:]
    pts = [(_num(e.get("time")), _int(e.get("step"))) for e in window]
    good = [(t, s) for t, s in pts if t is not None and s is not None]
    if len(good) >= 2:
        (t0, s0), (t1, s1) = good[0], good[-1]
        if s1 > s0 and t1 >= t0:
            return (t1 - t0) / (s1 - s0)
    times = [x for x in (_num(e.get("step_time_s")) for e in window) if x is not None and x >= 0]
    if not times:
        return None
    import statistics  # here: it pulls in fractions and decimal, ~5 ms of every `status` start

    return statistics.median(times)


def iter_lines_reversed(path: Path, max_bytes: int, chunk: int = 32 * 1024) -> Iterator[bytes]:
    """Complete lines of a file, newest first, reading backwards from the end in chunks.

    Reads at most ``max_bytes``; a torn last line (no newline yet) is skipped, and the cut line
    at the window's start is not yielded. A consumer that stops early reads only what it used.
    """
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        limit = max(0, end - max_bytes)
        pos = end
        buf = b""
        torn_dropped = False
        while pos > limit:
            step = min(chunk, pos - limit)
            pos -= step
            fh.seek(pos)
            buf = fh.read(step) + buf
            if not torn_dropped:
                nl = buf.rfind(b"\n")
                if nl < 0:
                    continue
                buf = buf[: nl + 1]
                torn_dropped = True
            first_nl = buf.find(b"\n")
            complete, buf = buf[first_nl + 1 :], buf[: first_nl + 1]
            if complete:
                yield from reversed(complete[:-1].split(b"\n"))
        if pos == 0 and torn_dropped and buf:
            yield buf[:-1]


def _train_window_ends(window_newest_first: list[bytes]) -> list[dict[str, Any]]:
    """Parse only the newest and the oldest train event of the ETA window (the slope needs no more)."""
    newest = next(
        (e for e in map(_parse_event, window_newest_first) if e and e.get("event") == "train"), None
    )
    if newest is None:
        return []
    oldest = next(
        (e for e in map(_parse_event, reversed(window_newest_first)) if e and e.get("event") == "train"), None
    )
    if oldest is None or oldest is newest or oldest.get("step") == newest.get("step"):
        return [newest]
    return [oldest, newest]


def summarize(run_dir: Path | str, tail_bytes: int = TAIL_BYTES) -> RunSummary:
    """Summarise a run from job.json, the tail of metrics.jsonl, checkpoints and log folders.

    metrics.jsonl is read backwards and only a few lines are JSON-parsed: the newest and the
    ``ETA_WINDOW``-th newest train event of the current attempt (the ETA is the wall-clock slope
    between them), the newest eval (searched within ``tail_bytes``) and the newest resume. A
    byte-substring test classifies the other lines without parsing, so ``status`` over 1,000 runs
    costs a handful of parses per run, not thousands.
    """
    run_dir = Path(run_dir)
    job = read_job_json(run_dir)
    train_raw: list[bytes] = []  # newest first, parsed lazily (only the window's ends are needed)
    train_before_resume: int | None = None  # how many of them are newer than the newest resume
    resume: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None
    last_time: float | None = None
    seen = 0
    try:
        for raw in iter_lines_reversed(run_dir / METRICS_FILE, TAIL_BYTES_CAP):
            seen += len(raw) + 1
            want_train = len(train_raw) < ETA_WINDOW and not train_before_resume
            if want_train and b'"train"' in raw:
                train_raw.append(raw)
            if last_time is None:
                event = _parse_event(raw)
                last_time = _num(event.get("time")) if event else None
            if last_eval is None and seen <= tail_bytes and b'"eval"' in raw:
                event = _parse_event(raw)
                if event and event.get("event") == "eval" and _num(event.get("val_loss")) is not None:
                    last_eval = event
            if resume is None and b'"resume"' in raw:
                event = _parse_event(raw)
                if event and event.get("event") == "resume":
                    resume = event
                    train_before_resume = len(train_raw)
            enough_train = len(train_raw) >= ETA_WINDOW or bool(train_before_resume)
            if enough_train and (last_eval is not None or seen > tail_bytes):
                break
    except OSError:
        pass
    # Only the current attempt's train events estimate speed: across a resume the clock jumps.
    window = train_raw[:train_before_resume] if train_before_resume else train_raw
    train = _train_window_ends(window)  # oldest .. newest (at most two events, or one)

    last = train[-1] if train else {}
    step = _int(last.get("step"))
    if step is None and resume is not None:
        step = _int(resume.get("step"))
    max_steps = _int(last.get("max_steps")) or _int(job.get("max_steps"))
    sec_per_step = estimate_seconds_per_step(train)
    eta: float | None = None
    if step is not None and max_steps is not None and sec_per_step is not None:
        eta = max(0, max_steps - step) * sec_per_step

    world_size = _int(last.get("world_size"))
    if world_size is None and _int(job.get("nodes")) and _int(job.get("procs_per_node")):
        world_size = int(job["nodes"]) * int(job["procs_per_node"])
    strategy = last.get("strategy") if isinstance(last.get("strategy"), str) else job.get("strategy")
    return RunSummary(
        run_dir=run_dir,
        step=step,
        max_steps=max_steps,
        loss=_num(last.get("loss")),
        val_loss=_num(last_eval.get("val_loss")) if last_eval else None,
        val_step=_int(last_eval.get("step")) if last_eval else None,
        lr=_num(last.get("lr")),
        tokens_per_s=_num(last.get("tokens_per_s")),
        step_time_s=_num(last.get("step_time_s")),
        eta_s=eta,
        world_size=world_size,
        strategy=strategy if isinstance(strategy, str) else None,
        peak_mem_mb=_num(last.get("peak_mem_mb")),
        last_event_time=last_time,
        checkpoint=last_complete_checkpoint(run_dir),
        resumes=count_resumes(run_dir),
        attempts=len(attempt_dirs(run_dir)),
        job=job,
    )


# ---------------------------------------------------------------------------- local job state
@dataclass(frozen=True)
class LocalState:
    """State of a ``local`` job as read from its run directory."""

    state: JobState
    exit_code: int | None = None
    reason: str | None = None
    alive_pids: tuple[int, ...] = ()


def read_local_pids(run_dir: Path) -> dict[str, int]:
    """``local_pids.json`` as ``{node: pid}`` (empty if the launcher has not written it yet)."""
    data = read_json(Path(run_dir) / LOCAL_PIDS_FILE) or {}
    return {str(k): v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _pid_alive(pid: int, not_after: float | None) -> bool:
    """True if ``pid`` runs and is not a zombie, and (when known) started before the pid file was
    written -- a recycled pid belonging to some later process must not make a dead job look alive."""
    import psutil  # local import: only local jobs pay for it

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return not (not_after is not None and proc.create_time() > not_after + 2.0)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def node_exit_codes(attempt_dir: Path) -> dict[int, int]:
    """``{node: exit code}`` from the ``node_<N>.exit`` files the node entry point writes last."""
    codes: dict[int, int] = {}
    try:
        entries = list(os.scandir(attempt_dir))
    except OSError:
        return codes
    for entry in entries:
        m = _NODE_EXIT_RE.match(entry.name)
        if not m:
            continue
        try:
            codes[int(m.group(1))] = int(Path(entry.path).read_text().strip())
        except (OSError, ValueError):
            continue
    return codes


def local_state(run_dir: Path | str) -> LocalState:
    """Derive a local job's state from its run directory.

    Order of evidence: the launcher's final ``local_state.json``; live processes from
    ``local_pids.json`` (RUNNING); every node of the latest attempt having written its
    ``node_<N>.exit`` (COMPLETED if all are 0); a cancel marker (CANCELLED); processes gone with no
    final record (FAILED). No pid file yet means the launcher has not started (PENDING).
    """
    run_dir = Path(run_dir)
    final = read_json(run_dir / LOCAL_STATE_FILE)
    if final is not None:
        raw = str(final.get("state", "UNKNOWN")).upper()
        state = JobState(raw) if raw in JobState.__members__ else JobState.UNKNOWN
        code = final.get("exit_code")
        reason = final.get("reason")
        return LocalState(
            state,
            code if isinstance(code, int) and not isinstance(code, bool) else None,
            reason if isinstance(reason, str) else None,
        )
    pids_path = run_dir / LOCAL_PIDS_FILE
    pids = read_local_pids(run_dir)
    if not pids:
        return LocalState(JobState.PENDING, reason="local launcher has not started")
    try:
        written = pids_path.stat().st_mtime
    except OSError:
        written = None
    alive = tuple(p for p in pids.values() if _pid_alive(p, written))
    if alive:
        return LocalState(JobState.RUNNING, alive_pids=alive)
    cancelled = (run_dir / CANCEL_MARKER).exists()
    attempts = attempt_dirs(run_dir)
    if attempts:
        codes = node_exit_codes(attempts[-1][1])
        expected = _int(read_job_json(run_dir).get("nodes")) or len(pids)
        if codes and len(codes) >= expected:
            bad = {n: c for n, c in sorted(codes.items()) if c != 0}
            if not bad:
                return LocalState(JobState.COMPLETED, exit_code=0)
            node, code = next(iter(bad.items()))
            if cancelled:
                return LocalState(JobState.CANCELLED, exit_code=code, reason="cancelled by user")
            return LocalState(JobState.FAILED, exit_code=code, reason=f"node {node} exited {code}")
    if cancelled:
        return LocalState(JobState.CANCELLED, reason="cancelled by user")
    return LocalState(JobState.FAILED, reason="local processes exited without recording an exit code")


def write_cancel_marker(run_dir: Path, signal_name: str, user: str | None = None) -> None:
    """Record that ``cancel`` was asked (atomic rename), so a killed local job reads CANCELLED."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".{CANCEL_MARKER}.{os.getpid()}.tmp"
    payload = {"signal": signal_name, "time": time.time(), "user": user or os.environ.get("USER")}
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    os.replace(tmp, run_dir / CANCEL_MARKER)


# ---------------------------------------------------------------------------- summary cache
#: A cached summary is trusted only if every file and folder it depends on was last modified at
#: least this long before it was read: modification times are coarse (a clock tick), so a change
#: made within the same tick as our read would otherwise go unseen ("racy git"). Live runs append
#: to metrics.jsonl every step and so are simply re-read on every call, as before.
RACY_S = 2.0
SUMMARY_CACHE_FILE = "status_cache.json"
_CACHE_VERSION = 3
_CACHE_MAX_ENTRIES = 20_000
_SUMMARY_FIELDS = [f for f in RunSummary.__dataclass_fields__ if f not in ("run_dir", "checkpoint")]
_CHECKPOINT_FIELDS = [f for f in CheckpointInfo.__dataclass_fields__ if f != "path"]


def _stat_key(path: str) -> tuple[str, int]:
    """``("inode,size,mtime_ns", mtime_ns)``; ``("", 0)`` when missing. A string: compact to store
    and one comparison to check."""
    try:
        st = os.stat(path)
    except OSError:
        return "", 0
    return f"{st.st_ino},{st.st_size},{st.st_mtime_ns}", st.st_mtime_ns


def _summary_to_cache(summary: RunSummary) -> list[Any]:
    ckpt = summary.checkpoint
    values = [getattr(summary, f) for f in _SUMMARY_FIELDS]
    if ckpt is None:
        return [values, None]
    # The folder's name only: it always lies in <run_dir>/checkpoints (_checkpoint_fingerprint
    # checks), and joining one name is far cheaper than parsing a whole path again.
    return [values, [ckpt.path.name, *(getattr(ckpt, f) for f in _CHECKPOINT_FIELDS)]]


def _summary_from_cache(run_dir: Path, data: list[Any]) -> RunSummary:
    """Rebuild a RunSummary without its generated ``__init__`` (a frozen dataclass sets each of its
    18 fields through ``object.__setattr__``: the largest cost of a cache hit)."""
    values, ckpt = data
    info = None
    if ckpt is not None:
        info = CheckpointInfo.__new__(CheckpointInfo)
        info.__dict__.update(zip(_CHECKPOINT_FIELDS, ckpt[1:], strict=True), path=run_dir.joinpath(CHECKPOINTS_DIR, ckpt[0]))
    summary = RunSummary.__new__(RunSummary)
    summary.__dict__.update(zip(_SUMMARY_FIELDS, values, strict=True), run_dir=run_dir, checkpoint=info)
    return summary


class SummaryCache:
    """``summarize`` for many runs, skipping runs whose files did not change since the last call.

    ``status`` over 1,000 jobs spent most of its time re-reading 1,000 run directories that had
    not changed. This keeps each run's summary in one JSON file (next to the registry) with a
    fingerprint of everything :func:`summarize` reads: (inode, size, mtime) of job.json,
    metrics.jsonl, checkpoints/ and logs/, of every checkpoint folder searched before the one found
    complete (none may have a marker yet), and of that checkpoint's marker, plus the sizes its
    marker lists -- which are checked again on every use, as ``summarize`` does. A hit costs a few
    ``stat`` calls; any difference, or a fingerprint too recent to trust (:data:`RACY_S`), means a
    fresh ``summarize``. The file is only a cache: unreadable or foreign content is ignored, writes
    are atomic, and concurrent writers at worst drop each other's new entries.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, Any] = {}
        self._used: set[str] = set()
        self._dirty = False
        self._resumes_loaded: list[list[int]] = []
        if path is not None:
            try:
                with open(path, encoding="utf-8") as fh:
                    data = json.load(fh)
                if isinstance(data, dict) and data.get("version") == _CACHE_VERSION:
                    entries = data.get("entries")
                    self._entries = entries if isinstance(entries, dict) else {}
                    for dev, ino, done, count in data.get("resumes") or []:
                        if all(type(v) is int for v in (dev, ino, done, count)):
                            _resume_cache.setdefault((dev, ino), (done, count))
                            self._resumes_loaded.append([dev, ino, done, count])
                    self._resumes_loaded.sort()
            except (OSError, ValueError, TypeError):
                self._entries = {}

    def summarize(self, run_dir: Path | str) -> RunSummary:
        if not isinstance(run_dir, Path):
            run_dir = Path(run_dir)
        key = str(run_dir)
        self._used.add(key)
        base, newest = _base_fingerprint(key)
        entry = self._entries.get(key)
        if entry is not None:
            try:
                if entry[0] == base and _checkpoint_still(key, entry[1]):
                    return _summary_from_cache(run_dir, entry[2])
            except (TypeError, ValueError, KeyError, IndexError, AttributeError):
                pass  # a malformed entry: recompute it
        summary = summarize(run_dir)
        ckpt = _checkpoint_fingerprint(key, summary.checkpoint)
        if ckpt is not None and max(newest, ckpt[1]) < time.time_ns() - int(RACY_S * 1e9):
            self._entries[key] = [base, ckpt[0], _summary_to_cache(summary)]
            self._dirty = True
        elif self._entries.pop(key, None) is not None:
            self._dirty = True
        return summary

    def save(self) -> None:
        """Write the cache if anything changed (atomically; failures are ignored: it is a cache)."""
        resumes = sorted([*key, *_resume_cache[key]] for key in _resume_touched if key in _resume_cache)
        if self.path is None or not (self._dirty or resumes != self._resumes_loaded):
            return
        entries = self._entries
        if len(entries) > _CACHE_MAX_ENTRIES:
            entries = {k: v for k, v in entries.items() if k in self._used}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(
                    {"version": _CACHE_VERSION, "entries": entries, "resumes": resumes}, fh, separators=(",", ":")
                )
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _base_fingerprint(run_dir: str) -> tuple[str, int]:
    """One string for job.json, metrics.jsonl, checkpoints/ and logs/, and the newest mtime."""
    prefix = run_dir if run_dir.endswith("/") else run_dir + "/"
    a, ma = _stat_key(prefix + JOB_FILE)
    b, mb = _stat_key(prefix + METRICS_FILE)
    c, mc = _stat_key(prefix + CHECKPOINTS_DIR)
    d, md = _stat_key(prefix + LOGS_DIR)
    return f"{a}|{b}|{c}|{d}", max(ma, mb, mc, md)


def _checkpoint_fingerprint(run_dir: str, found: CheckpointInfo | None) -> tuple[list[Any], int] | None:
    """What the checkpoint answer depends on beyond the checkpoints/ folder's own stat, and the
    newest mtime in it; None when it cannot be cached (a folder searched before the one found
    already has its marker: only its files' sizes, which no folder stat shows, can change it).

    ``[[[folder, stat]...], [marker, stat] | None, [[file, size]...]]``, paths relative to the run.
    """
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    found_path = str(found.path) if found is not None else None
    m_found = _CHECKPOINT_RE.match(found.path.name) if found is not None else None
    found_step = int(m_found.group(1)) if m_found else -1  # by folder name, as the search orders them
    newer: list[list[Any]] = []
    newest = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        entries = []
    for entry in entries:
        m = _CHECKPOINT_RE.match(entry.name)
        if not m or entry.path == found_path or int(m.group(1)) < found_step or not entry.is_dir():
            continue
        if os.path.exists(os.path.join(entry.path, COMPLETE_MARKER)):
            return None
        key, mtime = _stat_key(entry.path)
        newer.append([os.path.join(CHECKPOINTS_DIR, entry.name), key])
        newest = max(newest, mtime)
    if found is None:
        return [newer, None, []], newest
    rel = os.path.join(CHECKPOINTS_DIR, found.path.name)
    if os.path.join(run_dir, rel) != found_path:
        return None  # not where the search looks (cannot happen; be safe rather than wrong)
    marker = read_json(found.path / COMPLETE_MARKER)
    files = marker.get("files") if marker else None
    if not isinstance(files, dict):
        return None
    key, mtime = _stat_key(os.path.join(found_path, COMPLETE_MARKER))
    listed = [[os.path.join(rel, str(name)), size] for name, size in files.items()]
    return [newer, [os.path.join(rel, COMPLETE_MARKER), key], listed], max(newest, mtime)


def _checkpoint_still(run_dir: str, ckpt: list[Any]) -> bool:
    """The cached checkpoint answer holds: earlier-searched folders untouched, marker unchanged,
    every file it lists still of the listed size."""
    newer, marker, files = ckpt
    prefix = run_dir if run_dir.endswith("/") else run_dir + "/"
    for folder, key in newer:
        if _stat_key(prefix + folder)[0] != key:
            return False
    if marker is not None and _stat_key(prefix + marker[0])[0] != marker[1]:
        return False
    for path, size in files:
        try:
            if os.stat(prefix + path).st_size != size:
                return False
        except OSError:
            return False
    return True
