"""The scheduler's word, at each submission, on when the job would start (``start_estimates.jsonl``),
kept so that ``cost`` can say how far off it was once the job started. Standard library only."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import START_ESTIMATES_FILE


def record(run_dir: Path, job_id: str, estimate: str) -> None:
    """Append ``job_id``'s estimate (the scheduler's ISO time, e.g. ``2026-11-29T00:40:29``)."""
    line = json.dumps({"job_id": job_id, "estimate": estimate, "asked": time.time()})
    with open(Path(run_dir) / START_ESTIMATES_FILE, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def read(run_dir: Path) -> dict[str, dict[str, Any]]:
    """``job_id -> record`` (the first estimate of each job); {} without the file."""
    out: dict[str, dict[str, Any]] = {}
    try:
        lines = (Path(run_dir) / START_ESTIMATES_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("job_id"), str):
            out.setdefault(data["job_id"], data)
    return out


def epoch(stamp: object) -> float | None:
    """The scheduler's local ISO time as epoch seconds (None when it is not one)."""
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def estimate_of(said: str) -> str | None:
    """The time in a scheduler's answer (``Job 57 to start at 2026-11-29T00:40:29 using ...``)."""
    stamp = said.split(" to start at ", 1)[-1].split()[0] if " to start at " in said else ""
    return stamp if epoch(stamp) is not None else None


def notes(run_dir: Path, attempts: Any) -> list[str]:
    """For ``cost``: how far off each recorded estimate was, by the job's first allocation's start
    (``attempts``: objects with ``job_id`` and ``start``, epoch seconds or None)."""
    out = []
    for job_id, said in read(run_dir).items():
        started = [a.start for a in attempts if a.job_id == job_id and a.start is not None]
        when = epoch(said.get("estimate"))
        if not started or when is None:
            continue
        off = min(started) - when
        out.append(
            f"job {job_id}: the scheduler's start estimate at submission was {said['estimate']}; "
            f"it started {abs(off):.0f} s {'later' if off >= 0 else 'earlier'}"
        )
    return out
