"""The handful of job states the orchestrator reasons about, whatever the scheduler.

Everything downstream -- the registry, ``status``, ``logs -f`` deciding when to stop, ``submit
--wait`` choosing an exit code -- only needs to know "is it waiting, running, coming back, or
finished, and how". Each scheduler maps its own states to these (Slurm's ~25 in one table:
:mod:`orchestrator.schedulers.slurm.states`; a local job's are read from its run directory).
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """The orchestrator's own job states (stored in the registry, printed by ``status``)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    REQUEUED = "REQUEUED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BUDGET = "BUDGET"
    """Stopped at a checkpoint by its ``--budget`` (not a scheduler's state): ``resume --budget MORE``."""
    UNKNOWN = "UNKNOWN"

    def is_terminal(self) -> bool:
        """True when the job will not run again by itself (``logs -f`` and ``--wait`` stop here).

        PREEMPTED counts as terminal: a job that Slurm (or submitit) requeues after preemption is
        reported as REQUEUED/PENDING again under the same id, so a *reported* PREEMPTED means the
        allocation ended for good. UNKNOWN is not terminal: it means "we could not tell", and
        stopping a follower on a transient scheduler hiccup would be wrong.
        """
        return self in TERMINAL_STATES

    def is_success(self) -> bool:
        """True only for COMPLETED; used to turn a final state into an exit code."""
        return self is JobState.COMPLETED

    def __str__(self) -> str:  # so f-strings print "RUNNING", not "JobState.RUNNING"
        return self.value


TERMINAL_STATES: frozenset[JobState] = frozenset(
    {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.PREEMPTED,
        JobState.NODE_FAIL,
        JobState.OUT_OF_MEMORY,
        JobState.BUDGET,
    }
)


def parse_state(name: str) -> JobState:
    """Parse one of *our* state names (as stored in the registry or typed after ``--state``).

    Raises ValueError with the list of valid names, which callers turn into a UserError.
    """
    key = name.strip().upper()
    try:
        return JobState(key)
    except ValueError:
        valid = ", ".join(s.value for s in JobState)
        raise ValueError(f"unknown state {name!r}; expected one of: {valid}") from None
