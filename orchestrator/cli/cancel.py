"""``orchestrator cancel JOB [--signal SIG]``.

The job's scheduler does it (:meth:`orchestrator.schedulers.base.Scheduler.cancel`): Slurm jobs get a
bounded ``scancel [--signal=SIG]``; local jobs a signal to every recorded process group (SIGTERM by
default; the node entry point relays it to the training ranks, which live in sessions of their own).

Without ``--signal`` the job is being cancelled, which is recorded (registry end reason, and for
local jobs a ``cancel_requested.json`` marker so the run reads CANCELLED rather than FAILED). With
``--signal`` (e.g. USR1 to ask for a checkpoint) only the signal is sent.
"""

from __future__ import annotations

import argparse
import getpass
import os
import signal
import time

from orchestrator.contract.errors import UserError
from orchestrator.registry.store import JobRecord, Registry
from orchestrator.schedulers import get_scheduler


def parse_signal(text: str) -> signal.Signals:
    """``TERM``, ``SIGTERM``, ``term`` or ``15`` -> ``signal.SIGTERM``; anything else is a user error."""
    t = text.strip().upper()
    try:
        if t.isdigit():
            return signal.Signals(int(t))
        return signal.Signals[t if t.startswith("SIG") else f"SIG{t}"]
    except (KeyError, ValueError):
        raise UserError(f"--signal {text!r}: not a signal name or number (e.g. TERM, USR1, 10)") from None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("--signal", metavar="SIG", help="send SIG (e.g. USR1, TERM) instead of cancelling")


def run(args: argparse.Namespace) -> int:
    from orchestrator import api

    sig = parse_signal(args.signal) if args.signal else None
    print(api.cancel(args.job, sig))
    return 0


def cancel_job(registry: Registry, job: JobRecord, sig: signal.Signals | None) -> str:
    from orchestrator.core.refresh import refresh_states

    successor = registry.run_of(job.job_id).newest_job_id
    if successor != job.job_id:
        # Its run directory belongs to the new job now: a cancel marker written there would stop
        # that job from requeueing after a preemption.
        raise UserError(
            f"job {job.job_id}: its run continues as job {successor}; cancel that one "
            f"(orchestrator cancel {successor})"
        )
    st = refresh_states(registry, [job]).states.get(job.job_id)
    state = st.state if st is not None else job.last_state
    if state.is_terminal():
        what = "signal" if sig is not None else "cancel"
        raise UserError(f"job {job.job_id} already ended ({state.value}); nothing to {what}")
    message = get_scheduler(job.scheduler).cancel(job, sig, _user())
    if sig is None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        registry.set_end_reason(job.job_id, f"cancel requested by {_user()} at {stamp}")
    return message
