"""``submit --test-only`` where jobs never wait: it says so and submits nothing. Slurm's side (a busy
partition, the estimate in ``submit`` and ``status``): tests/cluster/test_start_estimate.py."""

from __future__ import annotations

from tests.helpers.cli import REPO, run_cli

TRAIN = str(REPO / "train" / "train.py")
ARGS = ["--preset", "tiny", "--data", "synthetic", "--max-steps", "2"]


def test_test_only_on_local_says_it_starts_at_once(orch_env: dict[str, str]) -> None:
    res = run_cli(["submit", "--profile", "local", "--test-only", "--", TRAIN, *ARGS], orch_env, timeout=60)
    assert res.returncode == 0 and "starts jobs at once" in res.stdout and "submitted job" not in res.stdout
