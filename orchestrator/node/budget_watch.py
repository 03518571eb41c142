"""A run's budget, enforced while it trains (``--budget``): polled in every node's wait loop.

Node 0 meters the attempt (its own process's start to now (a restart inside the allocation: from
the failed attempt's last record, so the seconds between the attempts count), times the GPUs or CPUs the job holds: the
span ``cost`` bills a local job by), adds what earlier attempts of the run recorded
(:mod:`orchestrator.contract.budget_records`), and asks :func:`orchestrator.config.budget.decide` whether the
next checkpoint interval still fits. When it does not, node 0 writes ``budget_stop.json`` and every
node (node 0 at once, the others on their next poll) sends its ranks the profile's stop signal: the
preemption path, so the ranks agree on a step, save a complete checkpoint and leave asking for a
requeue, which the marker turns into the final state ``BUDGET`` (no requeue).

A stop that comes while the attempt is still starting (a resume given a few CPU-seconds more, or a
start-up of minutes on a real cluster) does not wait for it to finish: the ranks would build, load and
restore before they reach the step boundary where they look at the signal, all of it past the budget,
and then save the checkpoint they had just loaded. When the run's script is known to checkpoint (a
start record of this attempt or an earlier one) and this attempt's rank 0 has not begun a step (no
heartbeat), node 0 marks the stop ``before_training`` and every node ends its ranks at once. The
newest complete checkpoint is where the attempt stands, so nothing is lost. A script not known to
checkpoint gets the signal as before: its own handler may save.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from orchestrator.config.budget import (
    STOPPED_AT_A_CHECKPOINT,
    STOPPED_IN_START_UP,
    checkpoint_interval_s,
    decide,
    in_budget_units,
)
from orchestrator.contract.attempt_start import read_attempt_start
from orchestrator.contract.budget_records import (
    budget_stop,
    spent_hours,
    stops_at_once,
    write_budget_stop,
    write_meter,
)
from orchestrator.contract.heartbeat import read_heartbeat
from orchestrator.contract.run_dir import (
    COMPLETE_MARKER,
    EXIT_REQUEUE,
    attempt_dir,
    attempt_dirs,
    checkpoint_folders,
    heartbeat_file,
    last_complete_checkpoint,
    write_exit_status,
)

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.node.launcher import SignalRelay
    from orchestrator.schedulers.base import NodeEnvironment

#: How often node 0 rewrites its meter record (a killed attempt counts up to its last one).
METER_EVERY_S = 5.0
#: Node 0 decides on every poll of its wait loop; the next look may come this much later.
POLL_S = 0.5


def held_per_hour(plan: LaunchPlan) -> int:
    """Billed hours per hour of the job: its GPUs, or on a CPU profile its CPUs (as a local node's
    ``held.json`` counts them: processes x ``cpus_per_task``)."""
    procs = plan.nodes * plan.procs_per_node
    return procs if not plan.uses_cpu else procs * max(1, plan.profile.cpus_per_task or 1)


def process_start() -> float:
    """This process's own start (the node task's: what a local node's ``held.json`` records)."""
    import psutil

    try:
        return float(psutil.Process().create_time())
    except (psutil.Error, OSError):
        return time.time()


def restarted_from(run_dir: Path, attempt: int, job_id: str) -> float | None:
    """Where a restart inside the allocation picks up the meter: the failed attempt's last record's
    end. The allocation is held between the attempts (the fault, the step's end, the relaunch: ~9 s
    on the test cluster), so those seconds are spent too; metering from this process's start alone
    dropped them. None: this attempt is no restart in this job's allocation (a first attempt, or a
    requeue, whose queue wait holds nothing)."""
    from orchestrator.contract.budget_records import meter_record
    from orchestrator.contract.restarts import read_restarts

    for record in read_restarts(run_dir):
        if record.get("attempt") == attempt and record.get("job_id") == job_id:
            failed = record.get("failed_attempt")
            end = meter_record(run_dir, failed).get("end") if isinstance(failed, int) else None
            return float(end) if isinstance(end, int | float) and end <= time.time() else None
    return None


