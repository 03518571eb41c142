"""A local sweep: its tasks run K at a time on this machine (the local scheduler has no job arrays).

``orchestrator sweep --profile local`` prepares the sweep (its directory, each task's run directory
and plan in ``sweep.json``) and starts this module detached; it submits each task as an ordinary
local job into its run directory, in grid order, as soon as fewer than ``max_parallel`` of the
sweep's jobs are running, and records it as the sweep's task. A task not started yet is QUEUED in
``status SWEEP``. It ends when every task has been submitted, or when the sweep was cancelled
(``sweep_dir/cancel_requested.json``: ``Sweep.cancel``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from orchestrator.contract.run_dir import CANCEL_MARKER, SWEEP_FILE, read_json

#: Seconds between looks at the running tasks.
POLL_S = 0.5


def main(argv: list[str] | None = None) -> int:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.core.refresh import refresh_states
    from orchestrator.core.submission import submit
    from orchestrator.registry.store import Registry

    sweep_dir, sweep_id = Path((argv or sys.argv[1:])[0]), (argv or sys.argv[1:])[1]
    data = read_json(sweep_dir / SWEEP_FILE) or {}
    limit = int(data["max_parallel"])
    with Registry.open() as registry:
        started: list[str] = []
        for task in data["tasks"]:
            while True:
                if (sweep_dir / CANCEL_MARKER).exists():
                    print(
                        f"sweep {sweep_id} cancelled: task {task['task']} and later not started", flush=True
                    )
                    return 0
                jobs = registry.get_many(started)
                states = refresh_states(registry, jobs).states
                if sum(1 for j in started if not states[j].state.is_terminal()) < limit:
                    break
                time.sleep(POLL_S)
            plan = LaunchPlan.from_json(task["plan"])
            done = submit(plan, registry=registry, existing_run_dir=Path(task["run_dir"]))
            registry.add_sweep_task(sweep_id, int(task["task"]), done.job_id, task["params"])
            started.append(done.job_id)
            print(f"task {task['task']}: job {done.job_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
