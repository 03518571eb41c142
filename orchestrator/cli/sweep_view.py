"""``status SWEEP`` and ``list --sweeps`` as text and JSON: a sweep rolled up from its tasks' rows.

The rows are ``status``'s own (one batched scheduler query for every task of the sweep), so a
task reads the same here as in ``status JOB``; the rollup adds the grid point of each task, the
counts by state, and the best task by a metric (:class:`orchestrator.api.SweepStatus`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from orchestrator.cli.table import dumps_indented, format_table

if TYPE_CHECKING:
    from orchestrator.api import SweepRecord, SweepStatus


def _value(row: Any, metric: str) -> str:
    value = getattr(row, metric)
    if value is None:
        return "-"
    return f"{value:.4f}" if metric != "tokens_per_s" else f"{value:,.0f}"


def render_sweep_status(status: SweepStatus) -> str:
    table = [
        {
            "task": i,
            "job": row.job_id,
            "params": " ".join(f"{k}={v}" for k, v in params.items()),
            "state": row.state.value + (" (stale)" if row.stale else ""),
            "step": "-" if row.step is None else str(row.step),
            status.metric: _value(row, status.metric),
            "requeues": row.requeues,
            "reason": row.reason or "",
        }
        for i, row, params in zip(status.tasks, status.rows, status.params, strict=True)
    ]
    table += [
        {"task": i, "job": "-", "params": " ".join(f"{k}={v}" for k, v in params.items()), "state": "QUEUED"}
        | {
            "step": "-",
            status.metric: "-",
            "requeues": 0,
            "reason": "waiting for a free slot (--max-parallel)",
        }
        for i, params in status.queued
    ]
    table += [
        {"task": i, "job": "-", "params": " ".join(f"{k}={v}" for k, v in params.items()), "state": "FAILED"}
        | {"step": "-", status.metric: "-", "requeues": 0, "reason": reason}
        for i, params, reason in status.not_started
    ]
    table += [
        {"task": i, "job": "-", "params": " ".join(f"{k}={v}" for k, v in params.items()), "state": "BUDGET"}
        | {"step": "-", status.metric: "-", "requeues": 0, "reason": reason}
        for i, params, reason in status.refused
    ]
    table.sort(key=lambda r: int(str(r["task"])))
    columns = ["task", "job", "params", "state", "step", status.metric, "requeues", "reason"]
    lines = [format_table(table, columns)]
    counts = ", ".join(f"{n} {state}" for state, n in sorted(status.counts().items()))
    summary = f"sweep {status.sweep_id}: {status.total} tasks ({counts})"
    if status.best is not None:
        row = status.rows[status.best]
        params = " ".join(f"{k}={v}" for k, v in status.params[status.best].items())
        task = status.tasks[status.best]
        summary += (
            f"; best {status.metric} {_value(row, status.metric)}: task {task} (job {row.job_id}, {params})"
        )
    else:
        summary += f"; no task has reported {status.metric} yet"
    lines.append(summary)
    return "\n".join(lines)


def sweep_status_json(status: SweepStatus) -> dict[str, Any]:
    result = status.result
    return {
        "sweep_id": status.sweep_id,
        "source": result.source,
        "stale": result.stale,
        "errors": list(result.errors),
        "scheduler_calls": dict(result.calls),
        "metric": status.metric,
        "best_task": None if status.best is None else status.tasks[status.best],
        "counts": status.counts(),
        "tasks": [
            {"task": i, "params": params, **row.to_json()}
            for i, row, params in zip(status.tasks, status.rows, status.params, strict=True)
        ],
        "queued": [{"task": i, "params": params} for i, params in status.queued],
        "not_started": [
            {"task": i, "params": params, "state": "FAILED", "reason": reason}
            for i, params, reason in status.not_started
        ],
        "refused": [
            {"task": i, "params": params, "state": "BUDGET", "reason": reason}
            for i, params, reason in status.refused
        ],
    }


def print_sweep_status(status: SweepStatus, as_json: bool) -> None:
    if as_json:
        print(dumps_indented(sweep_status_json(status)))
    else:
        print(render_sweep_status(status))


def render_sweep_list(sweeps: Sequence[SweepRecord]) -> str:
    import time

    rows = [
        {
            "sweep": s.sweep_id,
            "name": s.name,
            "tasks": s.task_count,
            "max_parallel": s.max_parallel,
            "grid": " ".join(f"{k}={','.join(v)}" for k, v in s.grid.items()),
            "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(s.created_at)),
            "sweep_dir": str(s.sweep_dir),
        }
        for s in sweeps
    ]
    return format_table(rows, ["sweep", "name", "tasks", "max_parallel", "grid", "created", "sweep_dir"])


def sweep_list_json(sweeps: Sequence[SweepRecord]) -> str:
    return json.dumps([s.to_json() for s in sweeps], indent=2)
