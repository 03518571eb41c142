"""``orchestrator cost``: the evidence a bill needs, gathered from one place each.

* the allocations: the scheduler's accounting, through :meth:`Scheduler.allocations` (Slurm: one
  accounting call for every job of the run or sweep);
* the steps and evaluations: ``metrics.jsonl`` (``train`` and ``eval`` lines: each step's end and
  length), placed in the allocation whose time holds them;
* per attempt: where it restarted from (``start.json``), the preflight's seconds
  (``preflight.json``), the hang watchdog's last seen progress (``hang.json``);
* the restarts inside an allocation (``restarts.jsonl``): where one allocation's attempts meet.

Every record is read defensively, whatever JSON it holds (a wrong type, a list, null, a string, a
missing key, NaN): what cannot be read is left out and the bill's notes say which file and field,
never a traceback. The splitting itself is pure (:mod:`orchestrator.runner.cost_model`).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.contract import start_estimates
from orchestrator.contract.errors import UserError
from orchestrator.contract.run_dir import (
    ATTEMPT_START_FILE,
    HANG_REPORT_FILE,
    JOB_FILE,
    METRICS_FILE,
    PREFLIGHT_REPORT_FILE,
    RESTARTS_FILE,
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


@dataclass(frozen=True)
class Restart:
    """A restart inside an allocation (``restarts.jsonl``): the attempt it started, and when."""

    job_id: str
    attempt: int
    time: float


def finite(value: object) -> float | None:
    """A finite number of a JSON record (not a bool, not NaN or infinite), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def read_metrics(
    run_dir: Path, problems: list[str] | None = None
) -> tuple[list[StepRecord], list[EvalRecord]]:
    """Every ``train`` and ``eval`` line of ``metrics.jsonl``. A torn last line (being written) is
    skipped; other lines that cannot be read (a wrong type, NaN, not an object) are counted in
    ``problems``."""
    steps: list[StepRecord] = []
    evals: list[EvalRecord] = []
    bad = 0
    try:
        fh = open(Path(run_dir) / METRICS_FILE, encoding="utf-8", errors="replace")  # noqa: SIM115
    except OSError:
        return steps, evals
    with fh:
        for line in fh:
            if '"train"' not in line and '"eval"' not in line:
                continue
            record = _metrics_line(line)
            if isinstance(record, StepRecord):
                steps.append(record)
            elif isinstance(record, EvalRecord):
                evals.append(record)
            elif line.endswith("\n"):  # not the torn last line
                bad += 1
    if bad and problems is not None:
        problems.append(
            f"{METRICS_FILE}: {bad} train/eval line(s) without a whole step and a finite time: ignored"
        )
    return steps, evals


def _metrics_line(line: str) -> StepRecord | EvalRecord | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    event, step, at = rec.get("event"), whole(rec.get("step")), finite(rec.get("time"))
    if step is None or at is None:
        return None
    if event == "train":
        seconds = finite(rec.get("step_time_s")) if rec.get("step_time_s") is not None else 0.0
        if seconds is None or seconds < 0:
            return None
        return StepRecord(step, at, seconds, finite(rec.get("loss")))
    if event == "eval":
        return EvalRecord(step, at)
    return None


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


def hang_progress(report: object) -> tuple[float | None, list[str]]:
    """The last progress the hang watchdog saw (its newest heartbeat; else its time less the stall),
    and what of the report could not be read (a report of any JSON shape: never an exception)."""
    problems: list[str] = []
    if not isinstance(report, dict):
        return None, [f"not a JSON object ({_kind(report)})"]
    beats: list[float] = []
    heartbeats = report.get("heartbeats")
    if isinstance(heartbeats, dict):
        for rank, beat in heartbeats.items():
            at = finite(beat.get("time")) if isinstance(beat, dict) else None
            if at is None:
                what = _kind(beat.get("time")) if isinstance(beat, dict) else _kind(beat)
                problems.append(f"heartbeats[{rank!s:.20}]: no time ({what})")
            else:
                beats.append(at)
    elif heartbeats is not None or "heartbeats" in report:
        problems.append(f"heartbeats: not an object ({_kind(heartbeats)})")
    if beats:
        return max(beats), problems
    at, stalled = finite(report.get("time")), finite(report.get("stalled_s"))
    collection = finite(report.get("collection_s")) or 0.0
    if at is not None and stalled is not None:
        return at - collection - stalled, problems
    if "time" in report or "stalled_s" in report:
        problems.append(
            f"time/stalled_s: not numbers ({_kind(report.get('time'))}, {_kind(report.get('stalled_s'))})"
        )
    return None, problems


def _read_record(path: Path, problems: list[str], label: str) -> dict[str, Any] | None:
    """A JSON object record; one that is there but is no JSON object is said in ``problems``."""
    data = read_json(path)
    if data is None and path.exists():
        try:
            shape = _kind(json.loads(path.read_text(encoding="utf-8", errors="replace")))
        except (OSError, ValueError):
            shape = "not JSON"
        problems.append(f"{label}: not a JSON object ({shape}): ignored")
    return data


