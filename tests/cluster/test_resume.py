"""``orchestrator resume`` on the real cluster: each refusal docs/resume-and-faults.md promises (nothing submitted),
and each option (``--strategy``, ``--profile``, ``--nodes``) reaching the new job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.rundir.summary import iter_metrics
from tests.helpers.cli import REPO, job_and_run_dir, job_ended, poll, probe_args, run_cli, sacct_state
from tests.helpers.slurm_cluster import controller_job_ids

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
TINY = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"]
#: The run never ends by itself in these tests: it is cancelled once it has a checkpoint.
LONG = [*TINY, "--max-steps", "100000", "--ckpt-every", "3"]


def checkpointed_then_cancelled(env: dict[str, str], *options: str) -> tuple[str, Path]:
    res = run_cli(["submit", "--profile", "slurm_test", *options, "--", TRAIN, *LONG], env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    poll(lambda: list((run_dir / "checkpoints").glob("step_*/COMPLETE.json")), 240, "a complete checkpoint")
    assert run_cli(["cancel", job_id], env, timeout=60).returncode == 0
    assert sacct_state(job_id, timeout=120) == "CANCELLED"
    wait_until_ended(env, job_id)
    return job_id, run_dir


def wait_until_ended(env: dict[str, str], job_id: str) -> None:
    poll(lambda: job_ended(env, job_id), 120, f"job {job_id} to end", interval=0.5)


def refused(env: dict[str, str], args: list[str], needle: str) -> None:
    before = controller_job_ids()
    res = run_cli(["resume", *args], env, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert controller_job_ids() - before == set(), "nothing submitted"


def test_resume_refusals(slurm_cluster: dict, orch_env: dict, tmp_path: Path) -> None:
    # A run that failed before any checkpoint (it expects a world size it does not get).
    plain = run_cli(
        ["submit", "--profile", "slurm_test", "--nodes", "1", "--wait", "--poll", "0.5", *probe_args(3, tmp_path / "plain")],
        orch_env, timeout=240,
    )  # fmt: skip
    assert plain.returncode == 1, plain.stdout + plain.stderr
    plain_job, _ = job_and_run_dir(plain.stdout)
    wait_until_ended(orch_env, plain_job)
    refused(orch_env, [plain_job], "no complete checkpoint")
    # ddp <-> FSDP: a full model state dict cannot be loaded as sharded folders.
    ddp_job, _ = checkpointed_then_cancelled(orch_env, "--nodes", "2", "--strategy", "ddp")
    refused(orch_env, [ddp_job, "--strategy", "full_shard"], "cannot load")
    refused(orch_env, ["no-such-job"], "unknown job id")


def test_resume_with_another_strategy_profile_and_node_count(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    job_id, run_dir = checkpointed_then_cancelled(orch_env, "--nodes", "2", "--strategy", "full_shard")
    other = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
    other["time_limit"] = "00:20:00"
    other_path = tmp_path / "other.yaml"
    other_path.write_text(yaml.safe_dump(other))
    res = run_cli(
        ["resume", job_id, "--strategy", "shard_grad_op", "--profile", str(other_path), "--nodes", "1"],
        orch_env, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resharding: checkpoint world size 2 -> 1" in res.stdout
    new_job = res.stdout.split("submitted job ")[1].split()[0]
    plan = json.loads((run_dir / "job.json").read_text())
    assert (plan["options"]["strategy"], plan["nodes"], plan["profile"]["time_limit"]) == (
        "shard_grad_op",
        1,
        "00:20:00",
    )
    sbatch = (run_dir / "sbatch.sh").read_text()
    assert "#SBATCH --time=00:20:00\n" in sbatch and "#SBATCH --nodes=1\n" in sbatch
    resumed = poll(
        lambda: [e for e in iter_metrics(run_dir) if e.get("event") == "resume"], 240, "the resume"
    )
    train_after = poll(
        lambda: [
            e for e in iter_metrics(run_dir) if e.get("event") == "train" and e["step"] > resumed[0]["step"]
        ],
        120,
        "a step of the resumed job",
    )
    assert train_after[0]["strategy"] == "shard_grad_op" and train_after[0]["world_size"] == 1
    assert run_cli(["cancel", new_job], orch_env, timeout=60).returncode == 0
    assert sacct_state(new_job, timeout=120) == "CANCELLED"
