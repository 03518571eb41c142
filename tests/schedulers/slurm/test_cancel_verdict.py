"""A cancel told from a preemption by what Slurm says of the job when its SIGTERM arrives.

The rows are those measured on the test cluster (Slurm 22.05): ``scontrol show job -o`` lines cut to
the fields that matter (the real line has ~60 more), and sacct's ``State`` as ``-P`` prints it.
"""

from __future__ import annotations

import pytest

from orchestrator.schedulers.slurm.cancel_verdict import cancel_verdict, parse_view

SCANCEL = "JobId=7 JobName=run JobState=COMPLETING Reason=None Dependency=(null) PreemptEligibleTime=2026-11-29T09:36:28 PreemptTime=None Partition=debug"
TIME_LIMIT = "JobId=8 JobName=run JobState=COMPLETING Reason=TimeLimit Dependency=(null) PreemptTime=None"
GRACE = "JobId=9 JobName=run JobState=RUNNING Reason=None EndTime=2026-11-29T09:37:00 PreemptTime=2026-11-29T09:36:30"
REQUEUE_MODE = "JobId=10 JobName=run JobState=COMPLETING Reason=None Restarts=1 PreemptTime=None"


@pytest.mark.parametrize(
    ("line", "sacct", "cancelled"),
    [
        (SCANCEL, "CANCELLED by 0", "Slurm's accounting says CANCELLED by 0"),
        (TIME_LIMIT, "TIMEOUT", None),
        (GRACE, "PENDING", None),  # accounting lags: the preemption's grace is RUNNING in scontrol
        (GRACE, None, None),
        (REQUEUE_MODE, "PREEMPTED", None),
        (TIME_LIMIT, None, None),  # no accounting: the reason names the time limit
        ("JobId=11 JobState=CANCELLED Reason=None PreemptTime=None", None, "Slurm reports the job CANCELLED"),
        ("", "RUNNING", None),  # scontrol does not know the job (gone): nothing says cancelled
    ],
    ids=["scancel", "time-limit", "grace", "grace-no-acct", "requeue-mode", "time-limit-no-acct",
         "cancelled", "unknown"],
)  # fmt: skip
def test_what_slurm_says_decides_a_cancel(line: str, sacct: str | None, cancelled: str | None) -> None:
    verdict = cancel_verdict(parse_view(line, sacct), patient=True)
    assert verdict.settled
    assert verdict.cancelled == cancelled


def test_a_completing_job_accounting_has_not_recorded_is_asked_again_then_judged_by_scontrol() -> None:
    """Accounting lags slurmctld: while it has no end for the job, ask again; once out of patience, a
    job Slurm ends for no reason it names, unpreempted, is a cancel (and says why it was judged so)."""
    for lagging in ("", "RUNNING"):
        view = parse_view(SCANCEL, lagging)
        assert not cancel_verdict(view, patient=True).settled
        late = cancel_verdict(view, patient=False)
        assert (
            late.settled and late.cancelled is not None and "accounting has no record yet" in late.cancelled
        )
    # without accounting at all there is nothing to wait for
    now = cancel_verdict(parse_view(SCANCEL, None), patient=True)
    assert now.settled and now.cancelled is not None and "no accounting to ask" in now.cancelled
    # a job being preempted (PreemptTime set) is never taken for a cancel
    preempting = SCANCEL.replace("PreemptTime=None", "PreemptTime=2026-11-29T09:36:30")
    assert cancel_verdict(parse_view(preempting, None), patient=False).cancelled is None


def test_a_requeue_slurm_already_counts_is_left_to_slurm() -> None:
    """PreemptMode=REQUEUE (or an admin's scontrol requeue): Slurm's Restarts already counts the
    requeue when the SIGTERM arrives; node 0 must not requeue again nor hand over to a successor."""
    from orchestrator.schedulers.slurm.cancel_verdict import requeued_by_slurm

    view = parse_view(REQUEUE_MODE, "PREEMPTED")
    assert view.restarts == 1
    why = requeued_by_slurm(view, own_restarts=0)
    assert why is not None and "Restarts is 1, this attempt started at 0" in why
    assert requeued_by_slurm(view, own_restarts=1) is None  # the attempt Slurm's requeue started
    assert requeued_by_slurm(parse_view(GRACE, "RUNNING"), own_restarts=0) is None  # no Restarts said
    assert requeued_by_slurm(parse_view(SCANCEL.replace("JobId=7", "JobId=7 Restarts=0"), None), 0) is None
