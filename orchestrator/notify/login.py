"""The login host's side of notifications: what ``status``, ``wait`` and ``status SWEEP`` see.

The batch step on the cluster sends what it sees first (:mod:`orchestrator.schedulers.slurm.batch_step`);
these calls send whatever it has not claimed yet (:mod:`orchestrator.notify.events` claims each
event once), from the same facts: the run directory's attempts, start records and hang reports, and
the status row's state and reason. A run without ``notify:`` costs one ``stat`` (no ``notify/``
folder) and nothing is imported or sent.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.contract.job_states import JobState
from orchestrator.contract.run_dir import NOTIFY_DIR
from orchestrator.notify import events as notify
from orchestrator.notify import send

#: At most this long a command (``status``, ``wait``) stays after its output for its senders: a
#: receiver that is down must not hold the terminal for a target's whole ``timeout_s``.
EXIT_WAIT_S = 15.0
_pending: list[threading.Thread] = []


def _outlive(threads: list[threading.Thread]) -> None:
    """Keep the process alive for ``threads`` at its exit, at most :data:`EXIT_WAIT_S` in all."""
    if threads and not _pending:
        atexit.register(lambda: send.join(_pending, EXIT_WAIT_S))
    _pending.extend(threads)


def run_events(
    run_dir: Path, job_id: str, state: JobState, reason: str | None, continued_as: str | None = None
) -> list[notify.Event]:
    """Every event the run directory and this job's state say now (claimed or not)."""
    events = notify.run_dir_events(run_dir, job_id)
    if continued_as is None and state.is_terminal():
        end = notify.end_event(run_dir, job_id, state.value, reason)
        if end is not None:
            events.append(end)
    return events


def notify_run(
    run_dir: Path, job_id: str, state: JobState, reason: str | None, continued_as: str | None = None
) -> None:
    """Send this run's unsent events from threads the process waits for at its exit (bounded)."""
    run_dir = Path(run_dir)
    if not notify.enabled(run_dir):
        return
    if state.is_terminal() and (run_dir / NOTIFY_DIR / f"end.{job_id}").exists():
        return  # its end was sent, and every event before it was seen then
    try:
        _outlive(send.notify(run_dir, run_events(run_dir, job_id, state, reason, continued_as), daemon=True))
    except Exception:  # noqa: BLE001 (a notification never breaks status)
        pass


def notify_rows(rows: Sequence[Any]) -> None:
    """``status``'s rows (:class:`~orchestrator.runner.status.StatusRow`; not imported: status imports this)."""
    for row in rows:
        if notify.enabled(row.run_dir):
            notify_run(Path(row.run_dir), row.job_id, row.state, row.reason, row.continued_as)


def notify_sweep(status: Any, outcome: JobState | None, sweep_dir: Path) -> None:
    """A sweep (:class:`~orchestrator.runner.sweep_status.SweepStatus`) whose every task ended
    (``outcome``): once, naming its best task by ``status``'s metric."""
    if outcome is None or not status.rows or not notify.enabled(Path(status.rows[0].run_dir)):
        return
    best = None
    if status.best is not None:
        row = status.rows[status.best]
        params = ", ".join(f"{k}={v}" for k, v in status.params[status.best].items())
        task = status.tasks[status.best] if status.tasks else status.best
        best = f"task {task} ({params}), job {row.job_id}, {status.metric} {getattr(row, status.metric)}"
    try:
        (Path(sweep_dir) / NOTIFY_DIR).mkdir(exist_ok=True)
        target = notify.Target.of_run(Path(status.rows[0].run_dir))
        event = notify.sweep_event(sweep_dir, status.sweep_id, outcome.value, best)
        _outlive(send.notify(Path(sweep_dir), [event], target, daemon=True))
    except Exception:  # noqa: BLE001
        pass
