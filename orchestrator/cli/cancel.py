"""``orchestrator cancel JOB [--signal SIG]``.

The job's scheduler does it (:func:`orchestrator.api.cancel`): a cluster job gets a bounded cancel
request; local jobs a signal to every recorded process group (SIGTERM by default; the node entry
point relays it to the training ranks, which live in sessions of their own).

Without ``--signal`` the job is being cancelled, which is recorded (registry end reason, and for
local jobs a ``cancel_requested.json`` marker so the run reads CANCELLED rather than FAILED). With
``--signal`` (e.g. USR1 to ask for a checkpoint) only the signal is sent.
"""

from __future__ import annotations

import argparse

from orchestrator import api


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("--signal", metavar="SIG", help="send SIG (e.g. USR1, TERM) instead of cancelling")


def run(args: argparse.Namespace) -> int:
    print(api.cancel(args.job, args.signal or None))
    return 0
