"""``orchestrator cancel JOB [--signal SIG]``.

Slurm jobs: ``scancel [--signal=SIG] <id>`` (bounded in time). Local jobs: signal the process group
of every node process recorded in ``<run_dir>/local_pids.json`` (SIGTERM by default; the node entry
point relays it to the training ranks, which live in sessions of their own).

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

from orchestrator.errors import RunFailure, UserError
from orchestrator.registry import JobRecord, Registry
from orchestrator.run_dir import local_state, read_local_pids, write_cancel_marker
from orchestrator.scheduler_query import run_bounded

SCANCEL_TIMEOUT_S = 30.0


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


def cancel_slurm(job: JobRecord, sig: signal.Signals | None) -> str:
    argv = ["scancel"]
    if sig is None:
        # Scancel sends SIGTERM first, which training cannot tell from a preemption: the
        # marker tells the node entry point not to requeue a job the user cancelled.
        try:
            write_cancel_marker(job.run_dir, "CANCEL", _user())
        except OSError:
            pass  # run directory gone: nothing left that could requeue it
    if sig is not None:
        argv.append(f"--signal={sig.name.removeprefix('SIG')}")
    argv.append(job.job_id)
    res = run_bounded(argv, SCANCEL_TIMEOUT_S)
    if res.error is not None:
        raise RunFailure(f"scancel of job {job.job_id} failed: {res.error}")
    return f"sent {sig.name} to job {job.job_id}" if sig else f"cancel requested for job {job.job_id}"


def cancel_local(job: JobRecord, sig: signal.Signals | None) -> str:
    pids = read_local_pids(job.run_dir)
    state = local_state(job.run_dir)
    if not state.alive_pids:
        if state.state.is_terminal():
            raise RunFailure(f"job {job.job_id} has already ended ({state.state}); nothing to cancel")
        if not pids:
            raise RunFailure(
                f"job {job.job_id} has no running processes yet ({job.run_dir / 'local_pids.json'} missing)"
            )
    send = sig or signal.SIGTERM
    if sig is None:
        # Marker first: if the processes die before we return, status must already say CANCELLED.
        write_cancel_marker(job.run_dir, send.name, _user())
    sent = 0
    for pid in state.alive_pids:
        try:
            sent += signal_local_process(pid, send)
        except PermissionError as exc:
            raise RunFailure(f"cannot signal pid {pid} of job {job.job_id}: {exc.strerror}") from None
    if sent == 0:
        raise RunFailure(f"job {job.job_id}: none of its processes {sorted(pids.values())} is alive")
    return f"sent {send.name} to {sent} process(es) of job {job.job_id}"


def signal_local_process(pid: int, sig: signal.Signals) -> int:
    """Deliver ``sig`` to one recorded local process; returns how many processes were signalled.

    A process-group leader (the contract for ``local_pids.json``) gets the signal on its whole
    group. A pid that is not a group leader is treated as a supervisor such as submitit's local
    controller, which forwards only SIGTERM to its tasks and would simply die of SIGUSR1: it gets
    TERM/INT itself, any other signal goes to its direct children (the node entry points, which
    relay it to the training ranks). SIGKILL cannot be relayed by anyone, so it goes to the whole
    process tree -- torchrun's workers live in sessions of their own and would otherwise survive.
    """
    import psutil

    try:
        leader = os.getpgid(pid) == pid and pid != os.getpgrp()
        proc = psutil.Process(pid)
        tree = proc.children(recursive=True) if sig == signal.SIGKILL else []
    except (ProcessLookupError, psutil.NoSuchProcess):
        return 0
    targets: list[psutil.Process]
    if leader:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return 0
        targets = tree
        count = 1
    else:
        if sig == signal.SIGKILL:
            targets = [proc, *tree]
        elif sig in (signal.SIGTERM, signal.SIGINT):
            targets = [proc]
        else:
            targets = proc.children(recursive=False) or [proc]
        count = 0
    for target in targets:
        try:
            target.send_signal(sig)
            count += 1
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            raise PermissionError(1, f"not allowed to signal pid {target.pid}") from None
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("--signal", metavar="SIG", help="send SIG (e.g. USR1, TERM) instead of cancelling")


def run(args: argparse.Namespace) -> int:
    sig = parse_signal(args.signal) if args.signal else None
    with Registry.open() as registry:
        job = registry.get(args.job)
        successor = registry.successors([job.job_id]).get(job.job_id)
        if successor is not None:
            # Its run directory belongs to the new job now: a cancel marker written there would stop
            # that job from requeueing after a preemption.
            raise UserError(
                f"job {job.job_id}: its run continues as job {successor}; cancel that one "
                f"(orchestrator cancel {successor})"
            )
        message = cancel_slurm(job, sig) if job.scheduler == "slurm" else cancel_local(job, sig)
        if sig is None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            registry.set_end_reason(job.job_id, f"cancel requested by {_user()} at {stamp}")
    print(message)
    return 0