def read_attempts(run_dir: Path, problems: list[str] | None = None) -> list[AttemptFiles]:
    """Each attempt folder's records; what could not be read is appended to ``problems``."""
    said = problems if problems is not None else []
    out = []
    for attempt, path in attempt_dirs(run_dir):
        at = f"attempt {attempt} "
        start = _read_record(path / ATTEMPT_START_FILE, said, at + ATTEMPT_START_FILE) or {}
        start_step = whole(start.get("step"))
        if start and start_step is None:
            said.append(f"{at}{ATTEMPT_START_FILE}: step is {_kind(start.get('step'))}: ignored")
        preflight_file = preflight_dir(run_dir, attempt) / PREFLIGHT_REPORT_FILE
        preflight = _read_record(preflight_file, said, at + PREFLIGHT_REPORT_FILE) or {}
        preflight_s = finite(preflight.get("seconds"))
        if "seconds" in preflight and (preflight_s is None or preflight_s < 0):
            said.append(f"{at}{PREFLIGHT_REPORT_FILE}: seconds is {_kind(preflight['seconds'])}: ignored")
            preflight_s = None
        hang = _read_record(hang_dir(run_dir, attempt) / HANG_REPORT_FILE, said, at + HANG_REPORT_FILE)
        progress, why = hang_progress(hang) if hang is not None else (None, [])
        said.extend(f"{at}{HANG_REPORT_FILE}: {w}: ignored" for w in why[:5])
        if len(why) > 5:
            said.append(f"{at}{HANG_REPORT_FILE}: {len(why) - 5} more unreadable fields")
        out.append(AttemptFiles(attempt, _first_write(path), start_step, preflight_s, progress))
    return out