class BudgetWatch:
    """Polled by each node while its training runs; :meth:`check` returns True once it stopped them."""

    def __init__(
        self,
        plan: LaunchPlan,
        run_dir: Path,
        attempt: int,
        node: NodeEnvironment,
        relay: SignalRelay,
        stop_signal: int,
        log: TextIO,
    ) -> None:
        self.plan, self.run_dir, self.attempt, self.relay, self.log = plan, run_dir, attempt, relay, log
        self.budget, self.stop_signal = plan.budget, stop_signal
        # Node 0 meters every attempt, with a budget or not: one given later (resume --budget) counts them.
        self.owner = node.is_first_node
        self.job_id = node.job_id
        self.stopped = False
        self.start = restarted_from(run_dir, attempt, node.job_id) or process_start()
        self.per_hour = held_per_hour(plan)
        self.before = spent_hours(run_dir, but=attempt) if self.owner and self.budget is not None else 0.0
        self.metered_at = 0.0
        self.checkpoints: dict[Path, float] = {}
        self.trained_from: float | None = None
        self.at_once = False
        """The stop came before this attempt trained: the node ends its ranks without a checkpoint."""
        self.hooked = (
            self.owner
            and self.budget is not None
            and any(
                read_attempt_start(run_dir, a) is not None for a, _ in attempt_dirs(run_dir) if a != attempt
            )
        )
        """The run's script checkpoints (and beats): an earlier attempt wrote its start record."""

    def say(self, line: str) -> None:
        print(f"[orchestrator node] {line}", file=self.log, flush=True)

    def spent(self, now: float) -> float:
        """Billed hours of the run so far: earlier attempts' records and this attempt's span."""
        return self.before + (now - self.start) / 3600.0 * self.per_hour

    def check(self) -> bool:
        if self.stopped or (self.budget is None and not self.owner):
            return self.stopped
        now = time.time()
        if not self.owner:
            marker = budget_stop(self.run_dir, self.attempt)
            if marker is not None:
                self._stop(str(marker.get("reason", "budget")), stops_at_once(marker))
            return self.stopped
        if now - self.metered_at >= METER_EVERY_S:
            self.meter(now)
        if self.budget is None:
            return False
        times = self._checkpoint_times()
        interval_s = checkpoint_interval_s(self.start, now, times, self._training_start()) + POLL_S
        spent = in_budget_units(self.budget, self.spent(now), self.plan.profile)
        interval = in_budget_units(self.budget, interval_s / 3600.0 * self.per_hour, self.plan.profile)
        verdict = decide(self.budget, spent, interval)
        if verdict.stop:
            self.meter(now)
            at_once = self._before_training()
            reason = verdict.reason
            if at_once:
                reason = reason.removesuffix(STOPPED_AT_A_CHECKPOINT) + STOPPED_IN_START_UP
            write_budget_stop(
                self.run_dir, self.attempt, reason, spent, str(self.budget), self.job_id, at_once
            )
            if at_once:
                # rank 0's last word, as its own stop would write it: where the run stands
                newest = last_complete_checkpoint(self.run_dir)
                where = {"step": newest.step} if newest is not None else {}
                write_exit_status(self.run_dir, EXIT_REQUEUE, "budget before training", **where)
            self._stop(reason, at_once)
        return self.stopped

    def meter(self, now: float | None = None) -> None:
        """Node 0's record of this attempt's span (every few seconds, at the stop and at the end)."""
        if not self.owner:
            return
        now = time.time() if now is None else now
        self.metered_at = now
        try:
            write_meter(self.run_dir, self.attempt, self.start, now, self.per_hour)
        except OSError as exc:  # a full disk must not end the training; the stop still works
            self.say(f"budget: meter not written: {exc}")

    def ended_at_once(self) -> bool:
        """Whether this attempt's budget stop ended the ranks without a checkpoint. Node 0's marker is
        read once more: a node whose ranks failed when node 0's were ended may not have polled it."""
        if self.at_once or self.owner or self.budget is None:
            return self.at_once
        return stops_at_once(budget_stop(self.run_dir, self.attempt))

    def _before_training(self) -> bool:
        """Rank 0 of a script that checkpoints (and beats at every step: every hook does) has not
        begun a step in this attempt: ending the ranks now loses no step, and none is saving."""
        hooked = self.hooked or read_attempt_start(self.run_dir, self.attempt) is not None
        return hooked and read_heartbeat(heartbeat_file(attempt_dir(self.run_dir, self.attempt), 0)) is None

    def _training_start(self) -> float | None:
        """When rank 0 was first seen past its first step (its heartbeat): start-up is no part of
        a checkpoint interval."""
        if self.trained_from is None:
            beat = read_heartbeat(heartbeat_file(attempt_dir(self.run_dir, self.attempt), 0))
            step, at = (beat or {}).get("step"), (beat or {}).get("time")
            if isinstance(step, int) and step >= 1 and isinstance(at, int | float):
                self.trained_from = float(at)
        return self.trained_from

    def _checkpoint_times(self) -> list[float]:
        """When each complete checkpoint seen during this attempt was written (its marker's time);
        remembered, as pruning (``--keep-last``) removes old ones."""
        for _, folder in checkpoint_folders(self.run_dir):
            if folder not in self.checkpoints:
                try:
                    self.checkpoints[folder] = (folder / COMPLETE_MARKER).stat().st_mtime
                except OSError:
                    continue
        return list(self.checkpoints.values())

    def _stop(self, reason: str, at_once: bool = False) -> None:
        self.stopped, self.at_once = True, at_once
        if at_once:
            self.say(
                f"{reason}: its ranks end now, without a checkpoint (the newest complete one is where it stands)"
            )
            return
        self.say(f"{reason}: asking the ranks to checkpoint and stop")
        self.relay.send(self.stop_signal)
