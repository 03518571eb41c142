"""``orchestrator logs JOB [-f] [--node N] [--rank R] [--tail K] [--attempt A]``.

Without ``-f``: print the selected logs of the newest attempt (or ``--attempt A``), all of it or
the last K lines per file. With ``-f``: print the last K lines (default 10) and keep printing new
lines, across requeues (new ``attempt_<A>`` folders) until the scheduler reports a terminal state;
the exit code is then the outcome (0 COMPLETED, 1 otherwise). A deleted run directory exits 1,
an attempt that never ran exits 2. The work is :func:`orchestrator.api.logs`.
"""

from __future__ import annotations

import argparse
import json
import sys

from orchestrator import api
from orchestrator.contract.errors import EXIT_OK, EXIT_RUN_FAILURE, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    parser.add_argument("--node", type=int, metavar="N", help="only node N's log")
    parser.add_argument(
        "--rank", type=int, metavar="R", help="only lines of global rank R (on its node's log)"
    )
    parser.add_argument("--tail", type=int, metavar="K", help="last K lines of each log")
    parser.add_argument("--attempt", type=int, metavar="A", help="attempt A (default: newest)")
    parser.add_argument(
        "--interval", type=float, default=0.25, metavar="S", help="fastest poll interval with -f"
    )
    # A laptop's `logs -f` through a login host (orchestrator.remote): one JSON record per line, and
    # the state a stream cut by a dropped connection continues from (core.logs.Resume).
    parser.add_argument("--framed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume-from", metavar="STATE", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.tail is not None and args.tail < 0:
        raise UserError(f"--tail {args.tail}: must be >= 0")
    if args.interval <= 0:
        raise UserError(f"--interval must be positive, not {args.interval}")
    resume_from = None
    if args.resume_from:
        try:
            resume_from = json.loads(args.resume_from)
        except ValueError:
            raise UserError(
                f"--resume-from: not the JSON state `logs -f --framed` writes: {args.resume_from!r}"
            ) from None
    state = api.logs(
        args.job,
        follow=args.follow,
        node=args.node,
        rank=args.rank,
        attempt=args.attempt,
        tail=args.tail,
        interval=args.interval,
        out=sys.stdout,
        err=sys.stderr,
        framed=args.framed and args.follow,
        resume_from=resume_from,
    )
    if state is None or state.is_success():
        return EXIT_OK
    print(f"job {args.job} ended {state.value}", file=sys.stderr)
    return EXIT_RUN_FAILURE
