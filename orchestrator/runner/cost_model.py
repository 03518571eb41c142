"""Where the allocated hours went: the pure accounting behind ``orchestrator cost``.

No file is read here (:mod:`orchestrator.runner.cost` gathers the evidence); everything is a function of
the records passed in, so every category can be tested with hand-built records.

Each allocation's seconds are split into categories that add up to its length *by construction*:
every measured category is taken from the allocation's timeline, and what no record explains is
``unaccounted`` (never silently dropped). The timeline of one allocation::

    start ─ preflight ─ startup ─ step, gap, step, ... step ─ (hang) ─ shutdown ─ end

An allocation the batch step restarted training in (``restarts.jsonl``) holds several attempts, each
on its own part of the timeline (split where the restart was recorded)::

    start ─ startup ─ steps of A ─ (hang) ─ restart │ restart ─ steps of B ─ shutdown ─ end

* ``preflight``: the checks' own seconds (``preflight.json``), within the time before the first step;
* ``startup``: the rest of the time from the allocation's start to the first step's start;
* ``productive``: steps no later attempt trained again; ``lost_work``: steps a later attempt trained
  again (it restarted from an earlier step), plus the unfinished step a hang or stop interrupted;
* ``evaluation``: from the step an evaluation follows to its record;
* ``checkpoint``: a gap between steps (evaluation taken out) over :data:`CHECKPOINT_GAP_FACTOR`
  times the attempt's median gap: train/ saves between steps (an estimate: the steps that saved are
  not recorded, their long gaps are);
* ``step_overhead``: the other gaps between steps, the step boundary's own work (heartbeats, the
  metrics line, a tracker's log; the ranks' stop agreement where it is a collective of its own);
* ``hang``: from the last progress the watchdog saw to the allocation's end (an attempt's end, where
  the allocation restarted training);
* ``restart``: from a failed attempt's last step (or the hang's end) to the next attempt's first step
  in the same allocation: the fault to training again;
* ``shutdown``: from the last step (or evaluation) to the end: the save a stop signal or the end of
  training writes, and the processes' exit.

``queue_wait`` (submission to the first start) and ``requeue_gap`` (an allocation's end to the next
one's start) cost no allocation: reported, not billed. Hours are the allocation's seconds times its
GPUs (CPUs where it has none); goodput is productive hours over allocated hours.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.schedulers.query import Allocation

#: The billed categories, in the order of an allocation's timeline; they sum to its length.
CATEGORIES = (
    "preflight",
    "startup",
    "productive",
    "lost_work",
    "evaluation",
    "checkpoint",
    "step_overhead",
    "hang",
    "restart",
    "shutdown",
    "unaccounted",
)
#: How each category reads, in the order a bill lists them (productive first). Sent with every bill
#: (``labels``), so the command line and the dashboard read them from one place.
LABELS = {
    "productive": "productive (steps kept)",
    "lost_work": "lost work (trained again)",
    "startup": "start-up (to the first step)",
    "preflight": "preflight",
    "evaluation": "evaluation",
    "checkpoint": "checkpoint stall",
    "step_overhead": "between steps (the boundary)",
    "hang": "hang (to the watchdog's end)",
    "restart": "restart (the fault to training again)",
    "shutdown": "shutdown (stop's save, exit)",
    "unaccounted": "unaccounted",
}
#: Not billed (no allocation held): reported beside the bill.
UNBILLED = ("queue_wait", "requeue_gap")
#: A gap between steps this many times the median gap (and 50 ms over it) is a checkpoint's stall.
CHECKPOINT_GAP_FACTOR = 5.0
#: Records within this many seconds outside an allocation still belong to it: accounting times are
#: whole seconds, the ranks' clocks are the nodes'.
SLACK_S = 2.0


@dataclass(frozen=True)
class StepRecord:
    """One finished training step: its number, the wall clock at its end and its length."""

    step: int
    end: float
    seconds: float
    loss: float | None = None

    @property
    def start(self) -> float:
        return self.end - self.seconds


@dataclass(frozen=True)
class EvalRecord:
    """An evaluation: the step it followed and the wall clock at its end."""

    step: int
    end: float


@dataclass(frozen=True)
class AttemptEvidence:
    """What the run directory says about the attempt that ran in ``allocation``."""

    allocation: Allocation
    attempt: int | None = None
    steps: tuple[StepRecord, ...] = ()
    evals: tuple[EvalRecord, ...] = ()
    start_step: int | None = None
    """The step it restored (``start.json``; 0: from scratch); None: no record (no hook)."""
    preflight_s: float | None = None
    hang_last_progress: float | None = None
    """The newest heartbeat the hang watchdog saw when it fired (``hang.json``); None: no hang."""
    window: tuple[float, float | None] | None = None
    """The part of the allocation this attempt ran in (start, end; end None: until the allocation's
    end) where the allocation held several attempts; None: the whole allocation."""
    after_restart: bool = False
    """It began after a restart inside the allocation: its time to the first step is ``restart``."""
    restarted: bool = False
    """A restart inside the allocation followed it: its time after the last step is ``restart``."""

    @property
    def begins(self) -> float | None:
        """When this attempt's part of the allocation began (None: the allocation never started)."""
        if self.allocation.start is None:
            return None
        return self.window[0] if self.window is not None else self.allocation.start

    def ends(self, now: float) -> float:
        """When this attempt's part of the allocation ended (``now`` while it runs)."""
        end = self.allocation.end if self.allocation.end is not None else now
        if self.window is not None and self.window[1] is not None:
            end = min(end, self.window[1])
        return end

    @property
    def restart_point(self) -> int | None:
        """The step this attempt trained on from (its first step is one more); None when unknown."""
        if self.start_step is not None:
            return self.start_step
        if self.steps:
            return self.steps[0].step - 1
        return None


