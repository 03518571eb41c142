"""The batch step's side of notifications (a profile's ``notify:``): it sees an attempt start, the
training resume from a checkpoint, the hang watchdog fire and the step end before anyone runs
``status``, so it sends those events itself, each claimed once (:mod:`orchestrator.notify.events`;
``status``/``wait`` on the login host send what it did not).

Sending never stops or slows the training: senders are daemon threads; before the batch step exits
it waits for them at most :data:`FLUSH_S` (Slurm kills what is left of a job once its batch step
ends), and a broken notifier only writes a line to the job's log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.contract.run_dir import JOB_ID_FILE, attempt_dirs, requeue_recorded_since
from orchestrator.notify import events as notify
from orchestrator.notify import send

#: Most seconds the batch step waits for its senders at its end (each sender gives up by its own
#: ``timeout_s`` anyway).
FLUSH_S = 30.0
#: How often the step's loop looks for the attempt's start record (a resume) while training runs.
POLL_S = 2.0


class StepNotifier:
    """One batch step's events. Every method is a no-op for a run without ``notify:``."""

    def __init__(self, run_dir: Path, job_id: str, attempt: int, say: Callable[[str], None]) -> None:
        self.run_dir, self.job_id, self.attempt, self.say = Path(run_dir), job_id, attempt, say
        self.target = notify.Target.of_run(self.run_dir) if notify.enabled(self.run_dir) else None
        self.threads: list[threading.Thread] = []
        self.seen: set[str] = set()
        self._next_poll = 0.0
        attempts = [a for a, _ in attempt_dirs(self.run_dir)]
        self.first = min([*attempts, attempt])

    def _send(self, events: list[notify.Event]) -> None:
        fresh = [e for e in events if e.key not in self.seen]
        if self.target is None or not fresh:
            return
        self.seen.update(e.key for e in fresh)
        try:
            self.threads += send.notify(self.run_dir, fresh, self.target, daemon=True)
        except Exception as exc:  # noqa: BLE001 (a notifier bug must never end the training)
            self.say(f"notification not sent after an error: {exc!r}")

    def attempt_events(self) -> None:
        """This attempt's started / requeued / continued, resumed and hang events, as they appear."""
        if self.target is None:
            return
        self._send(notify.attempt_events(self.run_dir, self.attempt, self.first, self.job_id))

    def poll(self) -> None:
        """Called from the step's loop: a resume is known once training restored (its start record)."""
        now = time.monotonic()
        if self.target is not None and now >= self._next_poll:
            self._next_poll = now + POLL_S
            self.attempt_events()

    def ended(self, status: int, step_started: float, reason: str | None = None) -> None:
        """The step ended with ``status``: completed, or failed with ``status``'s one-line reason;
        nothing when training asked for a requeue or the run went on as another job."""
        if self.target is None:
            return
        self.attempt_events()  # a hang report, a late start record
        if requeue_recorded_since(self.run_dir, step_started) or self._handed_over():
            return
        if status == 0:
            end = notify.end_event(self.run_dir, self.job_id, "COMPLETED", None)
        else:
            end = notify.end_event(self.run_dir, self.job_id, "FAILED", reason or self._reason())
        if end is not None:
            self._send([end])

    def _handed_over(self) -> bool:
        try:
            return (self.run_dir / JOB_ID_FILE).read_text().strip() not in ("", self.job_id)
        except OSError:
            return False

    def _reason(self) -> str:
        """The reason ``status`` gives a failed job: the hang watchdog's, else the failure report's."""
        from orchestrator.contract.run_dir import (
            HANG_REPORT_FILE,
            hang_dir,
            read_current_plan_json,
            read_json,
        )
        from orchestrator.supervise.failure_report import explain_failure

        hang = read_json(hang_dir(self.run_dir, self.attempt) / HANG_REPORT_FILE) or {}
        if isinstance(hang.get("reason"), str) and hang["reason"]:
            return str(hang["reason"])
        procs = read_current_plan_json(self.run_dir).get("procs_per_node")
        why = explain_failure(
            self.run_dir, self.job_id, procs_per_node=procs if isinstance(procs, int) else 1
        )
        if why is not None:
            return why.summary()
        return f"no error found in its logs; see `orchestrator logs {self.job_id}`"

    def flush(self) -> None:
        """Wait for the senders, bounded: the job ends on time whatever the receiver does."""
        if not self.threads or self.target is None:
            return
        send.join(self.threads, min(FLUSH_S, self.target.timeout_s + 1.0))
        left = [t.name for t in self.threads if t.is_alive()]
        if left:
            self.say(f"notifications still sending at the step's end, left behind: {', '.join(left)}")
