"""The ``local_gpu`` profile: a workstation's GPUs through the local scheduler (issue 34, item 1).

Planning counts this machine's GPUs without torch (orchestrator/config/gpus.py) and gives the plan
one rank per GPU; the rendered Accelerate config and the training environment are a GPU node's (no
``ACCELERATE_USE_CPU``, NCCL's flight recorder on); simulated nodes split the GPUs between them; more
GPUs than the machine has is refused with the count. No GPU here: the count is given to
``fit_to_this_machine`` as :class:`GpuCount` records (a machine with N GPUs cannot be made for real).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config import gpus
from orchestrator.config.gpus import GpuCount, count_gpus, visible_devices_env
from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
from orchestrator.config.profile.load import load_profile
from orchestrator.config.render import render_accelerate_config, sample_runtime
from orchestrator.contract.errors import UserError
from orchestrator.node.entry import training_environment
from orchestrator.runner import planning
from orchestrator.runner.planning import fit_to_this_machine
from orchestrator.schedulers.base import NodeEnvironment
from orchestrator.schedulers.local.scheduler import LocalNodeEnvironment
from tests.helpers.cli import REPO, run_cli


def machine(n: int) -> GpuCount:
    return GpuCount(n, "test machine", tuple(str(i) for i in range(n)))


def gpu_plan(
    found: GpuCount, nodes: int | None = None, procs: int | None = None, **options: str
) -> LaunchPlan:
    name, _, profile = load_profile("local_gpu")
    fitted = fit_to_this_machine(name, profile, nodes, procs, found)
    return build_plan(name, fitted, merge_options(fitted, **options), "train/train.py", nodes=nodes,
                      procs_per_node=procs)  # fmt: skip


class FakeNode(NodeEnvironment):
    """Where a node stands, given instead of read from submitit (the planning side is under test)."""

    def __init__(self, node_rank: int = 0, num_nodes: int = 1) -> None:
        self.node_rank, self.num_nodes = node_rank, num_nodes
        self.hostnames, self.job_id, self.restarts = ["127.0.0.1"] * num_nodes, "7", 0

    def main_ip(self, plan: LaunchPlan, attempt_path: Path) -> str:
        return "127.0.0.1"

    def finish(self, plan: LaunchPlan, run_dir: Path, attempt: int, code: int) -> bool:
        return False


@pytest.mark.parametrize(
    "strategy", ["ddp", "full_shard", "shard_grad_op", "deepspeed_zero2", "deepspeed_zero3"]
)
def test_one_rank_per_gpu_found_and_a_gpu_config(strategy: str) -> None:
    plan = gpu_plan(machine(4), strategy=strategy, mixed_precision="bf16")
    assert (plan.nodes, plan.procs_per_node, plan.world_size) == (1, 4, 4)
    assert not plan.uses_cpu
    config = yaml.safe_load(render_accelerate_config(plan, sample_runtime(plan)))
    assert config["num_processes"] == 4 and config["num_machines"] == 1
    assert config["use_cpu"] is False and config["gpu_ids"] == "all"
    assert config["rdzv_backend"] == "static" and config["main_process_ip"] == "127.0.0.1"
    expected_type = {"ddp": "MULTI_GPU", "full_shard": "FSDP", "shard_grad_op": "FSDP"}.get(
        strategy, "DEEPSPEED"
    )
    assert config["distributed_type"] == expected_type
    if expected_type == "FSDP":
        assert config["fsdp_config"]["fsdp_version"] == 2
    text = render_accelerate_config(plan, sample_runtime(plan))
    assert "ACCELERATE_USE_CPU" not in text  # no CPU comment, no CPU advice


def test_training_environment_is_a_gpu_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")  # left over in the user's shell: must not reach ranks
    plan = gpu_plan(machine(2), strategy="full_shard")
    env = training_environment(plan, FakeNode(), tmp_path, 0)
    assert "ACCELERATE_USE_CPU" not in env
    assert env["ORCHESTRATOR_EXPECTED_WORLD_SIZE"] == "2"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # one node: untouched


def test_cpu_profile_still_sets_use_cpu(tmp_path: Path) -> None:
    name, _, profile = load_profile("local")
    plan = build_plan(name, profile, merge_options(profile), "train/train.py")
    assert training_environment(plan, FakeNode(), tmp_path, 0)["ACCELERATE_USE_CPU"] == "1"


def test_simulated_nodes_split_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = gpu_plan(machine(4), nodes=2)
    assert (plan.nodes, plan.procs_per_node, plan.profile.gpus_per_node) == (2, 2, 2)
    monkeypatch.setattr(gpus, "count_gpus", lambda env=None: GpuCount(4, "test", ("3", "5", "6", "7")))
    shares = []
    for rank in range(2):
        node = object.__new__(LocalNodeEnvironment)
        node.node_rank, node.num_nodes = rank, 2
        shares.append(node.device_environment(plan))
    assert shares == [{"CUDA_VISIBLE_DEVICES": "3,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    one = gpu_plan(machine(4))
    node = object.__new__(LocalNodeEnvironment)
    node.node_rank, node.num_nodes = 0, 1
    assert node.device_environment(one) == {}  # one node keeps the machine's environment


def test_profile_maximum_caps_the_machine() -> None:
    plan = gpu_plan(machine(16))
    assert plan.procs_per_node == 8  # local_gpu.yaml: gpus_per_node 8 is the most one node uses
    assert gpu_plan(machine(16), procs=2).world_size == 2


@pytest.mark.parametrize(
    ("found", "nodes", "procs", "words"),
    [
        (machine(1), None, 2, "--procs-per-node: 1 node(s) x 2 process(es) need 2 GPUs (one process per GPU), "
                              "but this machine has 1 (test machine)"),
        (machine(2), 2, 2, "need 4 GPUs"),
        (machine(1), 2, None, "--nodes: 2 simulated nodes need at least one GPU each, but this machine has 1"),
        (machine(0), None, None, "--profile local_gpu: trains on this machine's GPUs (gpus_per_node: 8), but "
                                 "none were found (test machine); use --profile local to train on CPU"),
    ],
)  # fmt: skip
def test_more_gpus_than_present_is_refused(
    found: GpuCount, nodes: int | None, procs: int | None, words: str
) -> None:
    with pytest.raises(UserError) as info:
        gpu_plan(found, nodes=nodes, procs=procs)
    assert words in str(info.value)


def test_planning_asks_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "count_gpus", lambda env=None: machine(3))
    plan = planning.plan_from_options(
        script="train/train.py", profile="local_gpu", options={"strategy": "ddp"}
    )
    assert plan.world_size == 3 and plan.profile.gpus_per_node == 3
    assert planning.plan_from_options(script="x.py", profile="local").uses_cpu  # CPU profiles never count


def test_visible_devices_parsing() -> None:
    assert visible_devices_env({}) is None
    assert visible_devices_env({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_devices_env({"CUDA_VISIBLE_DEVICES": "-1"}) == ()
    assert visible_devices_env({"CUDA_VISIBLE_DEVICES": "2, 0,-1,3"}) == ("2", "0")
    assert visible_devices_env({"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}) == ("GPU-abc", "GPU-def")
    hidden = count_gpus({"CUDA_VISIBLE_DEVICES": ""})
    assert hidden.count == 0 and hidden.visible == ()


def test_cli_without_gpus_says_so_and_imports_no_torch(orch_env: dict[str, str]) -> None:
    env = {**orch_env, "CUDA_VISIBLE_DEVICES": ""}  # no GPU whatever the machine has
    res = run_cli(
        ["submit", "--profile", "local_gpu", "--", str(REPO / "train" / "train.py")], env, timeout=60
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--profile local_gpu: trains on this machine's GPUs" in res.stderr
    assert "use --profile local to train on CPU" in res.stderr
    assert "Traceback" not in res.stderr
    probe = (
        "import sys; from orchestrator.config.gpus import count_gpus; count_gpus(); "
        "import orchestrator.runner.planning; assert 'torch' not in sys.modules"
    )
    import subprocess

    assert subprocess.run([sys.executable, "-c", probe], cwd=REPO, timeout=60).returncode == 0


ENV_PROBE = """
import os, sys
out = sys.argv[1]
with open(f"{out}.rank{os.environ['RANK']}", "w") as fh:
    fh.write(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
"""


@pytest.mark.parametrize(("nodes", "expected"), [(1, ["0,1", "0,1"]), (2, ["0", "1"])])
def test_submitted_ranks_see_the_gpus(
    orch_env: dict[str, str], tmp_path: Path, nodes: int, expected: list[str]
) -> None:
    """Through ``submit`` for real (submitit's LocalExecutor, the node entry, the direct launcher): the
    ranks' ``CUDA_VISIBLE_DEVICES``. submitit sets it to the GPUs it was asked for, none by default,
    and every local_gpu rank trained on CPU on an H200 (issue 34's first device run). The machine's two
    GPUs come from an ``nvidia-smi`` stand-in on PATH (a GPU cannot be made here); the ranks run a
    script that only writes what it sees."""
    bin_dir = tmp_path / "standin_bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: stand-in (UUID: GPU-a)'\necho 'GPU 1: stand-in (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    script = tmp_path / "env_probe.py"
    script.write_text(ENV_PROBE)
    out = tmp_path / "seen"
    env = {k: v for k, v in orch_env.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    res = run_cli(
        ["submit", "--profile", "local_gpu", "--nodes", str(nodes), "--wait", "--poll", "0.5", "--",
         str(script), str(out)],
        env,
        timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert [Path(f"{out}.rank{r}").read_text() for r in range(2)] == expected