@dataclass
class AttemptCost:
    """One allocation's bill: its seconds by category, and the resources they are multiplied by."""

    job_id: str
    attempt: int | None
    start: float | None
    end: float | None
    resources: int
    unit: str
    seconds: dict[str, float]
    steps: int = 0
    lost_steps: int = 0
    notes: list[str] = field(default_factory=list)
    waited: dict[str, float] = field(default_factory=dict)
    """Unbilled seconds before this allocation (:data:`UNBILLED`)."""

    @property
    def allocated_s(self) -> float:
        return sum(self.seconds.values())

    def hours(self) -> dict[str, float]:
        return {k: v * self.resources / 3600.0 for k, v in self.seconds.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "start": self.start,
            "end": self.end,
            "resources": self.resources,
            "unit": self.unit,
            "allocated_s": round(self.allocated_s, 3),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "steps": self.steps,
            "lost_steps": self.lost_steps,
            "waited_s": {k: round(v, 3) for k, v in self.waited.items()},
            "notes": self.notes,
        }


@dataclass
class Cost:
    """A bill over allocations (a job, a run, a sweep), in resource-hours."""

    unit: str
    allocated_hours: float
    hours: dict[str, float]
    unbilled_s: dict[str, float]
    attempts: list[AttemptCost] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    price_per_hour: float | None = None

    @property
    def goodput(self) -> float | None:
        return self.hours["productive"] / self.allocated_hours if self.allocated_hours > 0 else None

    def to_json(self) -> dict[str, Any]:
        price = self.price_per_hour
        return {
            "unit": self.unit,
            "allocated_hours": round(self.allocated_hours, 6),
            "hours": {k: round(v, 6) for k, v in self.hours.items()},
            "goodput": None if self.goodput is None else round(self.goodput, 4),
            "unbilled_s": {k: round(v, 3) for k, v in self.unbilled_s.items()},
            "price_per_hour": price,
            "money": None
            if price is None
            else {
                "allocated": round(self.allocated_hours * price, 2),
                **{k: round(v * price, 2) for k, v in self.hours.items()},
            },
            "attempts": [a.to_json() for a in self.attempts],
            "notes": self.notes,
            "labels": dict(LABELS),
        }


def place(moment: float, windows: Sequence[tuple[float, float]]) -> int | None:
    """The index of the window that holds ``moment``: the one it falls in, else the nearest within
    :data:`SLACK_S` (accounting's whole seconds), else None. One window per record, never two: a
    successor job starts in the second its predecessor ends, and a step of one is not the other's."""
    best, distance = None, SLACK_S
    for i, (lo, hi) in enumerate(windows):
        if lo <= moment <= hi:
            return i
        gap = lo - moment if moment < lo else moment - hi
        if gap <= distance:
            best, distance = i, gap
    return best


def _unit(allocation: Allocation) -> tuple[int, str]:
    return (allocation.gpus, "gpu") if allocation.gpus else (max(allocation.cpus, 1), "cpu")


def lost_steps(evidence: Sequence[AttemptEvidence]) -> list[set[int]]:
    """For each attempt (in time order), its steps that a later attempt trained again: those after
    the earliest step any later attempt restarted from."""
    out: list[set[int]] = []
    for i, ev in enumerate(evidence):
        later = [p for e in evidence[i + 1 :] if (p := e.restart_point) is not None]
        bar = min(later) if later else None
        out.append(set() if bar is None else {s.step for s in ev.steps if s.step > bar})
    return out


