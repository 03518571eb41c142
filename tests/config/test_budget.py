"""orchestrator.config.budget: a budget's text, its check against a profile, and the stop decision."""

from __future__ import annotations

import pytest

from orchestrator.config.budget import (
    Budget,
    budget_text,
    check_budget,
    checkpoint_interval_s,
    decide,
    in_budget_units,
    parse_budget,
)
from orchestrator.config.profile.load import ClusterProfile, load_profile
from orchestrator.contract.errors import UserError


@pytest.mark.parametrize(
    "text, amount, unit",
    [
        ("200gpu-h", 200.0, "gpu-h"),
        ("0.5cpu-h", 0.5, "cpu-h"),
        ("500USD", 500.0, "usd"),
        (" 1e-3 cpu-h", 0.001, "cpu-h"),
    ],
)
def test_a_budget_is_an_amount_and_a_unit(text: str, amount: float, unit: str) -> None:
    assert parse_budget(text) == Budget(amount, unit)
    assert budget_text(text) == str(Budget(amount, unit))


@pytest.mark.parametrize(
    "text", ["-1", "abc", "0cpu-h", "-1gpu-h", "5", "5gpu", "1e999cpu-h", "nan cpu-h", "", "5 cpu-h x"]
)
def test_a_bad_budget_is_one_line_naming_the_flag(text: str) -> None:
    with pytest.raises(UserError) as err:
        parse_budget(text)
    assert str(err.value).startswith("--budget") and "\n" not in str(err.value)


def test_a_budget_that_is_not_text_is_refused() -> None:
    assert budget_text(None) is None
    with pytest.raises(UserError, match="--budget: expected"):
        budget_text(5)


def test_a_profile_bills_its_own_unit_and_money_needs_its_price() -> None:
    _, _, local = load_profile("local")  # gpus_per_node 0: CPU-hours
    check_budget(parse_budget("2cpu-h"), "local", local)
    with pytest.raises(UserError, match="billed in cpu-h"):
        check_budget(parse_budget("2gpu-h"), "local", local)
    without_price = ClusterProfile.model_validate({**local.model_dump(), "price_per_cpu_hour": None})
    with pytest.raises(UserError, match="no price_per_cpu_hour"):
        check_budget(parse_budget("5usd"), "local", without_price)
    priced = ClusterProfile.model_validate({**local.model_dump(), "price_per_cpu_hour": 0.5})
    check_budget(parse_budget("5usd"), "local", priced)
    assert in_budget_units(parse_budget("5usd"), 4.0, priced) == 2.0
    assert in_budget_units(parse_budget("5cpu-h"), 4.0, priced) == 4.0


def test_it_stops_when_the_next_interval_would_pass_the_budget() -> None:
    budget = Budget(1.0, "cpu-h")
    assert not decide(budget, 0.7, 0.3).stop  # exactly at the budget: still fits
    verdict = decide(budget, 0.71, 0.3)
    assert verdict.stop and "spent 0.71 cpu-h of 1cpu-h" in verdict.reason
    assert decide(budget, 1.2, 0.0).stop


def test_the_interval_is_the_longest_recent_gap_between_this_attempts_checkpoints() -> None:
    start = 1000.0
    # before the first step: none has begun; one checkpoint: the time to it (start-up included
    # while the first step is not seen)
    assert checkpoint_interval_s(start, 1007.0, []) == 0.0
    assert checkpoint_interval_s(start, 1020.0, [1006.0]) == 6.0
    # once training is seen to start, start-up is left out
    assert checkpoint_interval_s(start, 1007.0, [], training_start=1005.0) == 2.0
    assert checkpoint_interval_s(start, 1020.0, [1006.0], training_start=1005.0) == 1.0
    # an earlier attempt's checkpoints do not count; the last three gaps do
    assert checkpoint_interval_s(start, 1100.0, [900.0, 1006.0, 1016.0, 1018.0, 1020.0, 1021.0]) == 2.0
    assert checkpoint_interval_s(start, 1100.0, [1006.0, 1016.0, 1018.0, 1020.0]) == 10.0
