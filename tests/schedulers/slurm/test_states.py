"""The Slurm -> orchestrator state table: every Slurm state is mapped, terminal-ness is right."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.contract.job_states import TERMINAL_STATES, JobState, parse_state
from orchestrator.schedulers.slurm.states import (
    SLURM_COMPACT_CODES,
    SLURM_STATE_MAP,
    from_slurm,
    is_terminal,
    normalize_slurm_state,
)

# Every state Slurm 22.05 can report for a job (squeue %T / sacct State), with the state we expect.
EXPECTED = {
    "PENDING": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "REQUEUED": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED,
    "RESIZING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "COMPLETED": JobState.COMPLETED,
    "CANCELLED": JobState.CANCELLED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.TIMEOUT,
    "PREEMPTED": JobState.PREEMPTED,
    "NODE_FAIL": JobState.NODE_FAIL,
    "BOOT_FAIL": JobState.NODE_FAIL,
    "DEADLINE": JobState.TIMEOUT,
    "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
    "STOPPED": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "CONFIGURING": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SPECIAL_EXIT": JobState.FAILED,
    "REVOKED": JobState.CANCELLED,
    "UNKNOWN": JobState.UNKNOWN,
}


def test_table_covers_exactly_the_slurm_states() -> None:
    assert set(SLURM_STATE_MAP) == set(EXPECTED)


@pytest.mark.parametrize("raw", sorted(EXPECTED))
def test_each_slurm_state_maps(raw: str) -> None:
    assert from_slurm(raw) is EXPECTED[raw]


def test_every_our_state_is_reachable_from_slurm() -> None:
    # BUDGET is the run's own: its budget stopped it (a local job records it; no scheduler says it)
    assert set(SLURM_STATE_MAP.values()) == set(JobState) - {JobState.BUDGET}


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("CANCELLED by 0", JobState.CANCELLED),
        ("CANCELLED by 1000", JobState.CANCELLED),
        ("CANCELLED+", JobState.CANCELLED),
        ("  running \n", JobState.RUNNING),
        ("timeout", JobState.TIMEOUT),
        ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
        ("PD", JobState.PENDING),
        ("CG", JobState.RUNNING),
        ("OOM", JobState.OUT_OF_MEMORY),
        ("", JobState.UNKNOWN),
        ("SOMETHING_NEW", JobState.UNKNOWN),
    ],
)
def test_decorated_and_compact_forms(raw: str, expected: JobState) -> None:
    assert from_slurm(raw) is expected


def test_compact_codes_all_resolve_to_known_states() -> None:
    for code, long_name in SLURM_COMPACT_CODES.items():
        assert long_name in SLURM_STATE_MAP, code
        assert normalize_slurm_state(code) == long_name


def test_terminal_states() -> None:
    """What the followers need: states that will change are never terminal, and only COMPLETED is a
    success. (Which Slurm outcomes end a run is checked against the real cluster: the batch host's
    death, a requeue, a cancel in tests/cluster/test_fault_tolerance.py and tests/cluster/test_requeue.py.)"""
    assert set(TERMINAL_STATES) == {s for s in JobState if s.is_terminal()}
    for s in (JobState.PENDING, JobState.RUNNING, JobState.REQUEUED, JobState.UNKNOWN):
        assert not s.is_terminal()
    assert [s for s in JobState if s.is_success()] == [JobState.COMPLETED]
    assert all(s.is_terminal() for s in JobState if s.is_success())


def test_is_terminal_accepts_strings() -> None:
    assert is_terminal("COMPLETED")
    assert is_terminal("CANCELLED by 0")
    assert is_terminal("BOOT_FAIL")
    assert not is_terminal("COMPLETING")
    assert not is_terminal("REQUEUE_HOLD")
    assert not is_terminal("garbage")


def test_parse_state() -> None:
    assert parse_state("running") is JobState.RUNNING
    assert parse_state(" OUT_OF_MEMORY ") is JobState.OUT_OF_MEMORY
    with pytest.raises(ValueError, match="expected one of: PENDING"):
        parse_state("BOGUS")


def test_str_is_the_value() -> None:
    assert f"{JobState.NODE_FAIL}" == "NODE_FAIL"


@given(st.text(max_size=40))
def test_from_slurm_never_raises(raw: str) -> None:
    assert isinstance(from_slurm(raw), JobState)
