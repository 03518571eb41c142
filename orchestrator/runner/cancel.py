"""Cancelling a job, or sending it a signal.

The job's scheduler does it (:meth:`orchestrator.schedulers.base.Scheduler.cancel`): a cluster job
gets a bounded cancel request from its scheduler; local jobs a signal to every recorded process
group (SIGTERM by default; the node entry point relays it to the training ranks, which live in
sessions of their own).

Without a signal the job is being cancelled, which is recorded (registry end reason, and for
local jobs a ``cancel_requested.json`` marker so the run reads CANCELLED rather than FAILED). With
one (e.g. USR1 to ask for a checkpoint) only the signal is sent.
"""

from __future__ import annotations

import getpass
import os
import signal
import time
from contextlib import AbstractContextManager, nullcontext

from orchestrator.contract.errors import UserError
from orchestrator.registry.store import JobRecord, Registry


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


def cancel_job(registry: Registry, job: JobRecord, sig: signal.Signals | None) -> str:
    """Cancel (``sig`` None) or signal ``job``; the line to print. A job already over is a user error."""
    from orchestrator.runner.refresh import refresh_states
    from orchestrator.schedulers import get_scheduler

    asked = job.job_id
    newest = registry.run_of(asked).newest_job_id
    if newest != asked:
        # One name for the whole run: the run goes on in its newest job (a requeue as a new job, an
        # auto-resume, a resume), which is what is cancelled or signalled; this one has ended.
        job = registry.get(newest)
    st = refresh_states(registry, [job]).states.get(job.job_id)
    state = st.state if st is not None else job.last_state
    if state.is_terminal():
        what = "signal" if sig is not None else "cancel"
        raise UserError(f"job {job.job_id} already ended ({state.value}); nothing to {what}")
    message = get_scheduler(job.scheduler).cancel(job, sig, _user())
    if sig is None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        registry.set_end_reason(job.job_id, f"cancel requested by {_user()} at {stamp}")
    return (
        message if asked == job.job_id else f"job {asked}: the run continues as job {job.job_id}; {message}"
    )


def cancel_locked(registry: Registry, job_id: str, sig: signal.Signals | None) -> str:
    """:func:`cancel_job` under the run's lock (when its run directory is still there)."""
    from orchestrator.rundir.lock import RunLocked, run_lock

    job = registry.get(job_id)
    guard: AbstractContextManager[None] = (
        run_lock(job.run_dir, timeout_s=60.0, what=f"cancel {job.job_id}")
        if job.run_dir.is_dir()
        else nullcontext()
    )
    try:
        with guard:
            return cancel_job(registry, job, sig)
    except RunLocked as exc:
        raise UserError(f"job {job.job_id}: {exc}; try again when it is done") from None