def read_restart_records(run_dir: Path, problems: list[str] | None = None) -> list[Restart]:
    """``restarts.jsonl``'s lines that name a job, the attempt started and a finite time (a torn last
    line, being written, is skipped; any other is counted in ``problems``)."""
    out, bad = [], 0
    try:
        text = (Path(run_dir) / RESTARTS_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        rec = record if isinstance(record, dict) else {}
        job_id, attempt, at = rec.get("job_id"), whole(rec.get("attempt")), finite(rec.get("time"))
        if isinstance(job_id, str) and attempt is not None and at is not None:
            out.append(Restart(job_id, attempt, at))
        elif line.endswith("\n"):
            bad += 1
    if bad and problems is not None:
        problems.append(f"{RESTARTS_FILE}: {bad} record(s) without a job, an attempt or a time: ignored")
    return out


def _segments(
    alloc: Allocation, files: list[AttemptFiles], restarts: list[Restart]
) -> list[tuple[int | None, float]]:
    """The attempts of one allocation in time order, each with when its part began: the first at the
    allocation's start, each later one where its restart was recorded (else where it first wrote)."""
    assert alloc.start is not None
    begins: dict[int | None, float] = {}
    for r in sorted(restarts, key=lambda r: r.time):
        begins.setdefault(r.attempt, r.time)
    for f in sorted(files, key=lambda f: f.first_write):
        begins.setdefault(f.attempt, f.first_write)
    if not begins:
        return [(None, alloc.start)]
    ordered = sorted(begins.items(), key=lambda kv: kv[1])
    restarted = {r.attempt for r in restarts}
    first = ordered[0][0]
    if first in restarted and len(ordered) == len(restarted):
        ordered.insert(0, (None, alloc.start))  # the attempt before the first restart wrote nothing
    return [(a, alloc.start if i == 0 else t) for i, (a, t) in enumerate(ordered)]


def gather(
    run_dir: Path, allocations: list[Allocation], problems: list[str] | None = None
) -> list[AttemptEvidence]:
    """Each allocation with the records its time holds (:func:`place`): its attempt directories (those
    first written during it: more than one where the allocation restarted training, each on its own
    part of the allocation), its steps and evaluations. What could not be read: ``problems``."""
    steps, evals = read_metrics(run_dir, problems)
    files = read_attempts(run_dir, problems)
    restarts = read_restart_records(run_dir, problems)
    by_attempt = {f.attempt: f for f in files}
    now = time.time()
    windows = [
        (a.start, a.end if a.end is not None else now) if a.start is not None else (0.0, -1.0)
        for a in allocations
    ]
    held: list[dict[str, list[Any]]] = [
        {"steps": [], "evals": [], "files": [], "restarts": []} for _ in allocations
    ]
    for kind, records in (("steps", steps), ("evals", evals), ("files", files), ("restarts", restarts)):
        for record in records:
            at = (
                record.first_write
                if isinstance(record, AttemptFiles)
                else record.time
                if isinstance(record, Restart)
                else record.end
            )
            where = place(at, windows)
            if where is not None and not (
                isinstance(record, Restart) and record.job_id != allocations[where].job_id
            ):
                held[where][kind].append(record)
    evidence = []
    for alloc, mine in zip(allocations, held, strict=True):
        if alloc.start is None:
            evidence.append(AttemptEvidence(alloc))
            continue
        segments = _segments(alloc, mine["files"], mine["restarts"])
        for i, (number, begin) in enumerate(segments):
            until = segments[i + 1][1] if i + 1 < len(segments) else None
            attempt = by_attempt.get(number) if number is not None else None

            def inside(at: float, lo: float | None = begin if i else None, hi: float | None = until) -> bool:
                return (lo is None or at >= lo) and (hi is None or at < hi)

            evidence.append(
                AttemptEvidence(
                    alloc,
                    attempt=number,
                    steps=tuple(s for s in mine["steps"] if inside(s.end)),
                    evals=tuple(e for e in mine["evals"] if inside(e.end)),
                    start_step=attempt.start_step if attempt else None,
                    preflight_s=attempt.preflight_s if attempt else None,
                    hang_last_progress=attempt.hang_last_progress if attempt else None,
                    window=None if len(segments) == 1 else (begin, until),
                    after_restart=i > 0,
                    restarted=until is not None,
                )
            )
    return evidence


def _allocations(jobs: list[JobRecord], timeout_s: float) -> tuple[dict[str, list[Allocation]], list[str]]:
    from orchestrator.schedulers import get_scheduler

    found: dict[str, list[Allocation]] = {}
    notes: list[str] = []
    by_scheduler: dict[str, list[JobRecord]] = {}
    for job in jobs:
        by_scheduler.setdefault(job.scheduler, []).append(job)
    for name, mine in by_scheduler.items():
        answer = get_scheduler(name).allocations_of(mine, timeout_s)
        ids = ", ".join(j.job_id for j in mine)
        if answer is None:
            notes.append(
                f"no allocations from the {name} scheduler (it keeps no accounting, or it did not answer): "
                f"jobs {ids} are not billed"
            )
            continue
        found.update(answer)
        empty = [j.job_id for j in mine if not answer.get(j.job_id)]
        if empty:
            notes.append(
                f"no allocation recorded for job(s) {', '.join(empty)} by the {name} scheduler "
                "(not started, or it left no record): not billed"
            )
    return found, notes


def run_attempts(
    registry: Registry, run_dir: Path, job_ids: list[str], timeout_s: float, now: float
) -> tuple[list[AttemptCost], list[str]]:
    """Every allocation of the run directory's jobs, billed, and the notes on what is not known."""
    jobs = registry.get_many(job_ids)
    found, notes = _allocations(jobs, timeout_s)
    allocations = [a for j in job_ids for a in found.get(j, [])]
    problems: list[str] = []
    evidence = gather(run_dir, allocations, problems)
    costs = account_run(evidence, now)
    notes.extend(f"unreadable record: {p}" for p in problems)
    if allocations and not any(e.steps for e in evidence):
        notes.append(NO_STEPS)
    for ev in evidence:
        if ev.attempt is not None and ev.start_step is None and ev is not evidence[0] and ev.steps:
            notes.append(
                f"attempt {ev.attempt} has no start record (no checkpoint hook): its restart point is its first step"
            )
    return costs, notes


def _price(run_dir: Path, unit: str, notes: list[str] | None = None) -> float | None:
    """The profile's ``price_per_gpu_hour`` / ``price_per_cpu_hour`` as the run's newest submission
    recorded it (the profile may have changed since); None: the bill stays in hours. A recorded price
    that is no number is said in ``notes``."""
    profile = read_current_plan_json(run_dir).get("profile")
    key = f"price_per_{unit}_hour"
    raw = profile.get(key) if isinstance(profile, dict) else None
    value = finite(raw)
    if value is not None and value >= 0:
        return value
    if raw is not None and notes is not None:
        notes.append(f"unreadable record: {JOB_FILE}: {key} is {_kind(raw)} {str(raw)[:20]!r}: no money")
    return None


def _unit_of(run_dir: Path, cost: Cost) -> str:
    """The bill's unit: the allocations' own, else (nothing billed yet) the plan's: CPU-hours where
    the profile has no GPUs."""
    if any(a.start is not None for a in cost.attempts):
        return cost.unit
    profile = read_current_plan_json(run_dir).get("profile")
    gpus = profile.get("gpus_per_node") if isinstance(profile, dict) else None
    return "cpu" if gpus == 0 else cost.unit


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
        if first:
            cost.unit = _unit_of(first[0].run_dir, cost)
        cost.price_per_hour = _price(first[0].run_dir, cost.unit, cost.notes) if first else None
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
    cost.notes = [*notes, *start_estimates.notes(record.run_dir, costs), ESTIMATES]
    cost.unit = _unit_of(record.run_dir, cost)
    cost.price_per_hour = _price(record.run_dir, cost.unit, cost.notes)
    return CostReport(kind, target, cost)
