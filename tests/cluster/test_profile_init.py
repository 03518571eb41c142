"""``orchestrator profiles init`` on a test cluster shaped like a real one (issue 43): a second
partition with its own limits, an account and a QOS in slurmdbd. The profile it writes equals the
cluster's configuration (the truth read from slurm.conf and from what the test created, not from
the code under test), validates, and a job submits with it unchanged and runs where it says."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import REPO, job_and_run_dir, run_cli, sacct_state
from tests.helpers.slurm_cluster import require_cluster, scancel_quietly, slurm

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
PARTITION, ACCOUNT, QOS, MAX_TIME = "long", "research", "high", "2-00:00:00"


@pytest.fixture
def shaped(slurm_cluster: dict[str, str]) -> Iterator[list[str]]:
    """A partition ``long`` on the last two nodes (MaxTime 2 days, MaxNodes 2); account ``research``
    with QOS ``normal,high`` (default ``high``) for this user. Undone afterwards."""
    cluster = require_cluster()
    nodes = [f"n{i}" for i in range(2, cluster.nodes + 1)][:2]
    slurm("scontrol", "create", f"PartitionName={PARTITION}", f"Nodes={','.join(nodes)}",
          f"MaxTime={MAX_TIME}", "MaxNodes=2", "State=UP")  # fmt: skip
    slurm("sacctmgr", "-i", "add", "qos", QOS)
    slurm("sacctmgr", "-i", "add", "account", ACCOUNT)
    slurm(
        "sacctmgr",
        "-i",
        "add",
        "user",
        "root",
        f"account={ACCOUNT}",
        f"qos=normal,{QOS}",
        f"defaultqos={QOS}",
    )
    try:
        yield nodes
    finally:
        slurm("scontrol", "delete", f"PartitionName={PARTITION}", check=False)
        slurm("sacctmgr", "-i", "delete", "user", "root", f"account={ACCOUNT}", check=False)
        slurm("sacctmgr", "-i", "delete", "account", ACCOUNT, check=False)
        slurm("sacctmgr", "-i", "delete", "qos", QOS, check=False)


def test_profiles_init_writes_the_clusters_own_configuration(
    shaped: list[str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    conf = Path(require_cluster().base / "etc" / "slurm.conf").read_text()
    node_line = next(line for line in conf.splitlines() if line.startswith(f"NodeName={shaped[0]} "))
    cpus = int(re.search(r"\bCPUs=(\d+)", node_line).group(1))  # type: ignore[union-attr]
    memory = int(re.search(r"\bRealMemory=(\d+)", node_line).group(1))  # type: ignore[union-attr]
    profiles = tmp_path / "profiles"
    res = run_cli(
        ["profiles", "init", "shaped", "--partition", PARTITION, "--account", ACCOUNT, "--profiles-dir",
         str(profiles), "--setup", "export OMP_NUM_THREADS=1"],
        orch_env, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    written = profiles / "shaped.yaml"
    data = yaml.safe_load(written.read_text())
    assert data["scheduler"] == "slurm" and data["partition"] == PARTITION, data
    assert data["nodes"] == {"default": 2, "max": 2} and data["time_limit"] == MAX_TIME, data
    assert data["cpus_per_task"] == cpus and data["mem"] == f"{memory}M", (data, node_line)
    assert data["account"] == ACCOUNT and data["qos"] == QOS, data
    assert data["setup"] == ["export OMP_NUM_THREADS=1"] and "gpus_per_node" not in data, data
    assert "# the partition's MaxTime" in written.read_text()
    assert run_cli(["profiles", "validate", str(written)], orch_env, timeout=60).returncode == 0
    again = run_cli(["profiles", "init", "shaped", "--profiles-dir", str(profiles)], orch_env, timeout=180)
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr, (
        again.stderr
    )

    res = run_cli(
        ["submit", "--profile", "shaped", "--profiles-dir", str(profiles), "--nodes", "2", "--strategy", "ddp",
         "--", TRAIN, "--preset", "tiny", "--data", "synthetic", "--max-steps", "3", "--batch-size", "2",
         "--seq-len", "32"],
        orch_env, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, _ = job_and_run_dir(res.stdout)
    try:
        assert sacct_state(job_id, timeout=240) == "COMPLETED"
    finally:
        scancel_quietly(job_id)
    where = slurm("sacct", "-X", "-n", "-P", "-j", job_id, "-o", "partition,account,qos,nodelist").stdout
    partition, account, qos, nodelist = where.strip().splitlines()[0].split("|")
    assert (partition, account, qos) == (PARTITION, ACCOUNT, QOS), where
    assert set(slurm("scontrol", "show", "hostnames", nodelist).stdout.split()) == set(shaped), where


def test_an_unknown_partition_is_one_line_naming_the_ones_there(
    slurm_cluster: dict[str, str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    res = run_cli(
        ["profiles", "init", "x", "--partition", "nope", "--no-node-probe", "--profiles-dir", str(tmp_path)],
        orch_env, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and "--partition nope: the cluster has no such partition" in res.stderr, (
        res.stderr
    )
    assert "debug" in res.stderr and not (tmp_path / "x.yaml").exists()
