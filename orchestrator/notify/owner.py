"""The run's owner's side of notifications: the one process that records and sends a run's events.

On Slurm the owner is the batch step (it starts each attempt, sees a restart, a resume, the hang
watchdog and the step's end); on ``local`` it is node 0's node process. The scheduler's code says
*when* (an attempt began, the job ended and how); this class derives the events from the run
directory, records each once and hands them to the courier, which sends them in order while the
owner lives and at most ``notify.timeout_s`` after its end (:mod:`orchestrator.notify.outbox`).

Sending never stops or slows the training: the courier is a daemon thread, and a broken notifier
only writes a line to the job's log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.contract.run_dir import attempt_dirs
from orchestrator.notify import events as notify
from orchestrator.notify import outbox, send

#: How often the owner's loop looks for new attempt events (a resume is known once training restored).
POLL_S = 2.0


class RunNotifier:
    """One owner's events. Every method is a no-op for a run without ``notify:``."""

    def __init__(self, run_dir: Path, job_id: str, attempt: int, say: Callable[[str], None]) -> None:
        self.run_dir, self.job_id, self.attempt, self.say = Path(run_dir), job_id, attempt, say
        self.target = notify.Target.of_run(self.run_dir) if notify.enabled(self.run_dir) else None
        self._next_poll = 0.0
        attempts = [a for a, _ in attempt_dirs(self.run_dir)]
        self.first = min([*attempts, attempt])
        self.courier: outbox.Courier | None = None
        if self.target is not None:
            target = self.target

            def deliver(recorded: outbox.Recorded, channel: str) -> str | None:
                return send.deliver(target, notify.Event.from_payload(recorded.payload), channel)

            # Started at once: what an earlier owner left unsent goes first.
            self.courier = outbox.Courier(self.run_dir, send.channels(target), deliver).start()

    def record(self, events: list[notify.Event]) -> None:
        """Record ``events`` (each once, by key) and wake the courier."""
        if self.courier is None or not events:
            return
        try:
            fresh = [e for e in events if outbox.record(self.run_dir, e.key, e.payload())]
        except Exception as exc:  # noqa: BLE001 (a notifier bug must never end the training)
            self.say(f"notification not recorded after an error: {exc!r}")
            return
        if fresh:
            self.courier.wake()

    def attempt_events(self) -> None:
        """This attempt's started / requeued / restarted / continued, resumed and hang events."""
        if self.courier is not None:
            self.record(notify.attempt_events(self.run_dir, self.attempt, self.first, self.job_id))

    def poll(self) -> None:
        """Called from the owner's loop, cheap between looks."""
        now = time.monotonic()
        if self.courier is not None and now >= self._next_poll:
            self._next_poll = now + POLL_S
            self.attempt_events()

    def end(self, state: str, reason: str | None) -> None:
        """The job ended in ``state`` (the scheduler's word): the attempt's late events, then the end."""
        if self.courier is None:
            return
        self.attempt_events()
        end = notify.end_event(self.run_dir, self.job_id, state, reason)
        if end is not None:
            self.record([end])

    def close(self, most_s: float | None = None) -> None:
        """At the owner's end: wait for the courier, at most ``notify.timeout_s`` (or ``most_s``)."""
        if self.courier is None or self.target is None:
            return
        wait_s = self.target.timeout_s if most_s is None else min(most_s, self.target.timeout_s)
        left = self.courier.drain(wait_s)
        if left:
            self.say(
                f"notifications not sent within {wait_s:.0f} s, left for the run's next owner: {', '.join(left)}"
            )
