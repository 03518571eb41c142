"""``orchestrator cost``: the evidence a bill needs, gathered from one place each.

* the allocations: the scheduler's accounting, through :meth:`Scheduler.allocations` (Slurm: one
  accounting call for every job of the run or sweep);
* the steps and evaluations: ``metrics.jsonl`` (``train`` and ``eval`` lines: each step's end and
  length), placed in the allocation whose time holds them;
* per attempt: where it restarted from (``start.json``), the preflight's seconds
  (``preflight.json``), the hang watchdog's last seen progress (``hang.json``).

The splitting itself is pure (:mod:`orchestrator.runner.cost_model`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.contract.attempt_start import read_attempt_start
from orchestrator.contract.errors import UserError
from orchestrator.contract.run_dir import (
    HANG_REPORT_FILE,
    METRICS_FILE,
    PREFLIGHT_REPORT_FILE,
    attempt_dirs,
    hang_dir,
    preflight_dir,
    read_current_plan_json,
    read_json,
)
from orchestrator.runner.cost_model import (
    AttemptCost,
    AttemptEvidence,
    Cost,
    EvalRecord,
    StepRecord,
    account_run,
    bill,
    hours_until,
    place,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from orchestrator.registry.store import JobRecord, Registry
    from orchestrator.registry.sweeps import SweepTask
    from orchestrator.schedulers.query import Allocation

#: What every bill says about its own figures.
ESTIMATES = (
    "measured from records: allocations (scheduler accounting), startup, steps, evaluation, hang; "
    "estimated: checkpoint (the long gaps between steps, evaluation taken out) against the step "
    "boundary's overhead (the short ones), and shutdown (the last record to the allocation's end, the "
    "stop's save included)"
)
NO_STEPS = (
    "no step records (the script writes no metrics.jsonl 'train' lines): productive time, lost work "
    "and evaluation cannot be known; the allocation is unaccounted"
)


@dataclass
class CostReport:
    """A bill and what it covers: ``kind`` job, run or sweep."""

    kind: str
    target: str
    cost: Cost
    tasks: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    """A sweep's lowest training loss, its task, and the sweep's hours until it was recorded."""

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, "target": self.target, **self.cost.to_json()}
        if self.kind == "sweep":
            out["tasks"] = self.tasks
            out["best"] = self.best
        return out


@dataclass(frozen=True)
class AttemptFiles:
    attempt: int
    first_write: float
    start_step: int | None
    preflight_s: float | None
    hang_last_progress: float | None


def read_metrics(run_dir: Path) -> tuple[list[StepRecord], list[EvalRecord]]:
    """Every ``train`` and ``eval`` line of ``metrics.jsonl`` (a torn last line is skipped)."""
    steps: list[StepRecord] = []
    evals: list[EvalRecord] = []
    try:
        fh = open(Path(run_dir) / METRICS_FILE, encoding="utf-8", errors="replace")  # noqa: SIM115
    except OSError:
        return steps, evals
    with fh:
        for line in fh:
            if '"train"' not in line and '"eval"' not in line:
                continue
            try:
                rec = json.loads(line)
                event, step, at = rec.get("event"), int(rec["step"]), float(rec["time"])
                if event == "train":
                    loss = rec.get("loss")
                    steps.append(
                        StepRecord(
                            step,
                            at,
                            float(rec.get("step_time_s") or 0.0),
                            float(loss) if loss is not None else None,
                        )
                    )
                elif event == "eval":
                    evals.append(EvalRecord(step, at))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return steps, evals


def _first_write(path: Path) -> float:
    """The earliest modification time of a file directly in ``path``: when the attempt began writing
    (files appended to later, like the node logs, only push their own time later)."""
    times = []
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False):
                    times.append(entry.stat().st_mtime)
    except OSError:
        pass
    return min(times, default=0.0)


def _hang_progress(report: dict[str, Any]) -> float | None:
    beats = [
        float(h["time"])
        for h in (report.get("heartbeats") or {}).values()
        if isinstance(h, dict) and "time" in h
    ]
    if beats:
        return max(beats)
    if "time" in report and "stalled_s" in report:
        return float(report["time"]) - float(report.get("collection_s") or 0.0) - float(report["stalled_s"])
    return None


def read_attempts(run_dir: Path) -> list[AttemptFiles]:
    out = []
    for attempt, path in attempt_dirs(run_dir):
        start = read_attempt_start(run_dir, attempt)
        preflight = read_json(preflight_dir(run_dir, attempt) / PREFLIGHT_REPORT_FILE) or {}
        hang = read_json(hang_dir(run_dir, attempt) / HANG_REPORT_FILE)
        out.append(
            AttemptFiles(
                attempt,
                _first_write(path),
                int(start["step"]) if start and isinstance(start.get("step"), int) else None,
                float(preflight["seconds"]) if isinstance(preflight.get("seconds"), int | float) else None,
                _hang_progress(hang) if hang else None,
            )
        )
    return out


def gather(run_dir: Path, allocations: list[Allocation]) -> list[AttemptEvidence]:
    """Each allocation with the records its time holds (:func:`place`): its attempt directory (the
    one first written during it), its steps and evaluations."""
    steps, evals = read_metrics(run_dir)
    files = read_attempts(run_dir)
    now = time.time()
    windows = [
        (a.start, a.end if a.end is not None else now) if a.start is not None else (0.0, -1.0)
        for a in allocations
    ]
    held: list[dict[str, list[Any]]] = [{"steps": [], "evals": [], "files": []} for _ in allocations]
    for kind, records in (("steps", steps), ("evals", evals), ("files", files)):
        for record in records:
            at = record.first_write if isinstance(record, AttemptFiles) else record.end
            where = place(at, windows)
            if where is not None:
                held[where][kind].append(record)
    evidence = []
    for alloc, mine in zip(allocations, held, strict=True):
        attempt = mine["files"][0] if mine["files"] else None
        evidence.append(
            AttemptEvidence(
                alloc,
                attempt=attempt.attempt if attempt else None,
                steps=tuple(mine["steps"]),
                evals=tuple(mine["evals"]),
                start_step=attempt.start_step if attempt else None,
                preflight_s=attempt.preflight_s if attempt else None,
                hang_last_progress=attempt.hang_last_progress if attempt else None,
            )
        )
    return evidence


def _allocations(jobs: list[JobRecord], timeout_s: float) -> tuple[dict[str, list[Allocation]], list[str]]:
    from orchestrator.schedulers import get_scheduler

    found: dict[str, list[Allocation]] = {}
    notes: list[str] = []
    by_scheduler: dict[str, list[str]] = {}
    for job in jobs:
        by_scheduler.setdefault(job.scheduler, []).append(job.job_id)
    for name, ids in by_scheduler.items():
        answer = get_scheduler(name).allocations(ids, timeout_s)
        if answer is None:
            notes.append(
                f"no allocations from the {name} scheduler (it keeps no accounting, or it did not answer): "
                f"jobs {', '.join(ids)} are not billed"
            )
            continue
        found.update(answer)
    return found, notes


def run_attempts(
    registry: Registry, run_dir: Path, job_ids: list[str], timeout_s: float, now: float
) -> tuple[list[AttemptCost], list[str]]:
    """Every allocation of the run directory's jobs, billed, and the notes on what is not known."""
    jobs = registry.get_many(job_ids)
    found, notes = _allocations(jobs, timeout_s)
    allocations = [a for j in job_ids for a in found.get(j, [])]
    evidence = gather(run_dir, allocations)
    costs = account_run(evidence, now)
    if allocations and not any(e.steps for e in evidence):
        notes.append(NO_STEPS)
    for ev in evidence:
        if ev.attempt is not None and ev.start_step is None and ev is not evidence[0] and ev.steps:
            notes.append(
                f"attempt {ev.attempt} has no start record (no checkpoint hook): its restart point is its first step"
            )
    return costs, notes


