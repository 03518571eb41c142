"""Every rank's Python stack now, on demand (``orchestrator stacks JOB``).

For a job that looks stuck (``status`` shows a long time without output), including scripts that
send no heartbeats. Where the job has nodes of its own, the dumps run on them, as one extra step
beside the training (the scheduler's :meth:`~orchestrator.schedulers.base.Scheduler.on_every_node`
prefix, py-spy on each node); local jobs are dumped in place. The stacks are saved under
``<run_dir>/hang/attempt_<A>/stacks_<time>/``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.errors import UserError


@dataclass(frozen=True)
class Stacks:
    """One dump of a job's ranks."""

    job_id: str
    attempt: int
    folder: Path
    records: list[dict[str, Any]]
    """Each rank's record (``rank``, ``host``, ``pid``, ``state``, ``in_collective``, ``stack_tail``...)."""
    problem: str
    """What went wrong reaching the nodes (empty when nothing did)."""
    culprit: tuple[int, str, str] | None
    """``(rank, host, why)`` of the one rank that differs from the others, if one does."""

    @property
    def saved(self) -> bool:
        """Whether the stacks were written: nothing is when no training process was found (an
        ended job), and a folder that was never created must not be named."""
        return self.folder.is_dir()

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "folder": str(self.folder) if self.saved else None,
            "ranks": self.records,
        }


def dump_stacks(job_id: str, run_dir: Path, scheduler_name: str) -> Stacks:
    """Dump the stacks of the newest attempt of the job in ``run_dir``, run by ``scheduler_name``."""
    from orchestrator.contract.run_dir import attempt_dirs, hang_dir
    from orchestrator.schedulers import get_scheduler
    from orchestrator.supervise.stacks import collect, collect_here

    attempts = attempt_dirs(run_dir)
    if not attempts:
        raise UserError(f"job {job_id}: no attempt has started in {run_dir} yet")
    attempt = attempts[-1][0]
    out_dir = hang_dir(run_dir, attempt) / time.strftime("stacks_%Y%m%d-%H%M%S")
    problem = ""
    scheduler = get_scheduler(scheduler_name)
    nodes = scheduler.job_nodes(job_id)
    prefix = scheduler.on_every_node(nodes, job_id)
    if prefix is not None and not nodes:
        raise UserError(f"job {job_id} is not running (the scheduler lists no nodes for it)")

    def dump() -> tuple[list[dict[str, Any]], str]:
        if prefix is None:  # the job's nodes are this machine: dump in place
            return collect_here(str(run_dir), attempt, out_dir), ""
        return collect(prefix, run_dir, attempt, out_dir)  # nodes of their own: on each, inside the job

    records, problem = dump()
    records, problem, culprit = culprit_of(records, problem, dump)
    return Stacks(job_id, attempt, out_dir, records, problem, culprit)


#: How long after a dump whose ranks look uneven the second one is taken (:func:`culprit_of`).
CONFIRM_AFTER_S = 1.0


def culprit_of(
    records: list[dict[str, Any]], problem: str, dump: Callable[[], tuple[list[dict[str, Any]], str]]
) -> tuple[list[dict[str, Any]], str, tuple[int, str, str] | None]:
    """The rank that differs in a dump of a job that may well be healthy: a dead or missing rank at
    once; the one rank outside a collective only when a second dump (``dump``) finds every rank where
    it was. One dump of a healthy job often has a rank still computing while the others wait in the
    all-reduce ("rank 1 differs" of a job doing fine). Returns the records (and problem) of the
    dump the answer rests on: the second one, when it was taken (its files replaced the first's)."""
    from orchestrator.supervise.stacks import find_culprit, unchanged

    if not records:
        return records, problem, None
    certain = find_culprit(records, {}, stalled=False)
    if certain is not None or find_culprit(records, {}) is None:
        return records, problem, certain
    time.sleep(CONFIRM_AFTER_S)
    again, again_problem = dump()
    if not again:
        return records, problem, None
    culprit = find_culprit(again, {}, stalled=unchanged(records, again))
    return again, again_problem, culprit
