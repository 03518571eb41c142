"""JSON files of the run directory, read and written safely (standard library only): a reader never
sees half a file, and a missing or torn one reads as None."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None if missing, unreadable or half-written."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: dict[str, Any], indent: int | None = None) -> None:
    """Write through a temp file and rename: a reader sees the old file or the new one, never half.
    The temp name is per process: two writers (a broken launch where two ranks both believe they
    are rank 0) must not interleave their bytes in one temp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent), encoding="utf-8")
    os.replace(tmp, path)
