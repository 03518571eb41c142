"""``status`` of a job its budget stopped (orchestrator.runner.status): BUDGET with the marker's reason
whatever the scheduler calls it (Slurm: FAILED), for that job only, never for a completed one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.contract.budget_records import write_budget_stop
from orchestrator.contract.job_states import JobState
from orchestrator.rundir.summary import RunSummary
from orchestrator.runner.status import _budget_stop


def _job(run_dir: Path, job_id: str) -> Any:
    return SimpleNamespace(job_id=job_id, run_dir=run_dir)


def test_a_job_its_budget_stopped_reads_budget_with_the_reason(tmp_path: Path) -> None:
    write_budget_stop(tmp_path, 2, "budget: spent 0.9 cpu-h of 1cpu-h", 0.9, "1cpu-h", job_id="41")
    summary = RunSummary(tmp_path, budget="1cpu-h")
    reason = _budget_stop(_job(tmp_path, "41"), JobState.FAILED, summary)
    assert reason == "budget: spent 0.9 cpu-h of 1cpu-h; continue with resume --budget MORE"


@pytest.mark.parametrize(
    "job_id, state, budget",
    [
        ("42", JobState.FAILED, "1cpu-h"),  # another job of the run (the resume that followed)
        ("41", JobState.RUNNING, "1cpu-h"),  # not ended yet
        ("41", JobState.COMPLETED, "1cpu-h"),  # it finished as the stop came
        ("41", JobState.FAILED, None),  # a run without a budget
    ],
)
def test_nothing_else_reads_budget(tmp_path: Path, job_id: str, state: JobState, budget: str | None) -> None:
    write_budget_stop(tmp_path, 2, "budget: spent it", 0.9, "1cpu-h", job_id="41")
    assert _budget_stop(_job(tmp_path, job_id), state, RunSummary(tmp_path, budget=budget)) is None
