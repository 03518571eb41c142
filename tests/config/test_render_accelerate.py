"""Rendered configs as Accelerate itself reads them, and as ``accelerate launch`` accepts them.

1. Every node config of every valid built-in combination loads with Accelerate's own
   loader (``load_config_from_file``) and carries the values the plan says.
2. ``accelerate launch --config_file <rendered> tiny.py`` runs for ddp, full_shard on
   FSDP1 and FSDP2 (one local node, two processes) and hybrid_shard on FSDP2 (two local
   "machines" on 127.0.0.1, static rendezvous, a free port). CPU only
   (ACCELERATE_USE_CPU=1); the process groups are killed on teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.preconditions import require_modules

require_modules("accelerate", "torch")

from accelerate.commands.config.config_args import load_config_from_file  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

from orchestrator.config.plan import LaunchPlan, build_plan, merge_options  # noqa: E402
from orchestrator.config.profile.load import ClusterProfile, parse_profile  # noqa: E402
from orchestrator.config.render import NodeRuntime, render_accelerate_config, sample_runtime  # noqa: E402
from orchestrator.config.strategies import STRATEGIES  # noqa: E402
from orchestrator.contract.errors import UserError  # noqa: E402
from tests.helpers.cli import REPO  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

LAUNCH_TIMEOUT = 90


def builtin(name: str) -> ClusterProfile:
    path = REPO / "cluster_profiles" / f"{name}.yaml"
    return parse_profile(path.read_text(encoding="utf-8"), f"cluster_profiles/{path.name}")


BUILTIN_NAMES = sorted(p.stem for p in (REPO / "cluster_profiles").glob("*.yaml"))


def valid_plans() -> list[tuple[str, LaunchPlan]]:
    plans = []
    for name in BUILTIN_NAMES:
        profile = builtin(name)
        nodes = max(profile.nodes.default, min(2, profile.nodes.max))
        for strategy in STRATEGIES:
            for version in (1, 2):
                options = merge_options(profile, strategy=strategy, fsdp_version=version)
                try:
                    plan = build_plan(name, profile, options, "train.py", nodes=nodes)
                except UserError:
                    continue
                plans.append((f"{name}-{strategy}-fsdp{version}", plan))
    return plans


PLANS = valid_plans()


# ------------------------------------------------------------------------- Accelerate's loader


@pytest.mark.parametrize(("label", "plan"), PLANS, ids=[label for label, _ in PLANS])
def test_loads_with_accelerate(label: str, plan: LaunchPlan, tmp_path: Path) -> None:
    strategy = plan.strategy
    for rank in range(plan.nodes):
        path = tmp_path / f"node{rank}.yaml"
        path.write_text(render_accelerate_config(plan, sample_runtime(plan, rank)))
        config = load_config_from_file(str(path))
        assert config.num_processes == plan.world_size
        assert config.num_machines == plan.nodes
        assert config.machine_rank == rank
        assert config.main_process_port == sample_runtime(plan).main_process_port
        assert str(config.mixed_precision) == plan.options.mixed_precision
        assert config.use_cpu is False
        if strategy.uses_deepspeed:
            assert config.distributed_type == DistributedType.DEEPSPEED
            assert config.deepspeed_config["zero_stage"] == strategy.deepspeed_stage
            assert config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
            assert not config.fsdp_config
            continue
        if not strategy.uses_fsdp:
            assert config.distributed_type == DistributedType.MULTI_GPU
            assert not config.fsdp_config
            assert not getattr(config, "parallelism_config", None)
            continue
        assert config.distributed_type == DistributedType.FSDP
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == plan.options.fsdp_version
        assert fsdp["fsdp_offload_params"] is plan.options.offload
        assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        if plan.options.fsdp_version == 1:
            assert fsdp["fsdp_sharding_strategy"] == strategy.fsdp1_sharding
            assert fsdp["fsdp_sync_module_states"] is (not plan.uses_cpu)
        else:
            assert fsdp["fsdp_reshard_after_forward"] is strategy.fsdp2_reshard_after_forward
        parallelism = getattr(config, "parallelism_config", None) or {}
        if strategy.hybrid and plan.options.fsdp_version == 2:
            assert parallelism["parallelism_config_dp_replicate_size"] == plan.nodes
            assert parallelism["parallelism_config_dp_shard_size"] == plan.procs_per_node
            assert (
                parallelism["parallelism_config_dp_replicate_size"]
                * parallelism["parallelism_config_dp_shard_size"]
                == config.num_processes
            )
        else:
            assert not parallelism


def test_loader_sees_cli_options(tmp_path: Path) -> None:
    """Options given on the command line reach the file Accelerate reads."""
    profile = builtin("slurm_a100")
    options = merge_options(
        profile,
        strategy="shard_grad_op",
        fsdp_version=1,
        offload=True,
        activation_checkpointing=True,
        state_dict="full",
        wrap_cls="Block",
        mixed_precision="fp16",
    )
    plan = build_plan("slurm_a100", profile, options, "train.py", nodes=3, procs_per_node=4)
    path = tmp_path / "c.yaml"
    path.write_text(render_accelerate_config(plan, NodeRuntime(2, "node-a.cluster", 29611)))
    config = load_config_from_file(str(path))
    assert (config.num_processes, config.num_machines, config.machine_rank) == (12, 3, 2)
    assert (config.main_process_ip, config.main_process_port) == ("node-a.cluster", 29611)
    assert str(config.mixed_precision) == "fp16"
    fsdp = config.fsdp_config
    assert fsdp["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    assert fsdp["fsdp_offload_params"] is True
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Block"


# ------------------------------------------------------------------------- accelerate launch

TINY_SCRIPT = """\
import json, os
keys = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_SHARDING_STRATEGY",
        "FSDP_RESHARD_AFTER_FORWARD", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE")
