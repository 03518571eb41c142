"""A run's spending cap: ``--budget 200gpu-h``, ``--budget 0.5cpu-h``, ``--budget 500usd``.

A budget covers every attempt of a run (requeues, restarts, resumes) and is counted in the units
``orchestrator cost`` bills: GPU-hours on a profile with GPUs, CPU-hours on one without, or money at
the profile's ``price_per_gpu_hour`` / ``price_per_cpu_hour`` (any currency: a three-letter code).
The job enforces it while it runs (:mod:`orchestrator.node.budget_watch`): when what is spent plus
what the next checkpoint interval will cost would pass it (:func:`decide`), the job checkpoints
and stops in state ``BUDGET``, and ``resume --budget MORE`` continues it.

Pure and standard library only: parsed on every planning command, decided on node 0 twice a second.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol

from orchestrator.contract.errors import UserError


class ClusterProfile(Protocol):
    """What a budget reads of a profile (``config/profile``'s record; a protocol: the schema
    imports this module to check a profile's ``budget`` key)."""

    @property
    def gpus_per_node(self) -> int: ...
    @property
    def price_per_gpu_hour(self) -> float | None: ...
    @property
    def price_per_cpu_hour(self) -> float | None: ...


#: The units of hours a budget can be given in (``cost``'s bill: GPU-hours, CPU-hours).
GPU_HOURS, CPU_HOURS = "gpu-h", "cpu-h"
HOUR_UNITS = (GPU_HOURS, CPU_HOURS)
_BUDGET = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?\s*([A-Za-z][A-Za-z-]*)$")
_CURRENCY = re.compile(r"^[a-z]{3}$")
EXPECTED = "an amount and a unit such as 200gpu-h, 0.5cpu-h or 500usd"


@dataclass(frozen=True)
class Budget:
    """A positive amount in ``gpu-h``, ``cpu-h`` or a currency (three lowercase letters)."""

    amount: float
    unit: str

    @property
    def is_money(self) -> bool:
        return self.unit not in HOUR_UNITS

    def __str__(self) -> str:
        return f"{self.amount:g}{self.unit}"

    def show(self, value: float) -> str:
        """``value`` in this budget's unit, as ``status`` prints it (``0.0031 cpu-h``, ``12.50 usd``)."""
        return f"{value:.2f} {self.unit}" if self.is_money else f"{value:.4g} {self.unit}"


def parse_budget(text: str, flag: str = "--budget") -> Budget:
    """``200gpu-h`` -> Budget(200.0, "gpu-h"); anything else (``-1``, ``abc``, ``0cpu-h``, ``5gpu``)
    is a one-line UserError naming ``flag``."""
    m = _BUDGET.match(text.strip())
    if not m:
        raise UserError(f"{flag} {text!r}: expected {EXPECTED}")
    amount = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else ""))
    unit = m.group(3).lower()
    if unit not in HOUR_UNITS and (not _CURRENCY.match(unit) or unit in ("gpu", "cpu")):
        raise UserError(
            f"{flag} {text!r}: unknown unit {m.group(3)!r}; expected gpu-h, cpu-h or a currency (usd, eur...)"
        )
    if not math.isfinite(amount) or amount <= 0:
        raise UserError(f"{flag} {text!r}: expected an amount above 0")
    return Budget(amount, unit)


def budget_text(value: object, flag: str = "--budget") -> str | None:
    """The request's check: None, or the budget's text normalised (``"200gpu-h"``); a Budget passes."""
    if value is None:
        return None
    if isinstance(value, Budget):
        return str(value)
    if not isinstance(value, str):
        raise UserError(f"{flag}: expected {EXPECTED} (a string), got {type(value).__name__}")
    return str(parse_budget(value, flag))


def hour_unit(profile: ClusterProfile) -> str:
    """What ``cost`` bills on this profile: GPU-hours where it has GPUs, else CPU-hours."""
    return CPU_HOURS if profile.gpus_per_node == 0 else GPU_HOURS


def price_per_hour(profile: ClusterProfile) -> float | None:
    """The profile's price of one billed hour (:func:`hour_unit`), None where it has none."""
    return profile.price_per_cpu_hour if profile.gpus_per_node == 0 else profile.price_per_gpu_hour


def check_budget(budget: Budget, profile_name: str, profile: ClusterProfile, flag: str = "--budget") -> None:
    """Refuse a budget this profile cannot bill: hours of the other kind, money without a price."""
    unit = hour_unit(profile)
    if budget.is_money:
        key = "price_per_cpu_hour" if unit == CPU_HOURS else "price_per_gpu_hour"
        if price_per_hour(profile) is None:
            raise UserError(
                f"{flag} {budget}: profile '{profile_name}' has no {key} to turn {unit} into money; "
                f"set {key} in the profile or give the budget in {unit}"
            )
        return
    if budget.unit != unit:
        kind = "has GPUs" if unit == GPU_HOURS else "has no GPUs"
        raise UserError(
            f"{flag} {budget}: profile '{profile_name}' {kind} and is billed in {unit}; "
            f"give the budget in {unit} (e.g. {budget.amount:g}{unit})"
        )


def in_budget_units(budget: Budget, hours: float, profile: ClusterProfile) -> float:
    """Billed hours (:func:`hour_unit`) in the budget's unit: the same hours, or money at the price."""
    if not budget.is_money:
        return hours
    return hours * (price_per_hour(profile) or 0.0)


@dataclass(frozen=True)
class Verdict:
    """:func:`decide`'s answer: stop now or not, and the sentence ``status`` shows."""

    stop: bool
    reason: str


#: How a budget's stop ends an attempt: the ranks save first, or (during start-up, nothing trained
#: since the newest complete checkpoint) they are ended at once (orchestrator.node.budget_watch).
STOPPED_AT_A_CHECKPOINT = "stopped at a checkpoint"
STOPPED_IN_START_UP = "stopped during start-up, before it trained"


def decide(budget: Budget, spent: float, next_interval: float) -> Verdict:
    """Pure: stop (checkpoint now) when what is spent plus what the next checkpoint interval will
    cost would pass the budget. Amounts in the budget's unit. Stopping at the last check where the
    next interval still fitted keeps the overshoot under one interval (the stop's own save)."""
    words = f"spent {budget.show(spent)} of {budget}, next checkpoint interval {budget.show(next_interval)}"
    if spent + next_interval > budget.amount:
        return Verdict(True, f"budget: {words}: {STOPPED_AT_A_CHECKPOINT}")
    return Verdict(False, words)


def checkpoint_interval_s(
    attempt_start: float, now: float, checkpoint_times: list[float], training_start: float | None = None
) -> float:
    """Pure: seconds the next checkpoint interval is expected to take. The longest of the last three
    gaps between this attempt's checkpoints; before two exist, the time from the attempt's first
    step (``training_start``; its start while none is known) to its first checkpoint, or to now: no
    checkpoint of this attempt has come sooner than that. Before the first step none has begun: 0
    (a stop then loses no training, only the start-up already spent)."""
    mine = sorted(t for t in checkpoint_times if t >= attempt_start)
    gaps = [b - a for a, b in zip(mine, mine[1:], strict=False)]
    if gaps:
        return max(gaps[-3:])
    origin = attempt_start if training_start is None else max(attempt_start, training_start)
    if mine:
        return max(0.0, mine[0] - origin)
    return 0.0 if training_start is None else max(0.0, now - origin)
