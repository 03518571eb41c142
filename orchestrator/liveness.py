"""Is a running job alive? How long since any rank wrote output, and which rank is the slowest.

For ``status``: a hang in a script without heartbeats shows only as silence (measured: a 2-node job
stuck in a collective sat in RUNNING at ~2 % CPU for minutes with nothing in ``status`` or ``logs``).
The node logs carry every rank's output (torchrun tees it there), so their newest modification time
is the last output of any rank: one ``stat`` per node. Stragglers come from the heartbeats.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from orchestrator.heartbeat import read_heartbeats, stragglers
from orchestrator.run_dir import attempt_dirs, node_logs

#: ``status`` prints a line under the table for a running job silent for longer than this.
SILENT_NOTE_S = 20.0


def liveness(run_dir: Path, now: float | None = None) -> dict[str, Any] | None:
    """``{"attempt", "silent_s", "stragglers"}`` of the newest attempt, or None before one started."""
    attempts = attempt_dirs(run_dir)
    if not attempts:
        return None
    attempt, path = attempts[-1]
    mtimes = []
    for _node, log in node_logs(path):
        try:
            mtimes.append(os.stat(log).st_mtime)
        except OSError:
            continue
    now = time.time() if now is None else now
    found = stragglers(read_heartbeats(path))
    return {
        "attempt": attempt,
        "silent_s": round(max(0.0, now - max(mtimes)), 1) if mtimes else None,
        "stragglers": found.to_json() if found else None,
    }


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
