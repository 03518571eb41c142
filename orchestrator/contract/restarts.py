"""Restarts inside an allocation (``restarts.jsonl``): the batch step appends one line per restart,
``status``, the notifications and the cost read them. One JSON object a line: ``job_id``,
``failed_attempt``, ``attempt``, ``cause``, ``step`` (the checkpoint the new attempt starts from),
``time``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import RESTARTS_FILE


def read_restarts(run_dir: Path) -> list[dict[str, Any]]:
    """Every restart inside an allocation the run had (:data:`RESTARTS_FILE`), oldest first; a torn
    last line is skipped."""
    out: list[dict[str, Any]] = []
    try:
        text = (Path(run_dir) / RESTARTS_FILE).read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def append_restart(run_dir: Path, record: dict[str, Any]) -> None:
    """One line, appended with a single write (a reader sees it whole or not at all)."""
    with open(Path(run_dir) / RESTARTS_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
