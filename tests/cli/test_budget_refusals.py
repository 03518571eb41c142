"""A bad ``--budget`` (issue 45): one line, exit 2, before anything is created: ``submit``, ``sweep``
and ``resume`` all check it, and the profile decides the unit and the price."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import REPO, run_cli

TRAIN = str(REPO / "train" / "train.py")


@pytest.mark.parametrize(
    "budget, words",
    [
        ("-1", "expected an amount and a unit"),
        ("abc", "expected an amount and a unit"),
        ("0cpu-h", "expected an amount above 0"),
        ("5usd", "has no price_per_cpu_hour"),  # money without a price
        ("2gpu-h", "billed in cpu-h"),  # the local profile has no GPUs
    ],
)
@pytest.mark.parametrize("command", ["submit", "sweep"])
def test_a_bad_budget_is_one_line_before_anything_is_created(
    orch_env: dict[str, str], tmp_path: Path, command: str, budget: str, words: str
) -> None:
    grid = ["--grid", "lr=1,2"] if command == "sweep" else []
    args = ["--lr", "{lr}"] if command == "sweep" else []
    res = run_cli(
        [command, "--profile", "local", *grid, "--budget", budget, "--", TRAIN, *args], orch_env, 60
    )
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"orchestrator {command}: error: --budget"), res.stderr
    assert words in lines[0], lines[0]
    runs = Path(orch_env["ORCHESTRATOR_RUNS"])
    assert not runs.exists() or not any(runs.iterdir()), "a run directory was created"


def test_resume_checks_its_budget_before_it_looks_the_job_up(orch_env: dict[str, str]) -> None:
    res = run_cli(["resume", "local-1", "--budget", "abc"], orch_env, 60)
    assert res.returncode == 2 and "--budget 'abc': expected" in res.stderr, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
