"""A sweep started task by task from this machine: the local scheduler's (it has no job arrays), and
on any scheduler a sweep with a budget (its tasks' caps and refusals are decided as each starts).

``orchestrator sweep --profile local`` prepares the sweep (its directory, each task's run directory
and plan in ``sweep.json``) and starts this module detached (:func:`start`); it submits each task as
an ordinary local job into its run directory, in grid order, as soon as fewer than ``max_parallel``
of the sweep's jobs are running, and records it as the sweep's task. A task not started yet is
QUEUED in ``status SWEEP``. It ends when every task has been submitted, or when the sweep was
cancelled (``sweep_dir/cancel_requested.json``: ``Sweep.cancel``).

Whether the starter lives is the run rule of :mod:`orchestrator.contract.run_alive`: it holds the
sweep directory's alive lock, taken by the command that starts it before it exists (so there is no
moment without a holder). A starter that died (``kill -9``, a failed submit) leaves its unstarted
tasks FAILED in ``status SWEEP`` with the reason (measured before: QUEUED "waiting for a free slot"
forever); ``resume SWEEP --failed`` starts a new starter, which skips every task that has a job
already (in the registry's sweep tasks, or a job in its run directory that a killed starter had
submitted but not yet recorded) and takes the others K at a time. At most one starter works on a
sweep: each holds :data:`STARTER_LOCK` exclusively.

A sweep with a budget (``sweep --budget X``, or the profile's ``budget``: ``sweep.json``'s
``budget``) is one budget over all its tasks: before each task the starter measures what the
started tasks spent and hold (:func:`sweep_spend`) and :func:`orchestrator.config.sweep_budget.decide_task`
says whether it starts (with a cap of its own: its run's ``--budget``), waits for a running task's
unspent cap to come back, or is refused; a refused task is recorded (``budget_refused.json``) and
``status SWEEP`` shows it BUDGET with the reason.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.contract import run_alive
from orchestrator.contract.run_dir import (
    CANCEL_MARKER,
    LOCAL_PIDS_FILE,
    SWEEP_FILE,
    SWEEP_LOG,
    read_json,
    write_json_atomic,
)

if TYPE_CHECKING:
    from orchestrator.config.budget import Budget
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.sweep_budget import SweepSpend
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import JobRecord, Registry

#: Seconds between looks at the running tasks (local jobs: their run directories).
POLL_S = 0.5
#: The same on a scheduler with a queue to ask (a sweep with a budget on Slurm): at most this often.
QUEUE_POLL_S = 2.0
#: In the sweep directory: held exclusively by the one starter working on the sweep.
STARTER_LOCK = ".starter.lock"


def start(sweep_dir: Path, sweep_id: str) -> int:
    """Start the detached starter of a local sweep; its pid (also in ``local_pids.json``). The
    sweep's alive lock is taken here and handed to it, so the sweep never looks abandoned while it
    starts."""
    import fcntl
    import subprocess

    fd = os.open(sweep_dir / run_alive.ALIVE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        with open(sweep_dir / SWEEP_LOG, "ab") as log:
            driver = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.runner.local_sweep", str(sweep_dir), sweep_id, str(fd)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                pass_fds=(fd,),
            )
    finally:
        os.close(fd)
    write_json_atomic(sweep_dir / LOCAL_PIDS_FILE, {"controller": driver.pid})
    return driver.pid


def starter_gone(sweep_dir: Path) -> bool:
    """Whether no starter of the sweep lives (every process holding its alive lock is gone)."""
    if (sweep_dir / run_alive.ALIVE_FILE).exists():
        return run_alive.holders(sweep_dir) is None
    pid = (read_json(sweep_dir / LOCAL_PIDS_FILE) or {}).get("controller")  # a sweep from before the lock
    return not (isinstance(pid, int) and Path(f"/proc/{pid}").exists())


def starter_pid(sweep_dir: Path) -> int | None:
    pid = (read_json(sweep_dir / LOCAL_PIDS_FILE) or {}).get("controller")
    return pid if isinstance(pid, int) else None


def job_in(registry: Registry, run_dir: Path) -> str | None:
    """The last job that trains in a task's run directory (a killed starter may have submitted it
    without recording it as the sweep's task), None when none was submitted there."""
    run = registry.run_at(run_dir)
    return run.job_ids[-1] if run is not None else None


