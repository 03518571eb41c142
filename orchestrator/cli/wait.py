"""``orchestrator wait JOB [--poll S] [--timeout S] [--for end|checkpoint]``: follow a submitted job to
its end, or until its run has a complete checkpoint.

What ``submit --wait`` does, for a job submitted without it (or one whose ``--wait`` was
interrupted): progress lines, then how it ended and, for a failure, why (the failing node and
rank, its first error lines, the ``logs`` command). The exit code is the outcome: 0 COMPLETED,
1 anything else (a run continued as another job answers for that job), 124 ``--timeout`` passed
with the job still going, 130 interrupted (the job goes on).
"""

from __future__ import annotations

import argparse
import sys

from orchestrator import api
from orchestrator.config.inputs import seconds
from orchestrator.contract.errors import EXIT_OK, EXIT_RUN_FAILURE, UserError

EXIT_WAIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id, or a sweep's id (every task)")
    parser.add_argument(
        "--poll", type=float, default=2.0, metavar="S", help="seconds between updates (default 2)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"give up after S seconds, exit {EXIT_WAIT_TIMEOUT} (default: wait for the end)",
    )
    parser.add_argument(
        "--for",
        dest="until",
        choices=api.WAIT_UNTIL,
        default="end",
        help="end (default): until the job's run is over, exit 0 when it COMPLETED; checkpoint: until "
        "its run has a complete checkpoint, exit 0 (the job goes on), exit 1 if it ended without one",
    )


def run(args: argparse.Namespace) -> int:
    seconds("--poll", args.poll, optional=False)  # nan, inf, 0 and negatives: the API's one check
    seconds("--timeout", args.timeout)
    if api.find_sweep(args.job) is not None:
        if args.until != "end":
            raise UserError(f"wait --for {args.until}: {args.job} is a sweep; wait for one of its jobs")
        return wait_sweep(args.job, args.poll, args.timeout)
    try:
        # an unknown id: one line, exit 2
        state = api.wait(args.job, poll=args.poll, timeout=args.timeout, out=sys.stdout, until=args.until)
    except api.NoCheckpoint as exc:
        print(str(exc), file=sys.stderr)  # "job J ended STATE without a complete checkpoint"
        return EXIT_RUN_FAILURE
    except api.WaitTimeout as exc:
        print(
            f"job {exc.job_id} still {exc.state.value} after {args.timeout:g} s; {api.follow_hint(exc.job_id)}",
            file=sys.stderr,
        )
        return EXIT_WAIT_TIMEOUT
    except KeyboardInterrupt:
        print(f"\ninterrupted: job {args.job} goes on; {api.follow_hint(args.job)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.until == "checkpoint":
        return EXIT_OK  # the run has a complete checkpoint (the line above says which)
    return EXIT_OK if state.is_success() else EXIT_RUN_FAILURE


def wait_sweep(sweep_id: str, poll: float, timeout: float | None) -> int:
    """``wait SWEEP`` and ``sweep --wait``: 0 when every task's run COMPLETED, 1 otherwise, 124 after
    ``timeout`` with tasks still going, 130 interrupted (the sweep goes on)."""
    try:
        state = api.wait_sweep(sweep_id, poll=poll, timeout=timeout, out=sys.stdout)
    except api.WaitTimeout:
        print(
            f"sweep {sweep_id} still running after {timeout:g} s; follow it with "
            f"`orchestrator wait {sweep_id}` or `orchestrator status {sweep_id}`",
            file=sys.stderr,
        )
        return EXIT_WAIT_TIMEOUT
    except KeyboardInterrupt:
        print(f"\ninterrupted: sweep {sweep_id} goes on; `orchestrator status {sweep_id}`", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"sweep {sweep_id} ended {state.value}; `orchestrator status {sweep_id}` shows every task")
    return EXIT_OK if state.is_success() else EXIT_RUN_FAILURE
