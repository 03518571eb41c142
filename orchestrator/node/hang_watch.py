"""The hang watchdog where no batch step supervises the job (the local profile): node 0's wait loop.

On Slurm the batch step polls :class:`orchestrator.supervise.watchdog.Watchdog` beside the step
(:mod:`orchestrator.schedulers.slurm.batch_step`). A local job has no such step, and ``--hang-timeout``
was accepted there and did nothing (a hung job ran for over 10 minutes, issue 27). Here node 0
(where :attr:`NodeEnvironment.watches_hangs`) polls the same watchdog while it waits for its
launcher; when it fires, every rank's stacks are collected on this machine, ``hang/attempt_<A>/hang.json``
is written with the rank that differs, and the caller ends the launch: the other simulated nodes
stop as after any failed node, and the job's final state is FAILED with the report's reason.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from orchestrator.contract.run_dir import hang_dir

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.schedulers.base import NodeEnvironment
    from orchestrator.supervise.watchdog import Watchdog


class NodeHangWatch:
    """Polled by node 0 while its training runs; :meth:`check` returns the hang's reason once."""

    def __init__(
        self, plan: LaunchPlan, run_dir: Path, attempt: int, node: NodeEnvironment, log: TextIO
    ) -> None:
        self.plan, self.run_dir, self.attempt, self.node, self.log = plan, run_dir, attempt, node, log
        self.dog: Watchdog | None = None
        if node.watches_hangs and node.is_first_node:
            from orchestrator.supervise.watchdog import Watchdog

            self.dog = Watchdog(run_dir, attempt, plan.hang_timeout, self.say)

    def say(self, line: str) -> None:
        print(f"[orchestrator node] {line}", file=self.log, flush=True)

    def check(self) -> str | None:
        """None while the ranks make progress (or nothing is watched); the reason once they hung."""
        if self.dog is None:
            return None
        try:
            hang = self.dog.check()
        except Exception as exc:  # noqa: BLE001 (a watchdog bug must never end the training)
            self.say(f"hang watchdog off after an error: {exc!r}")
            self.dog = None
            return None
        if hang is None:
            return None
        from orchestrator.supervise.watchdog import investigate, write_report

        self.dog = None
        self.say(f"hang watchdog: {hang.describe()}; collecting every rank's stacks")
        try:
            reason, _ = investigate(
                self.run_dir, self.attempt, hang, list(self.node.hostnames), [], self.plan.world_size
            )
        except Exception as exc:  # noqa: BLE001 (the hung launch must end whatever the evidence did)
            reason = f"hang: {hang.describe()}; stacks not collected: {exc!r}"
            write_report(hang_dir(self.run_dir, self.attempt), {"reason": reason, "time": time.time()})
        self.say(reason)
        self.say("ending the launch")
        return reason
