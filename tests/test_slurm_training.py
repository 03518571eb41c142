"""The reference training program on the real Slurm cluster: equal to local mode, prompt failure on node loss."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from tests.helpers.cli import REPO, first_train_event, job_and_run_dir, run_cli, sacct_state, train_losses
from tests.helpers.preconditions import require

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TRAIN = str(REPO / "train" / "train.py")
TRAIN_ARGS = [
    "--preset",
    "tiny",
    "--data",
    "synthetic",
    "--batch-size",
    "4",
    "--seq-len",
    "64",
    "--max-steps",
    "12",
    "--log-every",
    "1",
]


@pytest.mark.parametrize("strategy", ["ddp", "hybrid_shard"])
def test_two_node_training_equals_local_mode(slurm_cluster: dict, orch_env: dict, strategy: str) -> None:
    common = ["--strategy", strategy, "--nodes", "2", "--procs-per-node", "2", "--wait", "--poll", "1"]
    if strategy != "ddp":
        common += ["--wrap-cls", "TransformerBlock"]
    slurm = run_cli(
        ["submit", "--profile", "slurm_test", *common, "--", TRAIN, *TRAIN_ARGS], orch_env, timeout=400
    )
    assert slurm.returncode == 0, slurm.stdout + slurm.stderr
    job_id, slurm_dir = job_and_run_dir(slurm.stdout)
    assert sacct_state(job_id) == "COMPLETED"
    local = run_cli(
        ["submit", "--profile", "local", *common, "--", TRAIN, *TRAIN_ARGS], orch_env, timeout=400
    )
    assert local.returncode == 0, local.stdout + local.stderr
    _, local_dir = job_and_run_dir(local.stdout)
    slurm_losses, local_losses = train_losses(slurm_dir), train_losses(local_dir)
    assert len(slurm_losses) == 12
    assert [round(x, 4) for x in slurm_losses] == [round(x, 4) for x in local_losses]
    first = first_train_event(slurm_dir)
    assert first["world_size"] == 4


def _node_training_pids(node: str) -> list[int]:
    """Training workers running inside one node's network namespace (children of accelerate launch)."""
    out = subprocess.run(
        ["ip", "netns", "pids", f"slurm-{node}"], capture_output=True, text=True, timeout=10
    ).stdout
    pids = []
    for pid in map(int, out.split()):
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        if "train.py" in " ".join(cmd):  # a forked rank's title is one string (setproctitle)
            pids.append(pid)
    return pids


def test_killing_one_node_fails_the_job_promptly(slurm_cluster: dict, orch_env: dict) -> None:
    if slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_MODE") != "netns":
        require(False, "needs nodes in network namespaces to find one node's processes")
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--strategy",
            "ddp",
            "--nodes",
            "2",
            "--",
            TRAIN,
            *TRAIN_ARGS[:-4],
            "--max-steps",
            "100000",
            "--log-every",
            "1",
        ],
        orch_env,
    )
    assert res.returncode == 0, res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # training is really running: steps are being logged
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count('"train"') >= 3:
                break
            time.sleep(0.5)
        else:
            pytest.fail("training never started")
        nodes = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True
        ).stdout.strip()
        victim = nodes.replace("n[", "n").split(",")[-1].split("-")[-1].rstrip("]")
        victim = victim if victim.startswith("n") else f"n{victim}"
        pids = _node_training_pids(victim)
        assert pids, f"no training processes found on {victim}"
        killed_at = time.monotonic()
        for pid in pids:
            psutil.Process(pid).kill()
        state = sacct_state(job_id, timeout=180)
        elapsed = time.monotonic() - killed_at
        assert state == "FAILED", state
        assert elapsed < 120, f"job took {elapsed:.0f} s to fail"
        (run_dir / "node_failure_seconds.txt").write_text(f"{elapsed:.1f}\n")
        print(f"node {victim} killed -> FAILED after {elapsed:.1f} s")
        logs = "".join(
            p.read_text(errors="replace") for p in (run_dir / "logs" / "attempt_0").glob("node_*.log")
        )
        assert f"host={victim}" in logs and "exit=" in logs  # the log names the node and its exit
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
