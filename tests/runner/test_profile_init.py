"""``profiles init``'s pure part: scontrol/sacctmgr text in, a commented profile out that validates.
The real cluster's side (a shaped test cluster, a job submitted with the result):
tests/cluster/test_profile_init.py."""

from __future__ import annotations

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
from orchestrator.schedulers.slurm.profile_draft import Answers, draft

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
