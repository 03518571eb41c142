"""``sweep --budget`` (and the profile's ``budget:``) is one budget for the whole sweep: its tasks are
a job each, started by the sweep's starter, which caps each as it starts or refuses it
(tests/runner/test_sweep_budget.py runs one; tests/cluster/test_budget.py on Slurm, where such a
sweep is no job array). The dry run says so."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import REPO, run_cli, user_profile_dir

TRAIN = str(REPO / "train" / "train.py")
GRID = ["--grid", "lr=1e-3,2e-3,3e-3", "--dry-run", "--", TRAIN, "--lr", "{lr}"]


def test_a_sweeps_budget_is_one_for_all_its_tasks(orch_env: dict[str, str], tmp_path: Path) -> None:
    res = run_cli(["sweep", "--profile", "local", "--budget", "0.01cpu-h", *GRID], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "budget 0.01cpu-h for the whole sweep: a job per task, each capped as it starts" in res.stdout
    # The profile's budget is the sweep's default, the same way.
    profiles = user_profile_dir(tmp_path, profile="local", budget="0.006cpu-h")
    res = run_cli(["sweep", "--profile", "local", "--profiles-dir", str(profiles), *GRID], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "budget 0.006cpu-h for the whole sweep" in res.stdout, res.stdout
    plain = run_cli(["sweep", "--profile", "local", *GRID], orch_env)
    assert plain.returncode == 0 and "budget" not in plain.stdout, plain.stdout
    runs = Path(orch_env["ORCHESTRATOR_RUNS"])
    assert not runs.exists() or not any(runs.iterdir())  # a dry run makes nothing
