"""Every rank's Python stack now, on demand (``orchestrator stacks JOB``).

For a job that looks stuck (``status`` shows a long time without output), including scripts that
send no heartbeats. Where the job has nodes of its own, the dumps run on them, as one extra step
beside the training (the scheduler's :meth:`~orchestrator.schedulers.base.Scheduler.on_every_node`
prefix, py-spy on each node); local jobs are dumped in place. The stacks are saved under
``<run_dir>/hang/attempt_<A>/stacks_<time>/``.
"""

from __future__ import annotations

import time
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
    from orchestrator.supervise.stacks import collect, collect_here, find_culprit

    attempts = attempt_dirs(run_dir)
    if not attempts:
        raise UserError(f"job {job_id}: no attempt has started in {run_dir} yet")
    attempt = attempts[-1][0]
    out_dir = hang_dir(run_dir, attempt) / time.strftime("stacks_%Y%m%d-%H%M%S")
    problem = ""
    scheduler = get_scheduler(scheduler_name)
    nodes = scheduler.job_nodes(job_id)
    prefix = scheduler.on_every_node(nodes, job_id)
    if prefix is None:  # the job's nodes are this machine: dump in place
        records = collect_here(str(run_dir), attempt, out_dir)
    else:  # nodes of their own: dump on each, inside the job
        if not nodes:
            raise UserError(f"job {job_id} is not running (the scheduler lists no nodes for it)")
        records, problem = collect(prefix, run_dir, attempt, out_dir)
    culprit = find_culprit(records, {}) if records else None
    return Stacks(job_id, attempt, out_dir, records, problem, culprit)
