"""A run's budget records: each attempt's meter and the stop marker (``--budget``).

Node 0 of every attempt (with a budget or not: one a ``resume`` gives later counts every attempt)
keeps its meter in ``logs/attempt_<A>/budget.json`` (its allocation's start, the last time it looked,
and the GPUs or CPUs the job holds), rewritten every few seconds and as the node ends, so a killed
attempt still counts up to its last record. What
the run has spent is every attempt's span times what it held: the hours ``orchestrator cost`` bills
from the same span (a local job's ``node_<N>.held.json``). When the budget stops the run, node 0
writes ``budget_stop.json``: every node stops its ranks at the next step boundary, the job is not
requeued, and it ends ``BUDGET`` with the marker's reason.

Standard library only (the contract's rule).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from orchestrator.contract.jsonfiles import read_json, write_json_atomic
from orchestrator.contract.run_dir import (
    BUDGET_METER_FILE,
    BUDGET_STOP_FILE,
    SWEEP_REFUSED_FILE,
    attempt_dir,
    attempt_dirs,
)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def write_meter(run_dir: Path, attempt: int, start: float, end: float, per_hour: float) -> None:
    """This attempt's span so far and what it holds (GPUs or CPUs: billed hours per hour)."""
    record = {"start": start, "end": end, "per_hour": per_hour}
    folder = attempt_dir(run_dir, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / BUDGET_METER_FILE, record)


def meter_record(run_dir: Path, attempt: int) -> dict[str, Any]:
    """One attempt's meter record as written; {} where it has none (or it cannot be read)."""
    data = read_json(attempt_dir(run_dir, attempt) / BUDGET_METER_FILE)
    return data if isinstance(data, dict) else {}


def meter_hours(record: object) -> float:
    """The billed hours of one meter record; 0 for one that cannot be read (never a traceback)."""
    if not isinstance(record, dict):
        return 0.0
    start, end, per_hour = (_number(record.get(k)) for k in ("start", "end", "per_hour"))
    if start is None or end is None or per_hour is None or end < start or per_hour < 0:
        return 0.0
    return (end - start) / 3600.0 * per_hour


def spent_hours(run_dir: Path, but: int | None = None) -> float:
    """Billed hours of every attempt of the run that kept a meter, attempt ``but`` left out."""
    return sum(
        meter_hours(read_json(path / BUDGET_METER_FILE)) for a, path in attempt_dirs(run_dir) if a != but
    )


def write_budget_stop(
    run_dir: Path,
    attempt: int,
    reason: str,
    spent: float,
    budget: str,
    job_id: str = "",
    before_training: bool = False,
) -> None:
    """The stop marker. ``before_training``: no rank of ``attempt`` had begun a step, so every node
    ends its ranks at once instead of asking for a checkpoint (:func:`stops_at_once`)."""
    data = {
        "attempt": attempt,
        "job_id": job_id,
        "reason": reason,
        "spent": spent,
        "budget": budget,
        "time": time.time(),
        "before_training": before_training,
    }
    write_json_atomic(Path(run_dir) / BUDGET_STOP_FILE, data)


def stops_at_once(marker: dict[str, Any] | None) -> bool:
    """Whether a stop marker ends the ranks without a checkpoint: it came during start-up, when the
    newest complete checkpoint is already where the attempt stands."""
    return marker is not None and marker.get("before_training") is True


def budget_stop(run_dir: Path, attempt: int | None = None) -> dict[str, Any] | None:
    """The stop marker (of ``attempt``, when given): None where the budget stopped nothing."""
    data = read_json(Path(run_dir) / BUDGET_STOP_FILE)
    if data is None or (attempt is not None and data.get("attempt") != attempt):
        return None
    return data


def record_refusal(sweep_dir: Path, task: int, reason: str) -> None:
    """A sweep's budget refused ``task`` (never started): ``status SWEEP`` shows it with ``reason``."""
    data = refusals(sweep_dir)
    data[task] = reason
    write_json_atomic(Path(sweep_dir) / SWEEP_REFUSED_FILE, {str(k): v for k, v in sorted(data.items())})


def refusals(sweep_dir: Path) -> dict[int, str]:
    """``{task: reason}`` of the tasks a sweep's budget refused ({} for none, or an unreadable file)."""
    data = read_json(Path(sweep_dir) / SWEEP_REFUSED_FILE) or {}
    return {int(k): str(v) for k, v in data.items() if k.isdigit()}


def forget_refusal(sweep_dir: Path, task: int) -> None:
    """``task`` started after all (``resume SWEEP --failed`` with the budget left): no refusal now."""
    data = refusals(sweep_dir)
    if data.pop(task, None) is not None:
        write_json_atomic(Path(sweep_dir) / SWEEP_REFUSED_FILE, {str(k): v for k, v in sorted(data.items())})
