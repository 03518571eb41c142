"""``orchestrator resume JOB``: a new attempt from the job's last complete checkpoint.

The new attempt shares the run directory (checkpoints, metrics, logs continue)
and may use another node count, strategy or profile, as long as the checkpoint
can be resharded into it: DCP sharded checkpoints load at any world size and
between FSDP1 and FSDP2, but a ddp checkpoint (a full model state dict) and an
FSDP one (sharded folders) are not interchangeable.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from orchestrator import api
from orchestrator.config.strategies import STRATEGIES

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from orchestrator.cli.plan_args import positive_float, positive_int

    parser.add_argument("job_id", metavar="JOB", help="a job id, or a sweep id with --failed")
    parser.add_argument(
        "--failed", action="store_true", help="JOB is a sweep: resume each task that did not complete"
    )
    parser.add_argument("--nodes", type=positive_int, default=None, help="default: as before")
    parser.add_argument("--procs-per-node", type=positive_int, default=None, help="default: as before")
    parser.add_argument("--strategy", choices=list(STRATEGIES), default=None, help="default: as before")
    parser.add_argument("--profile", default=None, help="default: as before")
    parser.add_argument("--profiles-dir", default=None)
    parser.add_argument(
        "--budget",
        default=None,
        metavar="AMOUNT",
        help="the run's new spending cap over all its attempts (earlier ones included): 200gpu-h, "
        "0.5cpu-h or 500usd; default: as before",
    )
    parser.add_argument("--wait", action="store_true", help="follow the new attempt to its end")
    parser.add_argument("--poll", type=positive_float, default=2.0, help="seconds between progress updates")


def resume_plan(previous: LaunchPlan, args: argparse.Namespace) -> LaunchPlan:
    """The plan a resume with these flags submits (:func:`orchestrator.api.resume_plan`)."""
    return api.resume_plan(
        previous,
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        strategy=args.strategy,
        profile=args.profile,
        profiles_dir=args.profiles_dir,
        budget=args.budget,
    )


def run(args: argparse.Namespace) -> int:
    if args.failed:
        return _resume_failed_tasks(args)
    job, lines = api.resume(
        args.job_id,
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        strategy=args.strategy,
        profile=args.profile,
        profiles_dir=args.profiles_dir,
        budget=args.budget,
    )
    for line in lines:
        print(line)
    sys.stdout.flush()
    if not args.wait:
        return 0
    state = api.wait(job.job_id, poll=args.poll, out=sys.stdout)
    return 0 if state.is_success() else 1


def _resume_failed_tasks(args: argparse.Namespace) -> int:
    """Exit 0 when every failed task was resumed (or none had failed), 1 when one could not be."""
    sweep = api.get_sweep(args.job_id)
    done = sweep.resume_failed(
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        strategy=args.strategy,
        profile=args.profile,
        profiles_dir=args.profiles_dir,
        budget=args.budget,
    )
    for _task, _job, lines in done:
        for line in lines:
            print(line)
    if not done:
        print(f"sweep {sweep.sweep_id}: no task ended other than COMPLETED; nothing to resume")
    failed = [t for t, job, lines in done if job is None and any(api.NOT_RESUMED in line for line in lines)]
    return 1 if failed else 0
