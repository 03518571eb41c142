"""A sweep rolled up from its tasks' status rows (``status SWEEP``, ``Sweep.status``).

The rows are ``status``'s own (one batched scheduler query for every task of the sweep), so a
task reads the same here as in ``status JOB``; the rollup adds the grid point of each task, the
counts by state, and the best task by a metric. Importing this module imports no registry, no
scheduler and nothing of ``status`` (``import orchestrator.api`` stays light): a call does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from orchestrator.core.status import StatusRow
    from orchestrator.registry.store import Registry
    from orchestrator.schedulers.query import QueryResult


@dataclass(frozen=True)
class SweepStatus:
    """``status SWEEP``: a row per started task, and the best task by ``metric``."""

    sweep_id: str
    rows: list[StatusRow]
    params: list[dict[str, str]]
    result: QueryResult
    metric: str
    best: int | None
    """Index into ``rows`` of the best task (None when no task has the metric yet)."""
    tasks: list[int] = field(default_factory=list)
    """The task number of each row."""
    queued: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    """Tasks of a local sweep not started yet (waiting for a free slot), with their parameters."""

    @property
    def total(self) -> int:
        """Tasks of the sweep: the started ones and those not started yet (the summary's count
        read "2 tasks (1 COMPLETED, 2 QUEUED, 1 RUNNING)": only the started ones)."""
        return len(self.rows) + len(self.queued)

    def counts(self) -> dict[str, int]:
        """Tasks by state; they add up to :attr:`total`."""
        out: dict[str, int] = {}
        for row in self.rows:
            out[row.state.value] = out.get(row.state.value, 0) + 1
        if self.queued:
            out["QUEUED"] = out.get("QUEUED", 0) + len(self.queued)
        return out


#: Metrics of a status row a sweep can be ranked by, and whether higher is better.
SWEEP_METRICS = {"loss": False, "val_loss": False, "tokens_per_s": True}


def sweep_status(
    registry: Registry, sweep_id: str, metric: str = "loss", timeout_s: float = 5.0
) -> SweepStatus:
    from orchestrator.core.status import collect_status

    if metric not in SWEEP_METRICS:
        raise UserError(f"--metric {metric!r}: expected one of {', '.join(SWEEP_METRICS)}")
    record = registry.get_sweep(sweep_id)
    rows, result = collect_status(registry, registry.get_many(record.job_ids), timeout_s=timeout_s)
    higher = SWEEP_METRICS[metric]
    scored = [(getattr(r, metric), i) for i, r in enumerate(rows) if getattr(r, metric) is not None]
    best = (max(scored) if higher else min(scored))[1] if scored else None
    started = {t.task for t in record.tasks}
    from orchestrator.contract.run_dir import CANCEL_MARKER, SWEEP_FILE, read_json

    planned = (read_json(record.sweep_dir / SWEEP_FILE) or {}).get("tasks", [])
    queued = [(int(t["task"]), dict(t["params"])) for t in planned if int(t["task"]) not in started]
    if (record.sweep_dir / CANCEL_MARKER).exists():
        queued = []  # a cancelled local sweep starts no more tasks
    return SweepStatus(
        sweep_id,
        rows,
        [t.params for t in record.tasks],
        result,
        metric,
        best,
        [t.task for t in record.tasks],
        queued,
    )
