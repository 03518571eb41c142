"""Is a running job alive? How long since any rank wrote output, and which rank is the slowest.

For ``status``: a hang in a script without heartbeats shows only as silence (measured: a 2-node job
stuck in a collective sat in RUNNING at ~2 % CPU for minutes with nothing in ``status`` or ``logs``).
The node logs carry every rank's output (torchrun tees it there), so their newest modification time
is the last output of any rank: one ``stat`` per node. Stragglers come from the heartbeats.

``status`` asks this for every running job on every call (1,000 of them in bench/), so it works on
strings and ``os`` calls, not ``pathlib``: a listing of ``logs/`` and of the newest attempt's folder
(:func:`newest_attempt`; ``status`` keeps that listing in its summary cache while both folders stay
unchanged), then a ``stat`` per node log and the heartbeats, read fresh on every call
(:func:`liveness_of`): a silent job's silence grows between two calls.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import _ATTEMPT_RE, HEARTBEAT_DIR, LOGS_DIR, NODE_LOG_RE

#: ``status`` prints a line under the table for a running job silent for longer than this.
SILENT_NOTE_S = 20.0


def _attempts_newest_first(logs: str) -> list[tuple[int, str]]:
    """``[(attempt, folder name)]`` of the names in ``logs/`` that look like attempt folders, newest
    first (whether each is a folder is left to the caller, which lists only the first that is)."""
    try:
        names = os.listdir(logs)
    except OSError:
        return []
    found = [(int(m.group(1)), name) for name in names if (m := _ATTEMPT_RE.match(name))]
    found.sort(reverse=True)
    return found


def logs_folder(run_dir: Path | str) -> str:
    """``<run_dir>/logs/``, as a string ending in the separator."""
    run = os.fspath(run_dir)
    return (run if run.endswith("/") else run + "/") + LOGS_DIR + "/"


def newest_attempt(run_dir: Path | str) -> tuple[int, str, list[str], bool] | None:
    """``(attempt, its folder, its node logs' names, whether it has a heartbeat folder)`` of the
    newest attempt, or None before one started: what :func:`liveness_of` needs besides the clock."""
    logs = logs_folder(run_dir)
    for attempt, name in _attempts_newest_first(logs):
        folder = logs + name
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            if not os.path.isdir(folder):  # not a folder: the next older one is the newest attempt
                continue
            entries = []  # a folder we cannot list: its attempt, with nothing known about it
        names = [e.name for e in entries if NODE_LOG_RE.match(e.name) and e.is_file()]
        return attempt, folder, names, any(e.name == HEARTBEAT_DIR for e in entries)
    return None


def liveness_of(
    attempt: int, folder: str, node_logs: list[str], beats: bool, now: float | None = None
) -> dict[str, Any]:
    """The liveness of one attempt whose folder holds ``node_logs`` (names) and, if ``beats``, a
    heartbeat folder: a ``stat`` per node log and the heartbeats, read now."""
    prefix = folder + "/"
    mtimes = []
    for name in node_logs:
        try:
            mtimes.append(os.stat(prefix + name).st_mtime)
        except OSError:
            continue
    now = time.time() if now is None else now
    found = None
    if beats:  # heartbeat (and the statistics it uses) only for a job whose ranks beat
        from orchestrator.contract.heartbeat import read_heartbeats, stragglers

        found = stragglers(read_heartbeats(Path(folder)))
    return {
        "attempt": attempt,
        "silent_s": round(max(0.0, now - max(mtimes)), 1) if mtimes else None,
        "stragglers": found.to_json() if found else None,
    }


def liveness(run_dir: Path | str, now: float | None = None) -> dict[str, Any] | None:
    """``{"attempt", "silent_s", "stragglers"}`` of the newest attempt, or None before one started."""
    found = newest_attempt(run_dir)
    return None if found is None else liveness_of(*found, now=now)


def liveness_lines(rows: list[tuple[str, dict[str, Any] | None]]) -> list[str]:
    """Under the status table: silent running jobs and flagged stragglers."""
    lines = []
    for job_id, live in rows:
        if not live:
            continue
        silent = live.get("silent_s")
        if silent is not None and silent >= SILENT_NOTE_S:
            lines.append(
                f"{job_id}: no output from any rank for {silent:.0f} s "
                f"(a hang? `orchestrator stacks {job_id}` shows where every rank is)"
            )
        s = live.get("stragglers")
        if s and s.get("flagged_ranks"):
            lines.append(
                f"{job_id}: straggler rank {s['slowest_rank']} on {s['slowest_host']}: {s['slowest_local_s']:.3f} s "
                f"per step outside collectives vs median {s['median_local_s']:.3f} s (x{s['ratio']})"
            )
    return lines
