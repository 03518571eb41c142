"""Following one job to its end (``submit --wait``): state plus training progress."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from orchestrator.contract.job_states import JobState


def progress_line(job_id: str, state: JobState, summary: Any) -> str:
    parts = [f"[{time.strftime('%H:%M:%S')}] job {job_id} {state.value}"]
    if summary is not None and summary.step is not None:
        total = f"/{summary.max_steps}" if summary.max_steps else ""
        parts.append(f"step {summary.step}{total}")
        if summary.loss is not None:
            parts.append(f"loss {summary.loss:.4f}")
        if summary.tokens_per_s:
            parts.append(f"{summary.tokens_per_s:,.0f} tok/s")
        if summary.eta_s is not None:
            parts.append(f"eta {summary.eta_s:.0f}s")
    return "  ".join(parts)


class WaitTimeout(Exception):
    """``deadline`` passed before the job ended; carries the last state seen."""

    def __init__(self, job_id: str, state: JobState) -> None:
        super().__init__(f"job {job_id} still {state.value}")
        self.job_id = job_id
        self.state = state


class NoCheckpoint(Exception):
    """A wait for a checkpoint (``until="checkpoint"``) saw the run end without a complete one;
    carries the job and its final state."""

    def __init__(self, job_id: str, state: JobState) -> None:
        super().__init__(f"job {job_id} ended {state.value} without a complete checkpoint")
        self.job_id = job_id
        self.state = state


#: What a wait can be for: the run's end, or its first complete checkpoint (``wait --for``).
WAIT_UNTIL = ("end", "checkpoint")


def follow_hint(job_id: str) -> str:
    """What to run next about a job that goes on without us."""
    return (
        f"follow it with `orchestrator wait {job_id}` (exit code = outcome), `orchestrator logs {job_id} -f` "
        f"or `orchestrator status {job_id} --watch`; stop it with `orchestrator cancel {job_id}`"
    )


def wait_for_job(
    registry: Any,
    job_id: str,
    poll_s: float = 2.0,
    out: TextIO = sys.stdout,
    deadline: float | None = None,
    until: str = "end",
) -> JobState:
    """Poll (one batched scheduler query per round) until the job's run is over, and return its state.

    A job that ends by handing its run to a new job (``--auto-resume`` after a lost node records the
    new job before the old one ends) is followed into that job: ``submit --wait`` answers for the
    run, not for the first job of it. A failed job is explained (failing node and rank, its first
    error lines, the ``logs`` command: :mod:`orchestrator.runner.failure_reasons`). ``deadline``
    (``time.monotonic()``) raises :class:`WaitTimeout` when passed.

    ``until="checkpoint"`` returns the job's state as soon as its run has a complete checkpoint (one
    an earlier job of the run wrote counts: it is what ``resume`` would continue from), with a line
    naming it; a run that ends without one raises :class:`NoCheckpoint`. A script that gets a
    preemption signal before its first checkpoint stops with nothing to resume from, so a stop meant
    to be resumed waits for this first."""
    from orchestrator.rundir.summary import summarize
    from orchestrator.runner.failure_reasons import EXPLAINED_STATES, explain_job, record_explanations
    from orchestrator.runner.refresh import refresh_states

    last = ""
    followed: set[str] = set()
    while True:
        job = registry.get(job_id)
        result = refresh_states(registry, [job])
        st = result.states.get(job_id)
        state = st.state if st is not None else job.last_state
        try:
            summary = summarize(job.run_dir)
        except Exception:  # a run directory being written: show the state alone
            summary = None
        line = progress_line(job_id, state, summary)
        if line.split("]", 1)[1] != last:
            print(line, file=out, flush=True)
            last = line.split("]", 1)[1]
        if until == "checkpoint" and summary is not None and summary.checkpoint is not None:
            saved = summary.checkpoint
            print(
                f"job {job_id} {state.value}: its run has a complete checkpoint, step {saved.step} "
                f"({saved.path.name})",
                file=out,
                flush=True,
            )
            return state
        if state.is_terminal():
            record_explanations(registry, [job], {job_id: state.value})
            ended = registry.get(job_id)
            successor = registry.successors([job_id]).get(job_id)
            explanation = explain_job(ended) if state.value in EXPLAINED_STATES else None
            why = ended.end_reason or (st.reason if st is not None else None)  # ours says more
            reason = f" ({why})" if why and explanation is None else ""
            print(
                f"job {job_id} ended {state.value}{reason}; run directory {job.run_dir}", file=out, flush=True
            )
            if explanation is not None:
                print(explanation.text(), file=out, flush=True)
            followed.add(job_id)
            successor = registry.successors([job_id]).get(job_id)
            if successor is None or successor in followed:
                if until == "checkpoint":
                    raise NoCheckpoint(job_id, state)
                return state
            print(f"the run continues as job {successor}; following it", file=out, flush=True)
            job_id, last = successor, ""
            continue
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(job_id, state)
        time.sleep(poll_s)
