"""``start_estimates.jsonl``: the scheduler's word at submission, read back by ``cost``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from orchestrator.contract import start_estimates


def test_the_estimate_is_read_from_sbatchs_line_and_only_a_time_counts() -> None:
    said = "Job 57 to start at 2026-11-29T00:40:29 using 8 processors on nodes n[1-2] in partition debug"
    assert start_estimates.estimate_of(said) == "2026-11-29T00:40:29"
    assert start_estimates.estimate_of("Job 57 to start at Unknown using ...") is None
    assert start_estimates.estimate_of("sbatch: error: Batch job submission failed") is None


def test_cost_notes_say_how_far_off_the_first_estimate_was(tmp_path: Path) -> None:
    start_estimates.record(tmp_path, "7", "2026-11-29T00:40:00")
    start_estimates.record(tmp_path, "7", "2026-11-29T09:00:00")  # a later one does not count
    when = start_estimates.epoch("2026-11-29T00:40:00")
    assert when is not None
    attempts = [SimpleNamespace(job_id="7", start=when + 30), SimpleNamespace(job_id="8", start=when)]
    assert start_estimates.notes(tmp_path, attempts) == [
        "job 7: the scheduler's start estimate at submission was 2026-11-29T00:40:00; it started 30 s later"
    ]
    assert start_estimates.notes(tmp_path / "none", attempts) == []
