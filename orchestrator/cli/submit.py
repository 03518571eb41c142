"""``orchestrator submit``: validate, submit, print the job id and run directory at once."""

from __future__ import annotations

import argparse
import sys

from orchestrator import api
from orchestrator.cli.plan_args import add_plan_arguments, plan_from_args, positive_float
from orchestrator.contract import start_estimates
from orchestrator.contract.errors import EXIT_OK, EXIT_RUN_FAILURE

#: What a shell reports for a command ended by Ctrl-C.
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be submitted; submit nothing"
    )
    parser.add_argument(
        "--test-only",
        action="store_true",
        help="ask the scheduler when the job would start (Slurm: sbatch --test-only); submit nothing",
    )
    parser.add_argument("--wait", action="store_true", help="follow progress to the end; exit code = outcome")
    parser.add_argument(
        "--snapshot", action="store_true", help="copy the script's folder into the run directory"
    )
    parser.add_argument(
        "--poll", type=positive_float, default=2.0, help="seconds between progress updates with --wait"
    )
    add_plan_arguments(parser, script_required=True)


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    if args.dry_run:
        request = api.dry_run(plan)
        files = api.render_files(request.plan, None, sys.executable)
        if request.file_name:
            # The request itself, byte for byte what `submit` hands to the scheduler for this run directory.
            files[request.file_name] = request.materialize()
        for name, text in files.items():
            print(f"==> {name} <==")
            print(text.rstrip("\n"))
            print()
        print(
            f"# dry run: nothing submitted ({plan.nodes} node(s) x {plan.procs_per_node} = {plan.world_size} ranks; "
            f"run directory would be {request.run_dir})"
        )
        return EXIT_OK
    if args.test_only:
        estimate = api.start_estimate(plan)
        print(
            f"start estimate: {estimate}"
            if estimate
            else "start estimate: none (this scheduler starts jobs at once)"
        )
        print("# test only: nothing submitted")
        return EXIT_OK
    registry = api.open_registry()
    submitted = api.submit_plan(plan, snapshot=args.snapshot, registry=registry)
    print(f"submitted job {submitted.job_id}")
    print(f"run directory {submitted.run_dir}")
    said = start_estimates.read(submitted.run_dir).get(submitted.job_id)
    if said:  # asked just before the submission: the scheduler's word on when it starts
        print(f"start estimate: {said['estimate']} (the scheduler's, at submission)")
    if not args.wait:
        print(f"next: {api.follow_hint(submitted.job_id)}")
        sys.stdout.flush()
        return EXIT_OK
    sys.stdout.flush()
    try:
        state = api.wait(submitted.job_id, poll=args.poll, out=sys.stdout, registry=registry)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: job {submitted.job_id} goes on; {api.follow_hint(submitted.job_id)}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    return EXIT_OK if state.is_success() else EXIT_RUN_FAILURE
