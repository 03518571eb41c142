"""``profiles init``'s pure part: scontrol/sacctmgr text in, a commented profile out that validates;
a partition with several GPU types drafts the one on most nodes, or ``--gpu-type``'s, and says so
(through the CLI too, on fake Slurm commands). The real cluster's side (a shaped test cluster, a job
submitted with the result): tests/cluster/test_profile_init.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from orchestrator.contract.errors import UserError
from orchestrator.runner.profile_init import write
from orchestrator.schedulers.slurm.discover import (
    ClusterFacts,
    parse_associations,
    parse_cred_expire,
    parse_node_probe,
    parse_nodes,
    parse_partitions,
)
from orchestrator.schedulers.slurm.profile_draft import Answers, draft, gpu_note
from tests.helpers.cli import REPO, run_cli

#: As ``scontrol show partition -o`` / ``node -o`` print them on a GPU cluster (fields trimmed).
PARTITIONS = (
    "PartitionName=cpu AllowAccounts=ALL AllowQos=ALL Default=YES MaxNodes=UNLIMITED MaxTime=04:00:00 "
    "Nodes=c[01-04] State=UP TotalNodes=4\n"
    "PartitionName=gpu AllowAccounts=ml,vision AllowQos=ALL Default=NO MaxNodes=16 MaxTime=2-00:00:00 "
    "Nodes=g[001-002] State=UP TotalNodes=2\n"
)
NODES = (
    "NodeName=c01 CPUTot=64 RealMemory=257000 Gres=(null) Partitions=cpu State=IDLE\n"
    "NodeName=g001 CPUTot=96 RealMemory=1000000 Gres=gpu:a100:8(S:0-1) Partitions=gpu State=MIXED\n"
    "NodeName=g002 CPUTot=96 RealMemory=980000 Gres=gpu:a100:8(S:0-1) Partitions=gpu State=IDLE\n"
)
ASSOC = "ml||normal,high|normal\nvision|gpu|normal|normal\n"


def facts() -> ClusterFacts:
    return ClusterFacts(
        partitions=parse_partitions(PARTITIONS),
        nodes=parse_nodes(NODES),
        associations=parse_associations(ASSOC),
        default_account="ml",
        cred_expire_s=parse_cred_expire("AuthInfo = cred_expire=120\n"),
        pyxis=True,
        runtimes=["enroot"],
        interfaces=parse_node_probe("runtime enroot\niface eth0\niface ib0\niface lo\n")[1],
        probed_node="gpu",
        missing=["accounts and QOS of another user: not asked"],
    )


def test_a_gpu_partition_is_drafted_with_every_key_the_cluster_answered(tmp_path: Path) -> None:
    text = draft("gpus", facts(), Answers(partition="gpu", setup=["module load cuda"]), when="today")
    data = yaml.safe_load(text)
    assert data["partition"] == "gpu" and data["nodes"] == {"default": 2, "max": 2}, data
    assert (data["gpus_per_node"], data["gpu_type"], data["exclusive"]) == (8, "a100", True), data
    assert data["cpus_per_task"] == 96 and data["mem"] == "980000M" and data["time_limit"] == "2-00:00:00"
    assert data["account"] == "ml" and data["qos"] == "normal" and "requeue_as" not in data, data
    assert "cred_expire is 120 s, so a stopped job comes back as a new job" in text
    assert data["network_interface"] == "ib0" and data["setup"] == ["module load cuda"], data
    assert "also allowed: high" in text and "pyxis (srun --container-image), enroot found" in text
    assert "# not learned: accounts and QOS of another user" in text
    assert write("gpus", text, tmp_path) == tmp_path / "gpus.yaml"
    with pytest.raises(UserError, match="exists; choose another name or pass --force"):
        write("gpus", text, tmp_path)


def test_the_default_partition_without_limits_gets_a_day_and_says_so() -> None:
    found = facts()
    found.partitions[0].max_time = None
    text = draft("c", found, Answers(), when="today")
    data = yaml.safe_load(text)
    assert data["partition"] == "cpu" and data["time_limit"] == "1-00:00:00" and "gpus_per_node" not in data
    assert "no MaxTime: one day" in text and data["nodes"] == {"default": 2, "max": 4}, data
    assert data["cpus_per_task"] == 64 and "setup:" not in data and "# setup:" in text


def test_an_unknown_partition_names_the_ones_there() -> None:
    with pytest.raises(
        UserError, match="--partition big: the cluster has no such partition; it has: cpu, gpu"
    ):
        draft("x", facts(), Answers(partition="big"))


def test_the_gpu_type_keeps_the_clusters_spelling_for_gres() -> None:
    """``--gres=gpu:TYPE:N`` must name the type as slurm.conf does (``A100``, ``tesla_v100``)."""
    found = facts()
    for node in found.nodes:
        node.gres = node.gres.replace("a100", "A100")
    data = yaml.safe_load(draft("gpus", found, Answers(partition="gpu"), when="today"))
    assert (data["gpus_per_node"], data["gpu_type"]) == (8, "A100"), data


#: A partition with two GPU types, as Slurm 22.05's ``scontrol show partition -o`` / ``show node -o``
#: print it (every field, in Slurm's order; ``OS=`` holds spaces). Listed first: the two h100 nodes;
#: three a100 nodes follow, so the type on most nodes is not the first one found.
MIXED_PARTITIONS = (
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES "
    "QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED "
    "MaxTime=1-00:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=a[01-03],h[01-02] "
    "PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE "
    "PreemptMode=OFF State=UP TotalCPUs=448 TotalNodes=5 SelectTypeParameters=NONE JobDefaults=(null) "
    "DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=448,mem=3500000M,node=5,billing=448,gres/gpu=28\n"
)


def node_line(name: str, cpus: int, mem: int, gres: str) -> str:
    gpus = sum(int(item.split("(")[0].split(":")[-1]) for item in gres.split(",") if item.startswith("gpu:"))
    tres = f",gres/gpu={gpus}" if gpus else ""
    return (
        f"NodeName={name} Arch=x86_64 CoresPerSocket={cpus // 2} CPUAlloc=0 CPUEfctv={cpus} CPUTot={cpus} "
        f"CPULoad=0.02 AvailableFeatures=(null) ActiveFeatures=(null) Gres={gres} NodeAddr={name} "
        f"NodeHostName={name} Version=22.05.8 OS=Linux 5.15.0-91-generic #101-Ubuntu SMP Tue Nov 14 "
        f"13:30:08 UTC 2023 RealMemory={mem} AllocMem=0 FreeMem={mem - 9000} Sockets=2 Boards=1 State=IDLE "
        "ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu "
        "BootTime=2024-01-08T09:12:44 SlurmdStartTime=2024-01-08T09:13:10 LastBusyTime=2024-01-09T17:02:11 "
        f"CfgTRES=cpu={cpus},mem={mem}M,billing={cpus}{tres} AllocTRES= CapWatts=n/a "
        "CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s\n"
    )


MIXED_NODES = (
    node_line("a01", 64, 500000, "gpu:a100:4(S:0-1)")
    + node_line("a02", 64, 490000, "gpu:a100:4(S:0-1)")
    + node_line("a03", 64, 500000, "gpu:a100:4(S:0-1)")
    + node_line("h01", 128, 1000000, "gpu:h100:8(S:0-1)")
    + node_line("h02", 128, 1000000, "gpu:h100:8(S:0-1)")
)


def mixed(nodes: str = MIXED_NODES) -> ClusterFacts:
    return ClusterFacts(partitions=parse_partitions(MIXED_PARTITIONS), nodes=parse_nodes(nodes))


def test_several_gpu_types_draft_the_one_on_most_nodes_and_name_every_type(tmp_path: Path) -> None:
    # scontrol lists nodes by name; here the h100 nodes come first to prove the count decides.
    facts = mixed(MIXED_NODES.split("\n", 3)[3] + "".join(MIXED_NODES.splitlines(True)[:3]))
    assert [n.name for n in facts.nodes] == ["h01", "h02", "a01", "a02", "a03"]
    text = draft("mixed", facts, Answers(), when="today")
    data = yaml.safe_load(text)
    assert (data["gpus_per_node"], data["gpu_type"], data["exclusive"]) == (4, "a100", True), text
    # Sized by the a100 nodes (Slurm runs --gres=gpu:a100:4 there only): 3 of them, their CPUs, memory.
    assert data["nodes"] == {"default": 2, "max": 3} and data["cpus_per_task"] == 64, text
    assert data["mem"] == "490000M" and "# the partition's 3 node(s) with a100 GPUs" in text, text
    types = "GPU types of partition gpu (its nodes' GRES): h100 on 2 node(s), 8 GPUs each; a100 on 3 node(s), 4 GPUs each"
    assert f"# {types}\n" in text, text
    assert (
        "gpus_per_node: 4  # the a100 nodes' GRES: the type on most of the partition's nodes (--gpu-type "
        "picks another)\n" in text
    ), text
    assert "CPUs of the partition's smallest node with a100 GPUs" in text, text
    assert (
        gpu_note(facts, Answers())
        == f"{types}; drafted a100 (the type on most of the partition's nodes); --gpu-type TYPE picks another"
    )
    assert write("mixed", text, tmp_path).exists()  # validates as profiles validate does


def test_a_tie_drafts_the_type_slurm_lists_first() -> None:
    nodes = "".join(MIXED_NODES.splitlines(True)[1:])  # a100 x 2 (listed first), h100 x 2
    data = yaml.safe_load(draft("tie", mixed(nodes), Answers(), when="today"))
    assert (data["gpus_per_node"], data["gpu_type"], data["nodes"]["max"]) == (4, "a100", 2), data


@pytest.mark.parametrize("asked", ["h100", "H100"])
def test_gpu_type_picks_another_type_spelled_as_the_cluster_does(asked: str) -> None:
    facts = mixed()
    text = draft("h", facts, Answers(gpu_type=asked), when="today")
    data = yaml.safe_load(text)
    assert (data["gpus_per_node"], data["gpu_type"]) == (8, "h100"), text
    assert data["nodes"] == {"default": 2, "max": 2} and data["cpus_per_task"] == 128, text
    assert data["mem"] == "1000000M" and "gpus_per_node: 8  # the h100 nodes' GRES: --gpu-type\n" in text, (
        text
    )
    note = gpu_note(facts, Answers(gpu_type=asked))
    assert note is not None and note.endswith("; drafted h100 (--gpu-type)"), note


def test_a_gpu_type_the_partition_lacks_names_the_partition_and_its_types() -> None:
    with pytest.raises(UserError) as raised:
        draft("x", mixed(), Answers(gpu_type="v100"))
    assert str(raised.value) == (
        "--gpu-type v100: partition gpu has no such GPU type; it has its GPU types: "
        "a100 on 3 node(s), 4 GPUs each; h100 on 2 node(s), 8 GPUs each"
    )
    with pytest.raises(
        UserError, match="--gpu-type a100: partition cpu has no such GPU type; it has no GPUs"
    ):
        draft("x", facts(), Answers(partition="cpu", gpu_type="a100"))


def test_one_gpu_type_or_gpus_without_a_type_are_drafted_as_before() -> None:
    for gres, kind in (("gpu:a100:8(S:0-1)", "a100"), ("gpu:8(S:0-1)", None)):
        nodes = node_line("a01", 64, 500000, gres) + node_line("a02", 64, 500000, gres)
        found = mixed(nodes)
        text = draft("one", found, Answers(), when="today")
        data = yaml.safe_load(text)
        assert data["gpus_per_node"] == 8 and data.get("gpu_type") == kind, text
        assert data["nodes"] == {"default": 2, "max": 5} and "GPU types" not in text, text  # Nodes= lists 5
        assert "gpus_per_node: 8  # the nodes' GRES\n" in text and gpu_note(found, Answers()) is None, text


def test_gpus_on_some_nodes_stay_a_cpu_profile_unless_a_type_is_asked_for() -> None:
    nodes = node_line("a01", 64, 500000, "(null)") + "".join(MIXED_NODES.splitlines(True)[1:3])
    found = mixed(nodes)
    text = draft("part", found, Answers(), when="today")
    assert "gpus_per_node" not in yaml.safe_load(text), text
    assert "# GPU types of partition gpu (its nodes' GRES): a100 on 2 node(s), 4 GPUs each\n" in text, text
    assert "# gpus_per_node: none: 1 of the partition's 3 node(s) have no GPU; --gpu-type TYPE" in text, text
    note = gpu_note(found, Answers())
    assert note is not None and "1 node(s) have none, so the draft is a CPU profile" in note, note
    data = yaml.safe_load(draft("part", found, Answers(gpu_type="a100"), when="today"))
    assert (data["gpus_per_node"], data["gpu_type"], data["nodes"]["max"]) == (4, "a100", 2), data


def test_a_node_with_two_gpu_types_counts_each_for_its_own_type() -> None:
    """``--gres=gpu:a100:4`` cannot run on a node with two a100s and two v100s: each type its own count."""
    node = parse_nodes(node_line("m01", 64, 500000, "gpu:a100:2(S:0),gpu:v100:2(S:1)"))[0]
    assert node.gpu_kinds() == [("a100", 2), ("v100", 2)] and node.gpus() == (4, "a100")
    data = yaml.safe_load(
        draft(
            "m", mixed(node_line("m01", 64, 500000, "gpu:a100:2(S:0),gpu:v100:2(S:1)")), Answers(), when="t"
        )
    )
    assert (data["gpus_per_node"], data["gpu_type"]) == (2, "a100"), data


@pytest.fixture
def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """The CLI's environment with fake ``scontrol``/``sacctmgr``/``srun`` first on PATH, answering with
    the two-type partition above: a cluster with several GPU types cannot be made here (the test
    cluster has one, and is not this test's to reshape). Everything after them runs for real."""
    folder = tmp_path / "fake_slurm"
    folder.mkdir()
    (folder / "partitions.txt").write_text(MIXED_PARTITIONS)
    (folder / "nodes.txt").write_text(MIXED_NODES)
    scripts = {
        "scontrol": 'case "$2" in partition) cat "$(dirname "$0")/partitions.txt";; '
        'node) cat "$(dirname "$0")/nodes.txt";; config) echo "AuthInfo = cred_expire=120";; esac',
        "sacctmgr": "exit 0",
        "srun": "exit 0",
    }
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}",
        "ORCHESTRATOR_HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(REPO),
    }


