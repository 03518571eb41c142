"""A sweep's one budget, the pure decision (orchestrator.config.sweep_budget): which task starts with
what cap, which waits for a running task's unspent cap, which is refused, and why."""

from __future__ import annotations

import pytest

from orchestrator.config.budget import Budget, parse_budget
from orchestrator.config.sweep_budget import SweepSpend, decide_task, measured, round_down

B = Budget(0.0025, "cpu-h")


def test_before_any_task_ended_the_free_slots_share_what_no_task_holds() -> None:
    first = decide_task(B, SweepSpend(), slots=1)
    assert first.start and not first.refuse and first.cap == B  # --max-parallel 1: all of it
    shared = decide_task(B, SweepSpend(), slots=2)
    assert shared.start and shared.cap is not None and shared.cap.amount == pytest.approx(0.00125)
    # the second of two started together gets the rest: the caps add up to the budget, no more
    second = decide_task(B, SweepSpend(spent=0.0001, reserved=0.00124), slots=1)
    assert second.start and second.cap is not None
    assert 0.0001 + 0.00124 + second.cap.amount <= B.amount
    held = decide_task(B, SweepSpend(spent=0.001, reserved=0.0015), slots=1)
    assert not held.start and not held.refuse and held.reason.startswith("waiting:")


def test_a_task_is_refused_when_what_is_left_cannot_cover_the_costliest_ended_task() -> None:
    # 2 tasks ended at 0.001 and 0.0011: 0.0004 left < 0.0011 measured (the max, not the mean 0.00105)
    spend = SweepSpend(ended=(0.001, 0.0011), spent=0.0021)
    assert measured(spend) == 0.0011
    verdict = decide_task(B, spend, slots=1)
    assert verdict.refuse and not verdict.start and verdict.cap is None
    assert verdict.reason == "refused: budget left 0.0004 cpu-h < a task's measured 0.0011 cpu-h"
    # the max decides: a mean would have started a task the costlier point says will not fit
    assert decide_task(B, SweepSpend(ended=(0.0004, 0.0011), spent=0.0015), slots=1).refuse
    # a failed task's spend counts against the budget but measures nothing (it is not in ``ended``)
    assert decide_task(B, SweepSpend(ended=(0.001,), spent=0.0024), slots=1).refuse


def test_after_a_measure_a_task_starts_with_at_least_the_measure_or_waits_for_one_to_end() -> None:
    one = decide_task(B, SweepSpend(ended=(0.001,), spent=0.001), slots=2)
    # 0.0015 unreserved holds one task at 0.001, not two: one starts, with all of it
    assert one.start and one.cap == Budget(0.0015, "cpu-h")
    two = decide_task(Budget(0.005, "cpu-h"), SweepSpend(ended=(0.001,), spent=0.001), slots=2)
    assert two.start and two.cap == Budget(0.002, "cpu-h")
    # a running task holds 0.0012 of its cap unspent: 0.0003 free < 0.001, but 0.0015 left >= 0.001
    waits = decide_task(B, SweepSpend(ended=(0.001,), spent=0.0012, reserved=0.001), slots=1)
    assert not waits.start and not waits.refuse, waits


def test_caps_round_down_to_four_digits_and_read_back_as_budgets() -> None:
    cap = round_down(Budget(0.00083333333, "cpu-h"))
    assert str(cap) == "0.0008333cpu-h" and parse_budget(str(cap)) == cap
    assert round_down(Budget(12.5, "usd")) == Budget(12.5, "usd")
    third = decide_task(Budget(1.0, "gpu-h"), SweepSpend(), slots=3).cap
    assert third == Budget(0.3333, "gpu-h"), third  # three such caps stay within the budget
