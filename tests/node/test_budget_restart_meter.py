"""A restart inside the allocation is metered from the failed attempt's last record
(orchestrator.node.budget_watch.restarted_from): the allocation is held between the two attempts, so
those seconds count against the run's budget. A requeue's attempt (no restart record of this job)
starts at its own node task, as the queue's hold holds no node. tests/cluster/test_budget.py proves
it on Slurm with a rank SIGKILLed."""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator.contract.budget_records import spent_hours, write_meter
from orchestrator.contract.restarts import append_restart
from orchestrator.node.budget_watch import restarted_from


def test_a_restart_in_the_allocation_meters_from_the_failed_attempts_end(tmp_path: Path) -> None:
    now = time.time()
    write_meter(tmp_path, 0, now - 60, now - 30, 2)  # attempt 0 ended 30 s ago
    append_restart(
        tmp_path, {"job_id": "7", "failed_attempt": 0, "attempt": 1, "cause": "SIGKILL", "time": now - 25}
    )
    assert restarted_from(tmp_path, 1, "7") == now - 30
    write_meter(tmp_path, 1, now - 30, now, 2)
    assert (
        round(spent_hours(tmp_path) * 3600, 6) == 2 * 60
    )  # contiguous: the 60 s the allocation was held, x 2 CPUs
    # not a restart of this job's allocation: its node task's own start
    assert restarted_from(tmp_path, 2, "7") is None
    assert restarted_from(tmp_path, 1, "8") is None
    # a failed attempt that kept no meter: nothing to start from
    append_restart(
        tmp_path, {"job_id": "7", "failed_attempt": 4, "attempt": 5, "cause": "SIGKILL", "time": now}
    )
    assert restarted_from(tmp_path, 5, "7") is None