def account_attempt(ev: AttemptEvidence, lost: set[int], now: float) -> AttemptCost:
    """One allocation's seconds by category; they sum to its length (``now`` for a running one)."""
    alloc = ev.allocation
    resources, unit = _unit(alloc)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    begins = ev.begins
    own_end = ev.window[1] if ev.window is not None and ev.window[1] is not None else alloc.end
    cost = AttemptCost(alloc.job_id, ev.attempt, begins, own_end, resources, unit, seconds)
    if begins is None:
        return cost
    start, end = begins, max(begins, ev.ends(now))
    length = max(0.0, end - start)
    tail = "restart" if ev.restarted else "shutdown"
    steps = sorted((s for s in ev.steps if start - SLACK_S <= s.end <= end + SLACK_S), key=lambda s: s.end)
    cost.steps = len(steps)
    if not steps:
        if ev.hang_last_progress is not None:
            seconds["hang"] = min(length, max(0.0, end - ev.hang_last_progress))
        seconds["preflight"] = min(length - seconds["hang"], ev.preflight_s or 0.0)
        if ev.after_restart or ev.restarted:  # a restart inside the allocation that never trained
            seconds["restart"] = length - seconds["hang"] - seconds["preflight"]
        seconds["unaccounted"] = length - seconds["hang"] - seconds["preflight"] - seconds["restart"]
        cost.notes.append("no step recorded: its time before any step cannot be split further")
        return cost
    before = max(0.0, min(steps[0].start, end) - start)
    seconds["preflight"] = min(before, ev.preflight_s or 0.0)
    seconds["restart" if ev.after_restart else "startup"] = before - seconds["preflight"]
    for s in steps:  # only the part inside the allocation: its times are whole seconds
        seconds["lost_work" if s.step in lost else "productive"] += max(
            0.0, min(s.end, end) - max(s.start, start)
        )
    cost.lost_steps = sum(1 for s in steps if s.step in lost)
    by_step = {s.step: s for s in steps}
    last_end = steps[-1].end
    inside: dict[int, float] = {}  # evaluations between two steps, by the step they follow
    for e in ev.evals:
        after = by_step.get(e.step)
        if after is None or not after.end <= e.end <= end + SLACK_S:
            continue
        took = max(0.0, min(e.end, end) - after.end)
        seconds["evaluation"] += took
        if e.step == steps[-1].step:
            last_end = max(last_end, e.end)
        else:
            inside[e.step] = inside.get(e.step, 0.0) + took
    gaps = [
        max(0.0, min(b.start, end) - max(min(a.end, end), start) - inside.get(a.step, 0.0))
        for a, b in zip(steps, steps[1:], strict=False)
    ]
    typical = statistics.median(gaps) if gaps else 0.0
    for gap in gaps:
        stall = gap > CHECKPOINT_GAP_FACTOR * typical and gap > typical + 0.05
        seconds["checkpoint" if stall else "step_overhead"] += gap
    last_end = max(min(last_end, end), start)
    if ev.hang_last_progress is not None:
        progress = min(max(last_end, ev.hang_last_progress), end)
        seconds["lost_work"] += progress - last_end  # the step the hang interrupted
        seconds["hang"] = end - progress
    else:
        seconds[tail] += end - last_end
    seconds["unaccounted"] = length - sum(v for k, v in seconds.items() if k != "unaccounted")
    return cost


def account_run(evidence: Sequence[AttemptEvidence], now: float) -> list[AttemptCost]:
    """Every allocation of one run directory, in time order, with the time it waited before it
    (the first: since its submission; the others: since the previous allocation ended)."""
    ordered = sorted(evidence, key=lambda e: (e.begins is None, e.begins or 0.0))
    costs = [account_attempt(ev, lost, now) for ev, lost in zip(ordered, lost_steps(ordered), strict=True)]
    previous_end: float | None = None
    for i, (ev, cost) in enumerate(zip(ordered, costs, strict=True)):
        alloc = ev.allocation
        began = alloc.start if alloc.start is not None else now
        if ev.after_restart:
            pass  # the same allocation: nothing waited, the restart is billed
        elif i == 0 and alloc.submit is not None:
            cost.waited["queue_wait"] = max(0.0, began - alloc.submit)
        elif previous_end is not None:
            cost.waited["requeue_gap"] = max(0.0, began - previous_end)
        previous_end = alloc.end if alloc.end is not None else now
    return costs


def bill(attempts: Sequence[AttemptCost], price_per_hour: float | None = None) -> Cost:
    """The bill over ``attempts`` (of one run, or of many: a sweep is the sum of its tasks)."""
    hours = dict.fromkeys(CATEGORIES, 0.0)
    unbilled = dict.fromkeys(UNBILLED, 0.0)
    for a in attempts:
        for k, v in a.hours().items():
            hours[k] += v
        for k, v in a.waited.items():
            unbilled[k] += v
    units = {a.unit for a in attempts if a.start is not None}
    unit = units.pop() if len(units) == 1 else ("mixed" if units else "gpu")
    return Cost(unit, sum(hours.values()), hours, unbilled, list(attempts), price_per_hour=price_per_hour)


def hours_until(attempts: Sequence[AttemptCost], moment: float) -> float:
    """Resource-hours the allocations had spent by ``moment``: a sweep's cost of reaching its best
    result is what every task had been allocated until that result was recorded."""
    total = 0.0
    for a in attempts:
        if a.start is not None and a.start < moment:
            total += (min(a.start + a.allocated_s, moment) - a.start) * a.resources / 3600.0
    return total
