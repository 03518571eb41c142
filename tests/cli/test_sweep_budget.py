"""``sweep --budget`` (and the profile's ``budget:``) is one budget for the whole sweep: its tasks are
not one job array, whose tasks Slurm would start by itself, but a job each, started by the sweep's
starter, which caps each as it starts or refuses it (tests/runner/test_sweep_budget.py runs one;
tests/cluster/test_budget.py on Slurm). The dry run says so and shows no array."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import REPO, run_cli, user_profile_dir

TRAIN = str(REPO / "train" / "train.py")
GRID = ["--grid", "lr=1e-3,2e-3,3e-3", "--dry-run", "--", TRAIN, "--lr", "{lr}"]


def test_a_sweep_with_a_budget_is_no_job_array(orch_env: dict[str, str], tmp_path: Path) -> None:
    plain = run_cli(["sweep", "--profile", "slurm_test", *GRID], orch_env)
    assert plain.returncode == 0 and "#SBATCH --array=0-2" in plain.stdout, plain.stdout + plain.stderr
    res = run_cli(["sweep", "--profile", "slurm_test", "--budget", "0.01cpu-h", *GRID], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (
        "#SBATCH" not in res.stdout and "budget 0.01cpu-h for the whole sweep: a job per task" in res.stdout
    )
    # The profile's budget is the sweep's default, the same way.
    profiles = user_profile_dir(tmp_path, budget="0.006cpu-h")
    res = run_cli(["sweep", "--profile", "slurm_test", "--profiles-dir", str(profiles), *GRID], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "#SBATCH" not in res.stdout and "budget 0.006cpu-h for the whole sweep" in res.stdout, res.stdout
    assert not Path(orch_env["ORCHESTRATOR_RUNS"]).exists() or not any(
        Path(orch_env["ORCHESTRATOR_RUNS"]).iterdir()
    )
