"""orchestrator.contract.budget_records: what a run has spent, from its attempts' meters, and the stop marker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.contract.budget_records import (
    budget_stop,
    meter_hours,
    spent_hours,
    write_budget_stop,
    write_meter,
)


def test_the_run_spends_every_attempts_span_times_what_it_held(tmp_path: Path) -> None:
    write_meter(tmp_path, 0, start=1000.0, end=1000.0 + 1800, per_hour=4)  # half an hour x 4 CPUs
    write_meter(tmp_path, 1, start=5000.0, end=5000.0 + 900, per_hour=2)  # a requeue, a quarter x 2
    assert spent_hours(tmp_path) == pytest.approx(2.5)
    assert spent_hours(tmp_path, but=1) == pytest.approx(2.0)  # the attempt that meters itself live


@pytest.mark.parametrize(
    "record",
    [None, [], "x", {"start": 1.0}, {"start": "1", "end": 2.0, "per_hour": 1}, {"start": 5.0, "end": 1.0, "per_hour": 1},
     {"start": 1.0, "end": 2.0, "per_hour": -1}, {"start": 1.0, "end": float("nan"), "per_hour": 1},
     {"start": True, "end": 2.0, "per_hour": 1}],
)  # fmt: skip
def test_a_record_that_cannot_be_read_counts_nothing(record: object) -> None:
    assert meter_hours(record) == 0.0


def test_a_torn_meter_file_counts_nothing(tmp_path: Path) -> None:
    write_meter(tmp_path, 0, 0.0, 3600.0, 1)
    (tmp_path / "logs" / "attempt_1").mkdir(parents=True)
    (tmp_path / "logs" / "attempt_1" / "budget.json").write_text('{"start": 1')
    assert spent_hours(tmp_path) == pytest.approx(1.0)


def test_the_stop_marker_belongs_to_one_attempt(tmp_path: Path) -> None:
    assert budget_stop(tmp_path) is None
    write_budget_stop(tmp_path, 3, "budget: spent it", 0.9, "1cpu-h")
    assert budget_stop(tmp_path, 3)["reason"] == "budget: spent it"  # type: ignore[index]
    assert budget_stop(tmp_path, 4) is None  # a later attempt (a resume with more) is not stopped by it
    assert json.loads((tmp_path / "budget_stop.json").read_text())["budget"] == "1cpu-h"