record = json.dumps({k: os.environ.get(k) for k in keys})
with open(os.path.join(os.environ["TINY_OUT"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    f.write(record)
print("TINY " + record, flush=True)
"""


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Callable[[Path, Path], subprocess.Popen[str]]]:
    """Start `accelerate launch` in its own process group; every group is killed on teardown."""
    procs: list[subprocess.Popen[str]] = []
    script = tmp_path / "tiny.py"
    script.write_text(TINY_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_"))}
    env.update(
        ACCELERATE_USE_CPU="1",
        OMP_NUM_THREADS="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HOME=str(tmp_path),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )

    def start(config: Path, out_dir: Path) -> subprocess.Popen[str]:
        out_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accelerate.commands.accelerate_cli",
                "launch",
                "--config_file",
                str(config),
                str(script),
            ],
            cwd=tmp_path,
            env={**env, "TINY_OUT": str(out_dir)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        # Always signal the whole group: torchrun's workers may outlive an exited launcher.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)


class PortTaken(Exception):
    """The rendezvous port was grabbed between choosing it and binding it."""


def finish(proc: subprocess.Popen[str], out_dir: Path) -> list[dict[str, str | None]]:
    """Wait for the launcher; each rank's record is read from its own file (stdout interleaves)."""
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"accelerate launch did not finish in {LAUNCH_TIMEOUT} s:\n{out}") from None
    if proc.returncode != 0 and ("EADDRINUSE" in out or "address already in use" in out.lower()):
        raise PortTaken(out)
    assert proc.returncode == 0, out[-6000:]
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]


def local_plan(strategy: str, fsdp_version: int, nodes: int) -> LaunchPlan:
    profile = builtin("local")
    options = merge_options(profile, strategy=strategy, fsdp_version=fsdp_version)
    return build_plan("local", profile, options, "tiny.py", nodes=nodes)


def launch(
    launcher: Callable[[Path, Path], subprocess.Popen[str]], plan: LaunchPlan, folder: Path
) -> list[list[dict[str, str | None]]]:
    """Launch every machine rank of the plan on 127.0.0.1; the rank records of each machine."""
    for attempt in range(3):
        port = free_port()
        tag = f"{plan.options.strategy}-fsdp{plan.options.fsdp_version}-try{attempt}"
        procs = []
        for rank in range(plan.nodes):
            config = folder / f"{tag}.node{rank}.yaml"
            config.write_text(render_accelerate_config(plan, NodeRuntime(rank, "127.0.0.1", port)))
            assert load_config_from_file(str(config)).rdzv_backend == "static"
            out_dir = folder / f"{tag}.out{rank}"
            procs.append((launcher(config, out_dir), out_dir))
        try:
            return [finish(proc, out_dir) for proc, out_dir in procs]
        except PortTaken:
            for proc, _ in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("no free rendezvous port in 3 tries")


SINGLE_NODE = [("ddp", 2), ("full_shard", 1), ("full_shard", 2)]


@pytest.mark.slow
def test_launch_single_node(launcher: Callable[[Path, Path], subprocess.Popen[str]], tmp_path: Path) -> None:
    """ddp, FSDP1 full_shard and FSDP2 full_shard: one local node, two processes each."""
    for strategy, version in SINGLE_NODE:
        plan = local_plan(strategy, version, nodes=1)
        (ranks,) = launch(launcher, plan, tmp_path)
        assert sorted(int(r["RANK"]) for r in ranks) == list(range(plan.world_size)), ranks  # type: ignore[arg-type]
        assert {r["WORLD_SIZE"] for r in ranks} == {str(plan.world_size)}
        if strategy == "ddp":
            assert all(r["ACCELERATE_USE_FSDP"] in (None, "false", "False") for r in ranks)
            continue
        assert {r["ACCELERATE_USE_FSDP"] for r in ranks} == {"true"}
        assert {r["FSDP_VERSION"] for r in ranks} == {str(version)}
        if version == 1:
            assert {r["FSDP_SHARDING_STRATEGY"] for r in ranks} == {"FULL_SHARD"}
        else:
            assert {str(r["FSDP_RESHARD_AFTER_FORWARD"]).lower() for r in ranks} == {"true"}


@pytest.mark.slow
def test_launch_hybrid_two_machines(
    launcher: Callable[[Path, Path], subprocess.Popen[str]], tmp_path: Path
) -> None:
    """hybrid_shard on FSDP2: two machine ranks on 127.0.0.1, static rendezvous, 2 x 2 processes."""
    plan = local_plan("hybrid_shard", 2, nodes=2)
    per_machine = launch(launcher, plan, tmp_path)
    all_ranks = sorted(int(r["RANK"]) for ranks in per_machine for r in ranks)  # type: ignore[arg-type]
    assert all_ranks == list(range(4))
    # Machine 0 hosts global ranks 0-1, machine 1 ranks 2-3.
    assert sorted(int(r["RANK"]) for r in per_machine[1]) == [2, 3]  # type: ignore[arg-type]
    for ranks in per_machine:
        assert {r["WORLD_SIZE"] for r in ranks} == {"4"}
        assert {r["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] for r in ranks} == {"2"}
        assert {r["PARALLELISM_CONFIG_DP_SHARD_SIZE"] for r in ranks} == {"2"}
        assert {r["FSDP_VERSION"] for r in ranks} == {"2"}
