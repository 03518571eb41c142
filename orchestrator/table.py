"""Plain-text tables for the CLI (no dependency: rich would cost start-up time)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None) -> str:
    heads = [h.upper() for h in (headers or columns)]
    cells = [["" if row.get(c) is None else str(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip()]
    for r in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)
