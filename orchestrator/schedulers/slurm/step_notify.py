"""The batch step's side of notifications (a profile's ``notify:``): the batch step owns the run's
events on Slurm (:class:`~orchestrator.notify.owner.RunNotifier`): it sees an attempt start, a
restart inside the allocation, the training resume from a checkpoint, the hang watchdog fire and the
step end. ``status``, ``wait`` and the dashboard never send. Here: how the step's end reads as an
event (completed, failed with ``status``'s reason, or nothing when a requeue or another job follows).

Before the batch step exits it waits for what is unsent at most ``notify.timeout_s`` (Slurm kills
what is left of a job once its batch step ends); what is still unsent then, the next attempt's batch
step sends first.
"""

from __future__ import annotations

from orchestrator.contract.run_dir import JOB_ID_FILE, requeue_recorded_since
from orchestrator.notify.owner import RunNotifier


class StepNotifier(RunNotifier):
    """One batch step's events."""

    def ended(self, status: int, step_started: float, reason: str | None = None) -> None:
        """The step ended with ``status``: completed, or failed with ``status``'s one-line reason;
        nothing when training asked for a requeue or the run went on as another job."""
        if self.target is None:
            return
        self.attempt_events()  # a hang report, a late start record
        if requeue_recorded_since(self.run_dir, step_started) or self._handed_over():
            self.continues = True  # the next attempt's owner sends what is left: do not hold the nodes
            return
        if status == 0:
            self.end("COMPLETED", None)
        else:
            self.end("FAILED", reason or self._reason())

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

    #: Set when the run goes on (a requeue, another job): the step waits only this long for its courier.
    continues = False
    CONTINUES_WAIT_S = 5.0

    def flush(self) -> None:
        """Wait for the courier, bounded: ``notify.timeout_s`` at the run's end, a few seconds when
        the run goes on (its next owner sends the rest); the job ends on time whatever the receiver does."""
        self.close(self.CONTINUES_WAIT_S if self.continues else None)
