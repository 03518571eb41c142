"""The requeue policy: did training ask to come back, and may it?

Training that checkpointed on a stop signal exits 75 (``EXIT_REQUEUE``), but that code does not
survive torchrun (a failed worker makes it exit 1), so rank 0 also leaves ``exit_status.json`` in
the shared run directory. Whether the job then comes back is decided once, by node 0, here: not
after a cancel by the user, not beyond ``max_requeues``. The act itself (the scheduler's requeue)
belongs to the scheduler's node environment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.contract.run_dir import requeue_recorded_since

#: After a stop signal, how long a node whose launcher exited non-zero waits for rank 0's
#: ``exit_status.json`` (ranks on other nodes may exit a moment before rank 0 writes it).
REQUEUE_RECORD_WAIT_S = 20.0


def wait_for_requeue_record(run_dir: Path, launched_at: float, signalled: bool) -> bool:
    """Whether training recorded a requeue request during this launch; polled for a while when
    this node was sent a stop signal (the workers of a node without rank 0 can exit first)."""
    deadline = time.monotonic() + (REQUEUE_RECORD_WAIT_S if signalled else 0.0)
    while True:
        if requeue_recorded_since(run_dir, launched_at):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    reason: str


def decide_requeue(restarts: int, max_requeues: int, cancelled: str | None) -> RequeueDecision:
    """Pure: a job that asked to be requeued comes back unless cancelled or out of requeues."""
    if cancelled:
        return RequeueDecision(False, f"not requeued: {cancelled}")
    if restarts >= max_requeues:
        return RequeueDecision(False, f"not requeued: {restarts} requeues reached max_requeues")
    return RequeueDecision(True, f"requeue {restarts + 1}/{max_requeues}")