def _price(run_dir: Path, unit: str) -> float | None:
    """The profile's ``price_per_gpu_hour`` / ``price_per_cpu_hour`` as the run's newest submission
    recorded it (the profile may have changed since); None: the bill stays in hours."""
    profile = read_current_plan_json(run_dir).get("profile")
    value = profile.get(f"price_per_{unit}_hour") if isinstance(profile, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def best_result(registry: Registry, tasks: Sequence[SweepTask]) -> dict[str, Any] | None:
    """The sweep's lowest training loss: which task, its value, and when it was first recorded."""
    best: dict[str, Any] | None = None
    for task in tasks:
        steps, _ = read_metrics(registry.run_of(task.job_id).run_dir)
        for s in steps:
            if s.loss is not None and (best is None or s.loss < best["loss"]):
                best = {
                    "task": task.task,
                    "job_id": task.job_id,
                    "loss": s.loss,
                    "step": s.step,
                    "time": s.end,
                }
    return best


def cost_report(
    registry: Registry, target: str, whole_run: bool = False, timeout_s: float = 10.0
) -> CostReport:
    """The bill of a sweep id, a run directory, or a job id (``whole_run``: every job of its run)."""
    now = time.time()
    sweep = registry.find_sweep(target)
    if sweep is not None:
        attempts: list[AttemptCost] = []
        notes: list[str] = []
        tasks = []
        for task in sweep.tasks:
            run = registry.run_of(task.job_id)
            costs, why = run_attempts(registry, run.run_dir, list(run.job_ids), timeout_s, now)
            part = bill(costs)
            tasks.append({"task": task.task, "job_id": task.job_id, "params": task.params, **part.to_json()})
            attempts.extend(costs)
            notes.extend(f"task {task.task}: {n}" for n in why)
        cost = bill(attempts)
        cost.notes = [*notes, ESTIMATES]
        best = best_result(registry, sweep.tasks)
        if best is not None:
            best["hours_to_reach"] = round(hours_until(attempts, best.pop("time")), 6)
        first = registry.get_many(sweep.job_ids[:1])
        cost.price_per_hour = _price(first[0].run_dir, cost.unit) if first else None
        return CostReport("sweep", sweep.sweep_id, cost, tasks, best)
    path = Path(target).expanduser()
    if path.is_dir():
        record = registry.run_at(path)
        if record is None:
            raise UserError(f"{target}: no job of the registry trained in this directory")
        kind, job_ids, keep = "run", list(record.job_ids), None
    else:
        job = registry.get(target)  # an unknown id: a user error
        record = registry.run_of(job.job_id)
        kind = "run" if whole_run else "job"
        job_ids, keep = list(record.job_ids), (None if whole_run else job.job_id)
    costs, notes = run_attempts(registry, record.run_dir, job_ids, timeout_s, now)
    if keep is not None:
        costs = [c for c in costs if c.job_id == keep]
    cost = bill(costs)
    cost.notes = [*notes, ESTIMATES]
    cost.price_per_hour = _price(record.run_dir, cost.unit)
    return CostReport(kind, target, cost)
