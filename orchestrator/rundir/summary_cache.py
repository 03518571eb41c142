"""``status`` over many runs: skip the runs whose files did not change since the last call."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import (
    _CHECKPOINT_RE,
    CHECKPOINTS_DIR,
    COMPLETE_MARKER,
    CORRUPT_MARKER,
    JOB_FILE,
    LOGS_DIR,
    METRICS_FILE,
    CheckpointInfo,
    read_json,
)
from orchestrator.rundir.liveness import liveness_of, logs_folder, newest_attempt
from orchestrator.rundir.summary import RunSummary, _resume_cache, _resume_touched, summarize

# ---------------------------------------------------------------------------- summary cache
#: A cached summary is trusted only if every file and folder it depends on was last modified at
#: least this long before it was read: modification times are coarse (a clock tick), so a change
#: made within the same tick as our read would otherwise go unseen ("racy git"). Live runs append
#: to metrics.jsonl every step and so are simply re-read on every call, as before.
RACY_S = 2.0
SUMMARY_CACHE_FILE = "status_cache.json"
_CACHE_VERSION = 6
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
        info.__dict__.update(
            zip(_CHECKPOINT_FIELDS, ckpt[1:], strict=True), path=run_dir.joinpath(CHECKPOINTS_DIR, ckpt[0])
        )
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

    The same file keeps, per run, which files a running job's liveness is read from (the newest
    attempt, its node logs, whether it has heartbeats: :meth:`liveness`), keyed on the stat of
    ``logs/`` and of that attempt's folder, under the same :data:`RACY_S` rule.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, Any] = {}
        self._attempts: dict[str, Any] = {}
        self._logs_keys: dict[str, tuple[str, int]] = {}
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
                    attempts = data.get("attempts")
                    self._attempts = attempts if isinstance(attempts, dict) else {}
                    for dev, ino, done, count in data.get("resumes") or []:
                        if all(type(v) is int for v in (dev, ino, done, count)):
                            _resume_cache.setdefault((dev, ino), (done, count))
                            self._resumes_loaded.append([dev, ino, done, count])
                    self._resumes_loaded.sort()
            except (OSError, ValueError, TypeError):
                self._entries, self._attempts = {}, {}

    def summarize(self, run_dir: Path | str) -> RunSummary:
        if not isinstance(run_dir, Path):
            run_dir = Path(run_dir)
        key = str(run_dir)
        self._used.add(key)
        base, newest, logs = _base_fingerprint(key)
        self._logs_keys[key] = logs
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

    def liveness(self, run_dir: Path | str, now: float | None = None) -> dict[str, Any] | None:
        """:func:`orchestrator.rundir.liveness.liveness`, with the listing of ``logs/`` and of the newest
        attempt's folder kept while neither folder changed (a new attempt, node log or heartbeat
        folder changes its folder's mtime). The node logs' mtimes and the heartbeats, the answer
        itself, are read fresh on every call: only which files to look at is remembered."""
        key = str(run_dir)
        self._used.add(key)
        logs = self._logs_keys.get(key) or _stat_key(logs_folder(key))
        entry = self._attempts.get(key)
        if entry is not None:
            try:
                logs_key, folder_key, attempt, name, node_logs, beats = entry
                folder = logs_folder(key) + name
                if logs_key == logs[0] and folder_key == _stat_key(folder)[0]:
                    return liveness_of(attempt, folder, node_logs, beats, now)
            except (TypeError, ValueError, AttributeError):
                pass  # a malformed entry: list again
        found = newest_attempt(key)
        if found is None:
            if self._attempts.pop(key, None) is not None:
                self._dirty = True
            return None
        attempt, folder, node_logs, beats = found
        # Kept only while both folders are older than RACY_S: a change made while they were being
        # listed or stat'ed would carry a newer mtime, so such a listing is never cached.
        folder_key, folder_mtime = _stat_key(folder)
        if logs[0] and folder_key and max(logs[1], folder_mtime) < time.time_ns() - int(RACY_S * 1e9):
            self._attempts[key] = [logs[0], folder_key, attempt, os.path.basename(folder), node_logs, beats]
            self._dirty = True
        elif self._attempts.pop(key, None) is not None:
            self._dirty = True
        return liveness_of(attempt, folder, node_logs, beats, now)

    def save(self) -> None:
        """Write the cache if anything changed (atomically; failures are ignored: it is a cache)."""
        resumes = sorted([*key, *_resume_cache[key]] for key in _resume_touched if key in _resume_cache)
        if self.path is None or not (self._dirty or resumes != self._resumes_loaded):
            return
        entries, attempts = self._entries, self._attempts
        if len(entries) > _CACHE_MAX_ENTRIES or len(attempts) > _CACHE_MAX_ENTRIES:
            entries = {k: v for k, v in entries.items() if k in self._used}
            attempts = {k: v for k, v in attempts.items() if k in self._used}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(
                    {"version": _CACHE_VERSION, "entries": entries, "resumes": resumes, "attempts": attempts},
                    fh,
                    separators=(",", ":"),
                )
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _base_fingerprint(run_dir: str) -> tuple[str, int, tuple[str, int]]:
    """One string for job.json, metrics.jsonl, checkpoints/ and logs/, the newest mtime, and the key
    of logs/ alone (what :meth:`SummaryCache.liveness` checks its listing against)."""
    prefix = run_dir if run_dir.endswith("/") else run_dir + "/"
    a, ma = _stat_key(prefix + JOB_FILE)
    b, mb = _stat_key(prefix + METRICS_FILE)
    c, mc = _stat_key(prefix + CHECKPOINTS_DIR)
    d, md = logs = _stat_key(prefix + LOGS_DIR)
    return f"{a}|{b}|{c}|{d}", max(ma, mb, mc, md), logs


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
    # A restore that finds this checkpoint's content bad marks it CORRUPT.json: a file inside the
    # folder, which neither checkpoints/ nor the marker's stat shows.
    newer.append([os.path.join(rel, CORRUPT_MARKER), _stat_key(os.path.join(found_path, CORRUPT_MARKER))[0]])
    key, mtime = _stat_key(os.path.join(found_path, COMPLETE_MARKER))
    listed = [[os.path.join(rel, str(name)), size] for name, size in files.items()]
    return [newer, [os.path.join(rel, COMPLETE_MARKER), key], listed], max(newest, mtime)


def _checkpoint_still(run_dir: str, ckpt: list[Any]) -> bool:
    """The cached checkpoint answer holds: earlier-searched folders untouched, marker unchanged,
    every file it lists still of the listed size."""
    newer, marker, files = ckpt
    prefix = run_dir if run_dir.endswith("/") else run_dir + "/"
    for folder, key in newer:
        if not key and not os.access(prefix + folder, os.F_OK):
            continue  # still missing (CORRUPT.json, as a rule): no stat result, no exception to make
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
