"""A sweep's one budget over all its tasks (``orchestrator sweep --budget X``): which task starts,
with what cap of its own, and which is refused. Pure: the starter (``runner/local_sweep``) measures,
this decides, the starter starts or records the refusal.

The sweep's budget ``B`` is shared out as caps: every started task runs with a cap of its own (its
run's ``--budget``, enforced by its node 0 like any run's), and the sweep keeps

    (what the ended tasks spent) + (the caps of the running tasks) <= B

so the sweep as a whole stays within ``B`` (each task may pass its cap by its own stop's save, as
any run may). What is not reserved so far, ``U = B - ended spend - running caps``, is what a new
task's cap comes from; a task's unspent cap comes back to ``U`` when it ends.

The measured cost of a task is the **maximum** spend of the tasks that ended COMPLETED or stopped by
their budget (a failed task says nothing of what a task costs). The maximum, not the mean: grid
points differ in cost (a larger batch, another model), and a task started on the mean's promise may
well be the costly kind, stopped by its cap at a checkpoint short of its end: budget spent on a
task that does not finish. With the maximum the sweep refuses only what its costliest measured
task says it cannot cover, and starts no task on a promise its own tasks have already broken.

* Measured cost ``m``: a task starts when ``U >= m``, with ``n`` tasks sharing ``U`` (the free
  slots, no more than ``U`` holds at ``m`` each): cap ``U / n >= m``. It is **refused** when what
  is left of the budget, ``B - everything spent`` (the running tasks' spend so far included), is
  under ``m``: no running task's end can give back enough. Between the two (``U < m`` but the
  running tasks' unspent caps may come back) it waits.
* Nothing measured yet (no task ended): the free slots share ``U`` equally, ``U / slots`` each
  (``--max-parallel 1``: the whole budget to the first task). Nothing is refused that no measure
  says cannot be covered; a budget too small for the tasks stops them at a checkpoint, resumable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.config.budget import Budget


@dataclass(frozen=True)
class SweepSpend:
    """What the sweep's tasks have spent and hold, in the budget's unit."""

    ended: tuple[float, ...] = ()
    """Spend of each ended task that measures a task's cost (COMPLETED, or stopped by its cap)."""
    spent: float = 0.0
    """Everything the sweep's tasks have spent: ended (failed ones too) and running, so far."""
    reserved: float = 0.0
    """What the running tasks' caps hold beyond what they have spent already."""


@dataclass(frozen=True)
class TaskVerdict:
    """:func:`decide_task`'s answer: ``start`` with ``cap``, or ``refuse`` (for good), else wait."""

    start: bool
    refuse: bool
    cap: Budget | None
    reason: str


def measured(spend: SweepSpend) -> float | None:
    """A task's measured cost: the most an ended task spent (None before any ended)."""
    return max(spend.ended) if spend.ended else None


def decide_task(budget: Budget, spend: SweepSpend, slots: int) -> TaskVerdict:
    """Whether the next task starts now (``slots``: the tasks that could start now, this one among
    them, >= 1), with what cap, is refused, or waits for a running task to end."""
    left = budget.amount - spend.spent
    unreserved = left - spend.reserved
    cost = measured(spend)
    if cost is None:
        if unreserved <= 0:
            if spend.reserved <= 0:
                return TaskVerdict(False, True, None, f"refused: budget left {budget.show(max(left, 0.0))}")
            return TaskVerdict(False, False, None, "waiting: the running tasks hold the whole budget")
        return _start(budget, unreserved, max(1, slots))
    if left < cost:
        return TaskVerdict(
            False,
            True,
            None,
            f"refused: budget left {budget.show(max(left, 0.0))} < a task's measured {budget.show(cost)}",
        )
    if unreserved < cost:
        return TaskVerdict(
            False,
            False,
            None,
            f"waiting: {budget.show(max(unreserved, 0.0))} not held by running tasks < a task's measured "
            f"{budget.show(cost)}",
        )
    n = max(1, min(slots, math.floor(unreserved / cost))) if cost > 0 else max(1, slots)
    return _start(budget, unreserved, n)


def _start(budget: Budget, unreserved: float, n: int) -> TaskVerdict:
    cap = round_down(Budget(unreserved / n, budget.unit))
    return TaskVerdict(True, False, cap, f"started with a cap of {budget.show(cap.amount)}")


def round_down(cap: Budget) -> Budget:
    """``cap`` to four significant digits, rounded down (``0.00083333`` -> ``0.0008333``): a task's
    ``--budget`` as ``status`` and ``job.json`` show it, never above its share (0.1 % below at most)."""
    if cap.amount <= 0 or not math.isfinite(cap.amount):
        return cap
    quantum = 10.0 ** (math.floor(math.log10(cap.amount)) - 3)
    amount = float(f"{math.floor(cap.amount / quantum * (1 + 1e-12)) * quantum:.4g}")
    return Budget(amount if amount > 0 else cap.amount, cap.unit)
