"""Was this job cancelled? Asked by the job itself after a stop signal, from what Slurm says of it.

A plain ``scancel`` sends SIGTERM, which training handles like a preemption: it saves a checkpoint
and asks to come back. Node 0 must then tell a cancel (stay ended) from a preemption (requeue).
``squeue``'s state alone cannot: a cancelled job is COMPLETING until its processes are gone, and
node 0 is one of them. What a job sees when the SIGTERM arrives, measured on Slurm 22.05
(``tests/cluster``, 2026-11-29):

==========================================  ===============  ===============  ===========  ==============
what ended it                               scontrol state   scontrol Reason  PreemptTime  sacct State
==========================================  ===============  ===============  ===========  ==============
plain ``scancel``                           COMPLETING       None             none         CANCELLED by 0
the time limit                              COMPLETING       TimeLimit        none         (TIMEOUT)
preemption, ``PreemptMode=CANCEL`` + grace  RUNNING          None             set          PENDING/RUNNING
preemption, ``PreemptMode=REQUEUE``         COMPLETING       None             none         PREEMPTED
==========================================  ===============  ===============  ===========  ==============

In the last row Slurm requeues the job itself, and its ``Restarts`` already counts it when the
SIGTERM arrives (1 in a job whose ``SLURM_RESTART_COUNT`` is 0; ``scontrol requeue`` by an admin
the same): node 0 must then neither requeue it again nor hand over to a successor job
(:func:`requeued_by_slurm`), or the run would come back twice.

So accounting (``sacct``) is asked first: it names the cancel. It lags slurmctld (above, a job two
seconds into its run was still PENDING there), so a COMPLETING job whose record does not yet say
how it ended is asked again for a while. Without accounting, a COMPLETING job that Slurm gives no
reason for and did not preempt is taken as cancelled: a job that stops when its user cancelled it
is worth more than the one case this misjudges (``PreemptMode=CANCEL`` without a grace time on a
cluster without accounting), which then stays ended instead of coming back.

Pure: the commands are run by :func:`orchestrator.schedulers.slurm.environment.cancelled_by_user`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: sacct's states of a job that ended for good for a reason other than a cancel.
ENDED_NOT_CANCELLED = (
    "PREEMPTED",
    "TIMEOUT",
    "NODE_FAIL",
    "FAILED",
    "REQUEUED",
    "COMPLETED",
    "OUT_OF_MEMORY",
    "DEADLINE",
    "BOOT_FAIL",
)


@dataclass(frozen=True)
class SlurmView:
    """What Slurm says of one job, from inside it."""

    #: ``scontrol show job``'s JobState ("" when it does not know the job).
    state: str
    #: Its Reason ("None" when Slurm gives none).
    reason: str
    #: Whether its PreemptTime is set: Slurm started preempting it.
    preempted: bool
    #: sacct's State (e.g. ``CANCELLED by 0``); None when accounting cannot be asked, "" when it has
    #: no record of the job yet.
    accounting: str | None
    #: scontrol's Restarts: how often Slurm requeued the job, this time included (None: not said).
    restarts: int | None = None


@dataclass(frozen=True)
class CancelVerdict:
    #: Why the job counts as cancelled; None when it does not.
    cancelled: str | None
    #: False while accounting may still be catching up: ask again.
    settled: bool = True


def _field(line: str, key: str) -> str:
    found = re.search(rf"(?:^|\s){key}=(\S*)", line)
    return found.group(1) if found else ""


def parse_view(scontrol_line: str, sacct_state: str | None) -> SlurmView:
    """The view from ``scontrol show job -o JOB`` (one line) and sacct's State (None: no accounting)."""
    preempt_time = _field(scontrol_line, "PreemptTime")
    return SlurmView(
        state=_field(scontrol_line, "JobState"),
        reason=_field(scontrol_line, "Reason") or "None",
        preempted=preempt_time not in ("", "None", "Unknown"),
        accounting=None if sacct_state is None else sacct_state.strip(),
        restarts=int(restarts) if (restarts := _field(scontrol_line, "Restarts")).isdigit() else None,
    )


def requeued_by_slurm(view: SlurmView, own_restarts: int) -> str | None:
    """Why node 0 must leave the requeue to Slurm: Slurm counts a requeue this attempt has not
    started from (``own_restarts``: its ``SLURM_RESTART_COUNT``). None otherwise."""
    if view.restarts is None or view.restarts <= own_restarts:
        return None
    return (
        f"Slurm requeues the job itself (its Restarts is {view.restarts}, this attempt started at "
        f"{own_restarts}: a preemption with PreemptMode=REQUEUE, or scontrol requeue)"
    )


def cancel_verdict(view: SlurmView, patient: bool) -> CancelVerdict:
    """Whether ``view`` is a cancelled job. ``patient``: accounting may still be waited for."""
    if view.accounting is not None and view.accounting.startswith("CANCELLED"):
        return CancelVerdict(f"Slurm's accounting says {view.accounting}")
    if view.state.startswith("CANCELLED"):
        return CancelVerdict("Slurm reports the job CANCELLED")
    if view.state != "COMPLETING":
        # RUNNING: a preemption's grace time or a warning signal; PENDING: already requeued.
        return CancelVerdict(None)
    if view.accounting is not None and view.accounting.startswith(ENDED_NOT_CANCELLED):
        return CancelVerdict(None)
    if view.accounting is not None and patient:
        return CancelVerdict(None, settled=False)
    if view.reason == "None" and not view.preempted:
        source = "no accounting to ask" if view.accounting is None else "accounting has no record yet"
        return CancelVerdict(
            f"Slurm is ending the job (COMPLETING) for no reason it names and did not preempt it: "
            f"a cancel ({source})"
        )
    return CancelVerdict(None)
