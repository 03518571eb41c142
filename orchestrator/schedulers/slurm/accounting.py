"""What Slurm's accounting says each job was allocated, and when: the bill ``orchestrator cost`` splits.

One bounded ``sacct -D -X`` call for every job asked: ``-X`` keeps the allocation line (not its
steps), ``-D`` keeps every incarnation of a job that was requeued under its id (without it sacct
shows only the newest, and a same-job requeue's earlier allocations vanish from the bill). The
allocated TRES (``AllocTRES``) gives the GPUs (``gres/gpu``), CPUs and nodes; Slurm prints times
in the controller's local time without a zone, read here as this host's local time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime

from orchestrator.schedulers.query import Allocation, run_bounded

ACCOUNTING_FIELDS = "JobID,Submit,Start,End,AllocTRES,State"
_ID_RE = re.compile(r"^\d+(?:_\d+)?(?:\+\d+)?$")
_NULLS = frozenset({"", "(null)", "None", "Unknown", "N/A"})


def _epoch(text: str) -> float | None:
    text = text.strip()
    if text in _NULLS:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def parse_tres(text: str) -> dict[str, int]:
    """``cpu=4,mem=2G,node=2,billing=4,gres/gpu=8`` -> ``{"cpu": 4, "node": 2, "gres/gpu": 8, ...}``;
    values that are not whole numbers (``mem``) are left out."""
    out: dict[str, int] = {}
    for item in text.split(","):
        key, _, value = item.strip().partition("=")
        if key and value.isdigit():
            out[key] = int(value)
    return out


def gpus_of(tres: dict[str, int]) -> int:
    """``gres/gpu`` (``gres/gpu:<type>`` counts too when the plain one is missing)."""
    if "gres/gpu" in tres:
        return tres["gres/gpu"]
    return sum(v for k, v in tres.items() if k.startswith("gres/gpu:"))


def parse_accounting(output: str) -> dict[str, list[Allocation]]:
    """``sacct -n -P -D -X -o JobID,Submit,Start,End,AllocTRES,State`` -> each job's allocations in
    start order (a waiting incarnation last). Step lines (``123.batch``) are skipped."""
    found: dict[str, list[Allocation]] = {}
    for line in output.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 6 or not parts[0] or "." in parts[0]:
            continue
        job_id, submit, start, end, tres_text, state = (p.strip() for p in parts[:6])
        tres = parse_tres(tres_text)
        found.setdefault(job_id, []).append(
            Allocation(
                job_id=job_id,
                submit=_epoch(submit),
                start=_epoch(start),
                end=_epoch(end),
                gpus=gpus_of(tres),
                cpus=tres.get("cpu", 0),
                nodes=tres.get("node", 0),
                state=state.split(" ", 1)[0],
            )
        )
    for allocations in found.values():
        allocations.sort(key=lambda a: (a.start is None, a.start or 0.0))
    return found


def query_allocations(job_ids: Iterable[str], timeout_s: float = 10.0) -> dict[str, list[Allocation]] | None:
    """Every incarnation of each job; None when sacct did not answer (no accounting, timeout)."""
    ids = [j for j in dict.fromkeys(str(j) for j in job_ids) if _ID_RE.match(j)]
    if not ids:
        return {}
    res = run_bounded(
        ["sacct", "-n", "-P", "-D", "-X", "-j", ",".join(ids), "-o", ACCOUNTING_FIELDS], timeout_s
    )
    if res.error is not None:
        return None
    found = parse_accounting(res.stdout)
    return {j: found.get(j, []) for j in ids}
