"""Slurm's job states in one table, mapped to :class:`~orchestrator.contract.job_states.JobState`.

Slurm has ~25 job states (plus compact two-letter codes in ``squeue %t`` and decorated forms such as
``CANCELLED by 0`` or ``CANCELLED+`` from ``sacct``). Keeping the mapping in a single table means a
new Slurm state is a one-line change and a test can check that no state is forgotten.
"""

from __future__ import annotations

import re
from functools import lru_cache

from orchestrator.contract.job_states import JobState

#: Every Slurm job state (``squeue %T`` / ``sacct State``) mapped to ours, with the reason when the
#: choice is not obvious. Slurm 22.05 ``slurm.h`` job_states + state flags that squeue prints as states.
SLURM_STATE_MAP: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    # Nodes allocated but still booting: no user code runs yet.
    "CONFIGURING": JobState.PENDING,
    # Held after its reservation was deleted: waits for an admin, not terminal.
    "RESV_DEL_HOLD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    # Allocation changing size: still running.
    "RESIZING": JobState.RUNNING,
    # Allocation held but execution paused (suspend / SIGSTOP): not finished, will continue.
    "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    # Slurm is delivering a signal to the job: still running.
    "SIGNALING": JobState.RUNNING,
    # Processes finished, epilog / burst-buffer stage-out still running: the exit code is not final
    # yet, so it is not COMPLETED or FAILED until Slurm says so.
    "COMPLETING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "REQUEUED": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED,
    "COMPLETED": JobState.COMPLETED,
    "CANCELLED": JobState.CANCELLED,
    # A federated sibling was revoked because another cluster ran the job: gone from here.
    "REVOKED": JobState.CANCELLED,
    "FAILED": JobState.FAILED,
    # Requeued into a held "special exit" state by an epilog because of its exit value: it needs a
    # human, so treat it as a failure rather than something that will resume on its own.
    "SPECIAL_EXIT": JobState.FAILED,
    "TIMEOUT": JobState.TIMEOUT,
    # Killed at its --deadline: a time limit by another name.
    "DEADLINE": JobState.TIMEOUT,
    "PREEMPTED": JobState.PREEMPTED,
    "NODE_FAIL": JobState.NODE_FAIL,
    # Nodes failed to boot: a node failure from the user's point of view.
    "BOOT_FAIL": JobState.NODE_FAIL,
    "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
    "UNKNOWN": JobState.UNKNOWN,
}

#: ``squeue %t`` compact codes -> long state names, so either output format parses.
SLURM_COMPACT_CODES: dict[str, str] = {
    "PD": "PENDING",
    "CF": "CONFIGURING",
    "RD": "RESV_DEL_HOLD",
    "R": "RUNNING",
    "RS": "RESIZING",
    "S": "SUSPENDED",
    "ST": "STOPPED",
    "SI": "SIGNALING",
    "CG": "COMPLETING",
    "SO": "STAGE_OUT",
    "RQ": "REQUEUED",
    "RH": "REQUEUE_HOLD",
    "RF": "REQUEUE_FED",
    "CD": "COMPLETED",
    "CA": "CANCELLED",
    "RV": "REVOKED",
    "F": "FAILED",
    "SE": "SPECIAL_EXIT",
    "TO": "TIMEOUT",
    "DL": "DEADLINE",
    "PR": "PREEMPTED",
    "NF": "NODE_FAIL",
    "BF": "BOOT_FAIL",
    "OOM": "OUT_OF_MEMORY",
}

_DECORATION = re.compile(r"[+\s].*$")


@lru_cache(maxsize=512)  # a handful of distinct strings, asked once per job per status call
def normalize_slurm_state(raw: str) -> str:
    """Strip what sacct/squeue add around a state name.

    ``CANCELLED by 1234`` (who cancelled), ``CANCELLED+`` (sacct truncation marker), lower case and
    compact codes all reduce to the long upper-case name so one table lookup suffices.
    """
    text = raw.strip().upper()
    text = _DECORATION.sub("", text)
    return SLURM_COMPACT_CODES.get(text, text)


@lru_cache(maxsize=512)
def from_slurm(raw: str) -> JobState:
    """Map a raw Slurm state string to a :class:`JobState`; anything unrecognised is UNKNOWN.

    Unknown strings do not raise: a newer Slurm adding a state must not break ``status``.
    """
    return SLURM_STATE_MAP.get(normalize_slurm_state(raw), JobState.UNKNOWN)


def is_terminal(state: JobState | str) -> bool:
    """Convenience for callers holding a raw string (ours or Slurm's)."""
    if isinstance(state, JobState):
        return state.is_terminal()
    key = state.strip().upper()
    if key in JobState.__members__:
        return JobState(key).is_terminal()
    return from_slurm(state).is_terminal()
