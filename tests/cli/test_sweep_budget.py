"""``sweep --budget`` (and the profile's ``budget:``) is one budget for the whole sweep, as the dry run
shows it: a job array's tasks (Slurm starts them itself) each capped at an equal share, a local
sweep's tasks capped by its starter as each starts (tests/runner/test_sweep_budget.py runs one)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import REPO, run_cli, user_profile_dir

TRAIN = str(REPO / "train" / "train.py")
GRID = ["--grid", "lr=1e-3,2e-3,3e-3", "--dry-run", "--", TRAIN, "--lr", "{lr}"]


def test_a_job_arrays_tasks_share_the_sweeps_budget_equally(orch_env: dict[str, str], tmp_path: Path) -> None:
    res = run_cli(["sweep", "--profile", "slurm_test", "--budget", "0.01cpu-h", *GRID], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    caps = [
        line.split("(budget ")[1].split(":")[0]
        for line in res.stdout.splitlines()
        if line.startswith("task ")
    ]
    assert caps == ["0.003333cpu-h"] * 3, res.stdout  # 3 x 0.003333 <= 0.01: rounded down, never up
    assert "budget 0.01cpu-h for the whole sweep" in res.stdout, res.stdout

    # The profile's budget is the sweep's default, the same way.
    profiles = user_profile_dir(tmp_path, budget="0.006cpu-h")
    res = run_cli(["sweep", "--profile", "slurm_test", "--profiles-dir", str(profiles), *GRID], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("(budget 0.002cpu-h: an equal share)") == 3, res.stdout


def test_a_local_sweeps_tasks_get_their_caps_as_they_start(orch_env: dict[str, str]) -> None:
    res = run_cli(["sweep", "--profile", "local", "--budget", "0.01cpu-h", *GRID], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(budget" not in res.stdout and "each task is capped as it starts" in res.stdout, res.stdout
    assert not (Path(orch_env["ORCHESTRATOR_RUNS"])).exists() or not any(
        Path(orch_env["ORCHESTRATOR_RUNS"]).iterdir()
    )  # a dry run makes nothing
