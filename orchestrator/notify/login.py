"""The one event the login host records: a sweep's end.

A run's events are its owner's (:mod:`orchestrator.notify.owner`); a sweep has no owner on Slurm
(its tasks are separate jobs, nothing supervises all of them), so ``status SWEEP`` is where its end
is seen. It records ``sweep_finished`` once (the outbox's O_EXCL record) in the sweep folder's
``notify/`` and sends it from a thread that the command waits for at its exit at most
:data:`EXIT_WAIT_S`; a send that fails there is tried again by the next ``status SWEEP``. A run's own
events are never sent from here.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

from orchestrator.contract.job_states import JobState
from orchestrator.contract.run_dir import NOTIFY_DIR
from orchestrator.notify import events as notify
from orchestrator.notify import outbox, send

#: At most this long ``status SWEEP`` stays after its output for the sweep's event.
EXIT_WAIT_S = 5.0


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
        target = notify.Target.of_run(Path(status.rows[0].run_dir))
        if target is None:
            return
        sweep_dir = Path(sweep_dir)
        (sweep_dir / NOTIFY_DIR).mkdir(mode=0o700, exist_ok=True)
        event = notify.sweep_event(sweep_dir, status.sweep_id, outcome.value, best)
        outbox.record(sweep_dir, event.key, event.payload())
        channels = send.channels(target)
        if not outbox.pending(sweep_dir, channels):
            return

        def deliver(recorded: outbox.Recorded, channel: str) -> str | None:
            return send.deliver(target, notify.Event.from_payload(recorded.payload), channel)

        courier = outbox.Courier(sweep_dir, channels, deliver).start()
        atexit.register(courier.drain, EXIT_WAIT_S)
    except Exception:  # noqa: BLE001 (a notification never breaks status)
        pass
