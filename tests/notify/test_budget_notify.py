"""Notifications of a budget (issue 45): once at 80 % of it (once per budget: a resume with more
warns again), and at the stop, saying how to continue."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.contract.budget_records import write_meter
from orchestrator.notify import events as notify


def _run(tmp_path: Path, budget: str | None, profile: dict | None = None) -> Path:
    plan = {"job_name": "probe", "profile": profile or {"gpus_per_node": 0}}
    if budget is not None:
        plan["budget"] = budget
    (tmp_path / "job.json").write_text(json.dumps(plan))
    return tmp_path


def test_the_run_says_once_it_has_spent_80_percent_of_its_budget(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, "1cpu-h")
    write_meter(run_dir, 0, 0.0, 0.79 * 3600, 1)
    assert notify.budget_events(run_dir, "local-1", "probe") == []
    write_meter(run_dir, 1, 0.0, 0.02 * 3600, 1)  # a later attempt: the run's spending is the sum
    (event,) = notify.budget_events(run_dir, "local-2", "probe")
    assert event.kind == "budget" and event.key == "budget_80.1cpu-h", event
    assert "spent 80 % of its budget (0.81 cpu-h of 1cpu-h)" in event.text, event.text
    assert [e.key for e in notify.attempt_events(run_dir, 1, 0, "local-2")].count(event.key) == 1
    _run(tmp_path, "2cpu-h")  # resume --budget MORE: a new budget, its own 80 %
    assert notify.budget_events(run_dir, "local-3", "probe") == []


def test_money_is_counted_at_the_price_and_a_run_without_a_budget_says_nothing(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, "10usd", {"gpus_per_node": 0, "price_per_cpu_hour": 2.0})
    write_meter(run_dir, 0, 0.0, 4.5 * 3600, 1)  # 4.5 cpu-h x 2 = 9 usd
    (event,) = notify.budget_events(run_dir, "local-1", "probe")
    assert "9.00 usd of 10usd" in event.text, event.text
    assert notify.budget_events(_run(tmp_path, None), "local-1", "probe") == []


def test_the_stop_is_an_end_event_that_says_how_to_continue(tmp_path: Path) -> None:
    end = notify.end_event(
        _run(tmp_path, "1cpu-h"), "local-4", "BUDGET", "budget: spent 0.97 cpu-h of 1cpu-h"
    )
    assert end is not None and end.kind == "budget" and end.key == "end.local-4", end
    assert "orchestrator resume local-4 --budget MORE" in end.text and "0.97 cpu-h" in end.text, end.text