def sweep_spend(
    budget: Budget, plan: LaunchPlan, jobs: list[JobRecord], states: dict[str, JobState]
) -> SweepSpend:
    """What the sweep's started tasks (``jobs``, one per task) have spent and hold, in the budget's
    unit, from their attempts' meters (``budget.json``: what each task's node 0 caps it by): the
    ended ones that measure a task (COMPLETED, or stopped by their cap), everything spent, and what
    the running tasks' caps (their runs' ``--budget``) hold beyond their spend."""
    from orchestrator.config.budget import in_budget_units, parse_budget
    from orchestrator.config.sweep_budget import SweepSpend
    from orchestrator.contract.budget_records import spent_hours
    from orchestrator.contract.job_states import JobState
    from orchestrator.contract.run_dir import read_current_plan_json

    ended: list[float] = []
    spent = reserved = 0.0
    for job in jobs:
        used = in_budget_units(budget, spent_hours(Path(job.run_dir)), plan.profile)
        spent += used
        state = states.get(job.job_id, job.last_state)
        if state in (JobState.COMPLETED, JobState.BUDGET):
            ended.append(used)
        elif not state.is_terminal():
            cap = read_current_plan_json(Path(job.run_dir)).get("budget")
            held = parse_budget(cap).amount if isinstance(cap, str) else budget.amount
            reserved += max(0.0, held - used)
    return SweepSpend(tuple(ended), spent, reserved)


def main(argv: list[str] | None = None) -> int:
    import fcntl
    from dataclasses import replace

    from orchestrator.config.budget import parse_budget
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.sweep_budget import TaskVerdict, decide_task
    from orchestrator.contract.budget_records import forget_refusal, record_refusal
    from orchestrator.registry.store import Registry
    from orchestrator.runner.refresh import refresh_states
    from orchestrator.runner.submission import submit
    from orchestrator.schedulers import get_scheduler

    args = argv if argv is not None else sys.argv[1:]
    sweep_dir, sweep_id = Path(args[0]), args[1]
    run_alive.hold(sweep_dir)  # our own lock (named in /proc/locks), then drop the one handed to us
    if len(args) > 2:
        with contextlib.suppress(OSError):
            os.close(int(args[2]))
    only = os.open(sweep_dir / STARTER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(only, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"sweep {sweep_id}: another starter works on it; this one ends", flush=True)
        return 0
    data = read_json(sweep_dir / SWEEP_FILE) or {}
    limit = int(data["max_parallel"])
    budget = parse_budget(data["budget"]) if data.get("budget") else None
    # a cluster's scheduler (one with job arrays) is asked through its queue: less often
    scheduler = LaunchPlan.from_json(data["tasks"][0]["plan"]).profile.scheduler if data["tasks"] else "local"
    poll_s = QUEUE_POLL_S if get_scheduler(scheduler).has_arrays else POLL_S
    with Registry.open() as registry:
        recorded = {t.task: t.job_id for t in registry.get_sweep(sweep_id).tasks}
        started: list[str] = list(recorded.values())
        for task in data["tasks"]:
            number, run_dir = int(task["task"]), Path(task["run_dir"])
            if number in recorded:
                continue
            orphan = job_in(registry, run_dir)
            if orphan is not None:  # submitted by a starter killed before it recorded the task
                registry.add_sweep_task(sweep_id, number, orphan, task["params"])
                started.append(orphan)
                print(f"task {number}: job {orphan} (submitted earlier, recorded now)", flush=True)
                continue
            plan = LaunchPlan.from_json(task["plan"])
            verdict: TaskVerdict | None = None
            while True:
                if (sweep_dir / CANCEL_MARKER).exists():
                    print(f"sweep {sweep_id} cancelled: task {number} and later not started", flush=True)
                    return 0
                jobs = registry.get_many(started)
                states = refresh_states(registry, jobs).states
                running = sum(1 for j in started if not states[j].state.is_terminal())
                if running < limit:
                    if budget is None:
                        break
                    left = sum(1 for t in data["tasks"] if int(t["task"]) >= number)
                    spend = sweep_spend(budget, plan, jobs, {j: s.state for j, s in states.items()})
                    verdict = decide_task(budget, spend, min(limit - running, left))
                    if verdict.start or verdict.refuse:
                        break
                time.sleep(poll_s)
            if verdict is not None and verdict.refuse:
                record_refusal(sweep_dir, number, verdict.reason)
                print(f"task {number}: not started, {verdict.reason}", flush=True)
                continue
            if verdict is not None:
                forget_refusal(sweep_dir, number)
                plan = replace(plan, budget=verdict.cap)
            done = submit(plan, registry=registry, existing_run_dir=run_dir)
            registry.add_sweep_task(sweep_id, number, done.job_id, task["params"])
            started.append(done.job_id)
            print(f"task {number}: job {done.job_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
