"""``orchestrator profiles init`` on a test cluster shaped like a real one (issue 43): a second
partition with its own limits, an account and a QOS in slurmdbd, and GRES GPUs on some nodes
(``GPU_NODES`` of ``start_cluster.sh``: Slurm schedules GPU jobs there; the nodes have no GPU). The
profile it writes equals the cluster's configuration (the truth read from slurm.conf, gres.conf and
what the test created, not from the code under test), validates, and a job submits with it
unchanged: a CPU job runs where it says; a GPU job is given the nodes' GRES by Slurm (the batch
script's ``--gres`` as written), and then stopped by the preflight, which finds no GPU there. On the
partition that mixes a node without GRES and GRES nodes, ``--gpu-type`` drafts the GRES nodes' GPUs,
and a type the partition lacks is refused naming its types."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import REPO, job_and_run_dir, run_cli, sacct_state
from tests.helpers.gres import gres_truth
from tests.helpers.preconditions import require
from tests.helpers.slurm_cluster import require_cluster, scancel_quietly, slurm

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
PARTITION, ACCOUNT, QOS, MAX_TIME = "long", "research", "high", "2-00:00:00"
GPU_PARTITION, GPU_MAX_TIME = "gpu", "12:00:00"


@pytest.fixture
def shaped(slurm_cluster: dict[str, str]) -> Iterator[list[str]]:
    """A partition ``long`` on the first two nodes (MaxTime 2 days, MaxNodes 2); account ``research``
    with QOS ``normal,high`` (default ``high``) for this user. Undone afterwards. The first node has no
    GRES (the last ones have, ``start_cluster.sh``), so ``long``'s nodes do not all have GPUs: its
    profile is a CPU profile."""
    cluster = require_cluster()
    require(cluster.nodes >= 3, "three nodes (the first without GRES)")
    nodes = ["n1", "n2"]
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
    assert "Gres=gpu" not in node_line  # n1: not every node of `long` has a GPU
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
        state = sacct_state(job_id, timeout=240)
    finally:
        scancel_quietly(job_id)
    if state != "COMPLETED":
        # The written profile keeps the preflight on, with its 1 Gbit/s floor per link; on the 2 busy
        # cores the nodes' veth links measured 0.9 to 11 Gbit/s, so a slow-link refusal is the
        # preflight's verdict on this machine, not the profile's: said as such, nothing else.
        reason = json.loads(run_cli(["status", job_id, "--json"], orch_env, timeout=60).stdout)["jobs"][0][
            "reason"
        ]
        assert state == "FAILED" and "preflight failed" in reason and "link is slow" in reason, (
            state,
            reason,
        )
        print(
            f"\n[profiles init] the CPU job's preflight refused a slow link on this loaded machine: {reason}"
        )
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


@pytest.fixture
def gpu_partition(slurm_cluster: dict[str, str]) -> Iterator[tuple[list[str], str, int]]:
    """A partition ``gpu`` on exactly the nodes with GRES GPUs (what ``gres_truth`` read). Undone."""
    nodes, kind, count = gres_truth()
    slurm("scontrol", "create", f"PartitionName={GPU_PARTITION}", f"Nodes={','.join(nodes)}",
          f"MaxTime={GPU_MAX_TIME}", "State=UP")  # fmt: skip
    try:
        yield nodes, kind, count
    finally:
        slurm("scontrol", "delete", f"PartitionName={GPU_PARTITION}", check=False)


def test_profiles_init_on_gres_nodes_writes_their_gpus_and_slurm_gives_them(
    gpu_partition: tuple[list[str], str, int], orch_env: dict[str, str], tmp_path: Path
) -> None:
    """GPUs per node and their type equal the nodes' GRES; the profile, unchanged, is a job Slurm
    accepts and runs on those nodes with their GPUs allocated (``--gres`` as the batch script has it),
    and the preflight then fails it: the nodes have no GPU, which a job must be told, not trained on."""
    nodes, kind, count = gpu_partition
    profiles = tmp_path / "profiles"
    res = run_cli(
        ["profiles", "init", "gpus", "--partition", GPU_PARTITION, "--profiles-dir", str(profiles),
         "--setup", "export OMP_NUM_THREADS=1"],
        orch_env, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    written = profiles / "gpus.yaml"
    text = written.read_text()
    data = yaml.safe_load(text)
    assert (data["partition"], data["gpus_per_node"], data["gpu_type"]) == (GPU_PARTITION, count, kind), text
    assert data["nodes"] == {"default": 2, "max": len(nodes)} and data["time_limit"] == GPU_MAX_TIME, text
    assert data["exclusive"] is True and "# the nodes' GRES" in text, text
    assert run_cli(["profiles", "validate", str(written)], orch_env, timeout=60).returncode == 0

    submit = ["submit", "--profile", "gpus", "--profiles-dir", str(profiles), "--", TRAIN, "--preset", "tiny",
              "--data", "synthetic", "--max-steps", "2", "--batch-size", "2", "--seq-len", "32"]  # fmt: skip
    asked = run_cli([submit[0], "--test-only", *submit[1:]], orch_env, timeout=60)
    assert asked.returncode == 0 and f"in partition {GPU_PARTITION}" in asked.stdout, (
        asked.stdout + asked.stderr
    )
    res = run_cli(submit, orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    try:
        assert f"--gres=gpu:{kind}:{count}" in (run_dir / "sbatch.sh").read_text()
        state = sacct_state(job_id, timeout=240)
    finally:
        scancel_quietly(job_id)
    # What Slurm gave the job (scontrol keeps an ended job MinJobAge=300 s): the partition, the GRES
    # nodes, and per node the GPUs the batch script asked for.
    shown = slurm("scontrol", "show", "job", "-o", job_id).stdout
    fields = dict(word.split("=", 1) for word in shown.split() if "=" in word)
    assert fields["Partition"] == GPU_PARTITION and fields["TresPerNode"] == f"gres:gpu:{kind}:{count}", shown
    assert set(slurm("scontrol", "show", "hostnames", fields["NodeList"]).stdout.split()) == set(nodes[:2]), (
        shown
    )
    print(
        f"\n[profiles init] GPU profile's job {job_id}: {state} on {fields['NodeList']}, {fields['TresPerNode']}"
    )
    assert state == "FAILED", shown
    # The nodes' own word that they have no GPU (no driver, no nvidia-smi), each node named.
    rows = json.loads(run_cli(["status", job_id, "--json"], orch_env, timeout=60).stdout)["jobs"]
    for node in nodes[:2]:
        assert f"node {node}: nvidia-smi failed" in rows[0]["reason"], rows


def test_gpu_type_drafts_the_gres_nodes_of_a_partition_where_some_have_none(
    shaped: list[str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    """``long`` mixes a node without GRES and GRES nodes: a CPU profile by default, said on stderr
    with the partition's GPU types; ``--gpu-type`` drafts those nodes' GPUs; a type it lacks is one
    line naming the partition and its types, and nothing is written."""
    gres_nodes, kind, count = gres_truth()
    with_gpus = [n for n in shaped if n in gres_nodes]
    require(bool(with_gpus), f"a GRES node in {PARTITION} ({shaped}; GRES on {gres_nodes})")
    profiles = tmp_path / "profiles"
    base = ["profiles", "init", "mix", "--partition", PARTITION, "--no-node-probe", "--setup", "true",
            "--profiles-dir", str(profiles)]  # fmt: skip
    types = f"{kind} on {len(with_gpus)} node(s), {count} GPUs each"
    cpu = run_cli(base, orch_env, timeout=180)
    assert cpu.returncode == 0 and "gpus_per_node" not in yaml.safe_load((profiles / "mix.yaml").read_text())
    assert f"GPU types of partition {PARTITION} (its nodes' GRES): {types}" in cpu.stderr, cpu.stderr
    assert "so the draft is a CPU profile" in cpu.stderr, cpu.stderr
    gpu = run_cli([*base, "--gpu-type", kind.upper(), "--force"], orch_env, timeout=180)
    assert gpu.returncode == 0, gpu.stderr
    data = yaml.safe_load((profiles / "mix.yaml").read_text())
    assert (data["gpus_per_node"], data["gpu_type"], data["nodes"]["max"]) == (count, kind, len(with_gpus)), (
        data
    )
    assert run_cli(["profiles", "validate", str(profiles / "mix.yaml")], orch_env, timeout=60).returncode == 0
    refused = run_cli([*base[:2], "other", *base[3:], "--gpu-type", "nope"], orch_env, timeout=180)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert f"--gpu-type nope: partition {PARTITION} has no such GPU type; it has its GPU types: {types}" in (
        refused.stderr
    )
    assert len(refused.stderr.strip().splitlines()) == 1 and not (profiles / "other.yaml").exists()
