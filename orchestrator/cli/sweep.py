"""``orchestrator sweep``: a grid of runs as one job array (Slurm ``--array=0-N%K``).

``--grid lr=1e-3,3e-4 --grid seed=0,1 -- script.py --lr {lr} --seed {seed}`` submits one task per
grid point, each a job of its own (own run directory, requeue and resume), at most ``--max-parallel``
running at once. Prints the sweep id (the array's), and a line per task. ``--budget X`` (or the
profile's ``budget``) is one budget for the whole sweep (:mod:`orchestrator.config.sweep_budget`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.cli.plan_args import add_plan_arguments, plan_from_args, positive_int
from orchestrator.contract.errors import EXIT_OK, UserError

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="one axis of the grid; the script's arguments name its value as {NAME} (repeatable)",
    )
    parser.add_argument(
        "--file", default=None, metavar="SWEEP.yaml", help="the grid (and max_parallel) from a YAML file"
    )
    parser.add_argument(
        "--max-parallel",
        type=positive_int,
        default=None,
        metavar="K",
        help="tasks running at once (default: all)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the job array's script; submit nothing")
    parser.add_argument(
        "--wait",
        action="store_true",
        help="follow the sweep to its end; exit 0 when every task completed, 1 otherwise (as `wait SWEEP`)",
    )
    add_plan_arguments(parser, script_required=True)


def run(args: argparse.Namespace) -> int:
    from orchestrator import api
    from orchestrator.config.sweep_plan import grid_from_yaml, parse_grid

    grid = parse_grid(args.grid)
    max_parallel = args.max_parallel
    if args.file:
        file_grid, rest = grid_from_yaml(Path(args.file))
        clash = sorted(set(file_grid) & set(grid))
        if clash:
            raise UserError(f"--grid {clash[0]}: also in --file {args.file}; give each axis once")
        grid = {**file_grid, **grid}
        max_parallel = max_parallel or rest.get("max_parallel")
    if not grid:
        raise UserError("no grid: add --grid NAME=V1,V2,... (or --file SWEEP.yaml)")
    base = plan_from_args(args)
    if args.dry_run:
        request, points = api.dry_run_sweep(base, grid, max_parallel)
        if request is not None:
            print(f"==> {request.file_name} <==")
            print(request.materialize().rstrip("\n"))
            print()
        for i, (_params, plan) in enumerate(points):
            print(f"task {i}: {' '.join([plan.script, *plan.script_args])}")
        if base.budget is not None:
            print(f"# {_budget_words(base)}")
        where = f"; sweep directory would be {request.run_dir}" if request is not None else ""
        print(f"# dry run: nothing submitted ({len(points)} tasks{where})")
        return EXIT_OK
    done = api.submit_sweep_plan(base, grid, max_parallel)
    count = 1
    for values in grid.values():
        count *= len(values)
    print(f"submitted sweep {done.sweep_id} ({count} tasks)")
    print(f"sweep directory {done.sweep_dir}")
    record = api.get_sweep_record(done.sweep_id)
    if base.budget is not None:
        print(_budget_words(base))
    for task in record.tasks:
        point = " ".join(f"{k}={v}" for k, v in task.params.items())
        print(f"task {task.task}: job {task.job_id}  {point}")
    if not record.tasks:
        print(
            f"tasks start {max_parallel or 'all'} at a time, submitted from this machine "
            f"(see `orchestrator status {done.sweep_id}`)"
        )
    print(f"next: `orchestrator status {done.sweep_id}` (a line per task and the best one)")
    sys.stdout.flush()
    if args.wait:
        from orchestrator.cli.wait import wait_sweep

        return wait_sweep(done.sweep_id, 2.0, None)
    return EXIT_OK


def _budget_words(base: LaunchPlan) -> str:
    """How the sweep's one budget is shared out (:mod:`orchestrator.config.sweep_budget`)."""
    return (
        f"budget {base.budget} for the whole sweep: a job per task, each capped as it starts; a task "
        "the rest cannot cover at the tasks' measured cost is not started (status shows it BUDGET)"
    )