def test_the_cli_refuses_a_gpu_type_the_partition_lacks_and_writes_nothing(
    fake_slurm: dict[str, str], tmp_path: Path
) -> None:
    profiles = tmp_path / "profiles"
    base = [
        "profiles",
        "init",
        "mixed",
        "--no-node-probe",
        "--setup",
        "true",
        "--profiles-dir",
        str(profiles),
    ]
    refused = run_cli([*base, "--gpu-type", "v100"], fake_slurm, timeout=60)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "orchestrator profiles: error: --gpu-type v100: partition gpu has no such GPU type; it has its GPU "
        "types: a100 on 3 node(s), 4 GPUs each; h100 on 2 node(s), 8 GPUs each"
    ], refused.stderr
    assert refused.stdout == "" and not profiles.exists(), refused.stdout

    chosen = run_cli(base, fake_slurm, timeout=60)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stderr.strip().splitlines() == [
        "profiles init: GPU types of partition gpu (its nodes' GRES): a100 on 3 node(s), 4 GPUs each; h100 "
        "on 2 node(s), 8 GPUs each; drafted a100 (the type on most of the partition's nodes); --gpu-type "
        "TYPE picks another"
    ], chosen.stderr
    assert yaml.safe_load((profiles / "mixed.yaml").read_text())["gpu_type"] == "a100"
    other = run_cli([*base, "--gpu-type", "h100", "--force"], fake_slurm, timeout=60)
    assert other.returncode == 0 and "drafted h100 (--gpu-type)" in other.stderr, other.stderr
    data = yaml.safe_load((profiles / "mixed.yaml").read_text())
    assert (data["gpus_per_node"], data["gpu_type"], data["nodes"]["max"]) == (8, "h100", 2), data
