"""A sweep rolled up from its tasks' status rows (``status SWEEP``, ``Sweep.status``).

The rows are ``status``'s own (one batched scheduler query for every task of the sweep), so a
task reads the same here as in ``status JOB``; the rollup adds the grid point of each task, the
counts by state, and the best task by a metric. Importing this module imports no registry, no
scheduler and nothing of ``status`` (``import orchestrator.api`` stays light): a call does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import Registry
    from orchestrator.runner.status import StatusRow
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
    not_started: list[tuple[int, dict[str, str], str]] = field(default_factory=list)
    """Tasks of a local sweep whose starter ended without starting them (``kill -9``, a failed
    submit), with their parameters and the reason: FAILED; ``resume SWEEP --failed`` starts them."""
    refused: list[tuple[int, dict[str, str], str]] = field(default_factory=list)
    """Tasks the sweep's budget refused (``sweep --budget``: what is left cannot cover a task's
    measured cost), with their parameters and the reason: BUDGET, never started."""

    @property
    def total(self) -> int:
        """Tasks of the sweep: the started ones and those not started yet (the summary's count
        read "2 tasks (1 COMPLETED, 2 QUEUED, 1 RUNNING)": only the started ones)."""
        return len(self.rows) + len(self.queued) + len(self.not_started) + len(self.refused)

    def counts(self) -> dict[str, int]:
        """Tasks by state; they add up to :attr:`total`."""
        out: dict[str, int] = {}
        for row in self.rows:
            out[row.state.value] = out.get(row.state.value, 0) + 1
        if self.queued:
            out["QUEUED"] = out.get("QUEUED", 0) + len(self.queued)
        if self.not_started:
            out["FAILED"] = out.get("FAILED", 0) + len(self.not_started)
        if self.refused:
            out["BUDGET"] = out.get("BUDGET", 0) + len(self.refused)
        return out


#: Metrics of a status row a sweep can be ranked by, and whether higher is better.
SWEEP_METRICS = {"loss": False, "val_loss": False, "tokens_per_s": True}


def sweep_status(
    registry: Registry, sweep_id: str, metric: str = "loss", timeout_s: float = 5.0
) -> SweepStatus:
    from orchestrator.runner.status import collect_status

    if metric not in SWEEP_METRICS:
        raise UserError(f"--metric {metric!r}: expected one of {', '.join(SWEEP_METRICS)}")
    from orchestrator.contract.budget_records import refusals
    from orchestrator.contract.run_dir import CANCEL_MARKER, SWEEP_FILE, read_json
    from orchestrator.runner import local_sweep

    record = registry.get_sweep(sweep_id)
    tasks = [(t.task, t.job_id, t.params) for t in record.tasks]
    planned = (read_json(record.sweep_dir / SWEEP_FILE) or {}).get("tasks", [])
    refused_reasons = refusals(record.sweep_dir)
    started_tasks = {n for n, _, _ in tasks}
    refused = [
        (int(t["task"]), dict(t["params"]), refused_reasons[int(t["task"])])
        for t in planned
        if int(t["task"]) in refused_reasons and int(t["task"]) not in started_tasks
    ]
    waiting = [t for t in planned if int(t["task"]) not in started_tasks | {n for n, _, _ in refused}]
    not_started: list[tuple[int, dict[str, str], str]] = []
    if (record.sweep_dir / CANCEL_MARKER).exists():
        waiting = []  # a cancelled local sweep starts no more tasks
    elif waiting and local_sweep.starter_gone(record.sweep_dir):
        pid = local_sweep.starter_pid(record.sweep_dir)
        reason = (
            f"not started: the sweep's starter{'' if pid is None else f' (pid {pid})'} ended before "
            f"starting it (see {record.sweep_dir / 'sweep.log'}); "
            f"`orchestrator resume {sweep_id} --failed` starts it"
        )
        for t in waiting:
            orphan = local_sweep.job_in(registry, Path(t["run_dir"]))  # submitted, not yet recorded
            if orphan is not None:
                tasks.append((int(t["task"]), orphan, dict(t["params"])))
            else:
                not_started.append((int(t["task"]), dict(t["params"]), reason))
        waiting = []
    tasks.sort()
    rows, result = collect_status(registry, registry.get_many([j for _, j, _ in tasks]), timeout_s=timeout_s)
    higher = SWEEP_METRICS[metric]
    scored = [(getattr(r, metric), i) for i, r in enumerate(rows) if getattr(r, metric) is not None]
    best = (max(scored) if higher else min(scored))[1] if scored else None
    status = SweepStatus(
        sweep_id,
        rows,
        [p for _, _, p in tasks],
        result,
        metric,
        best,
        [n for n, _, _ in tasks],
        [(int(t["task"]), dict(t["params"])) for t in waiting],
        not_started,
        refused,
    )
    from orchestrator.notify.login import notify_sweep

    notify_sweep(status, sweep_outcome(status), record.sweep_dir)
    return status


def sweep_outcome(status: SweepStatus) -> JobState | None:
    """None while a task may still run (queued, or a row not ended); else COMPLETED when every task's
    run completed (a task resumed as another job answers for that job), BUDGET when the others were
    stopped or refused by the budget, FAILED otherwise."""
    from orchestrator.contract.job_states import JobState

    if status.queued or any(not row.state.is_terminal() for row in status.rows):
        return None
    finals = [row.run_state or row.state for row in status.rows]
    if status.not_started or any(not s.is_success() and s is not JobState.BUDGET for s in finals):
        return JobState.FAILED
    if status.refused or JobState.BUDGET in finals:
        return JobState.BUDGET
    return JobState.COMPLETED


def wait_for_sweep(
    registry: Any, sweep_id: str, poll_s: float, out: TextIO, deadline: float | None = None
) -> SweepStatus:
    """``wait SWEEP`` / ``sweep --wait``: a line whenever the counts change, until every task ended
    (:func:`sweep_outcome`); ``deadline`` (``time.monotonic()``) passed: :class:`WaitTimeout` with the
    sweep's id and its last state (RUNNING)."""
    import time

    from orchestrator.contract.job_states import JobState
    from orchestrator.runner.progress import WaitTimeout

    last = ""
    while True:
        status = sweep_status(registry, sweep_id, "loss", 5.0)
        counts = ", ".join(f"{n} {state}" for state, n in sorted(status.counts().items()))
        line = f"sweep {sweep_id}: {status.total} tasks ({counts})"
        if line != last:
            print(f"[{time.strftime('%H:%M:%S')}] {line}", file=out, flush=True)
            last = line
        if sweep_outcome(status) is not None:
            return status
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(sweep_id, JobState.RUNNING)
        time.sleep(poll_s)
