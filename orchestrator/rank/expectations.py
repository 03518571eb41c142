"""What the job asked for, as every rank sees it: the self-check's expectations.

Expectations come from the launcher (``ORCHESTRATOR_EXPECTED_WORLD_SIZE``,
``ORCHESTRATOR_EXPECTED_NUM_NODES``, ``ORCHESTRATOR_PROCS_PER_NODE``,
``ORCHESTRATOR_STRATEGY``, ``ORCHESTRATOR_FSDP_VERSION``); when it did not set
them (run by hand), from what ``accelerate launch`` left in the environment
(``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` from torchrun, ``ACCELERATE_USE_FSDP``,
``FSDP_*``, ``PARALLELISM_CONFIG_*``) and, for a single process, the
``--num_processes`` / config file of the parent ``accelerate launch``.
Standard library only: the node-side hooks import it before torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.config.strategies import STRATEGIES as STRATEGY_TABLE
from orchestrator.config.strategies import STRATEGY_NAMES
from orchestrator.contract.env import (
    EXPECTED_NUM_NODES_ENV,
    EXPECTED_WORLD_SIZE_ENV,
    FSDP_VERSION_ENV,
    PROCS_PER_NODE_ENV,
    STRATEGY_ENV,
)

#: The strategy facts the checks compare against: orchestrator's own table, so a strategy added
#: there is checked here too.
STRATEGIES = STRATEGY_NAMES
HYBRID = tuple(name for name, s in STRATEGY_TABLE.items() if s.hybrid)
#: FSDP1 ShardingStrategy name per strategy.
FSDP1_SHARDING = {
    name: s.fsdp1_sharding for name, s in STRATEGY_TABLE.items() if s.fsdp1_sharding is not None
}
#: FSDP2 reshard_after_forward per strategy (no_shard has no FSDP2 form).
FSDP2_RESHARD = {
    name: s.fsdp2_reshard_after_forward
    for name, s in STRATEGY_TABLE.items()
    if s.uses_fsdp and s.fsdp2_reshard_after_forward is not None
}
#: DeepSpeed ZeRO stage per strategy.
DEEPSPEED_STAGE = {
    name: s.deepspeed_stage for name, s in STRATEGY_TABLE.items() if s.deepspeed_stage is not None
}


class SelfCheckError(RuntimeError):
    pass


@dataclass
class Expectation:
    source: str
    world_size: int | None = None
    num_nodes: int | None = None
    procs_per_node: int | None = None
    strategy: str | None = None
    fsdp_version: int | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        parts = []
        if self.world_size is not None:
            parts.append(f"world size {self.world_size}")
        if self.num_nodes is not None:
            parts.append(f"{self.num_nodes} node(s)")
        if self.procs_per_node is not None:
            parts.append(f"{self.procs_per_node} process(es)/node")
        if self.strategy is not None:
            fsdp = self.strategy not in ("ddp", *DEEPSPEED_STAGE) and self.fsdp_version
            version = f" (FSDP{self.fsdp_version})" if fsdp else ""
            parts.append(f"strategy {self.strategy}{version}")
        return ", ".join(parts) or "nothing"


def _int_env(env: dict[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SelfCheckError(f"{name}={value!r}: expected an integer") from None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def _strategy_from_accelerate_env(env: dict[str, str]) -> tuple[str | None, int | None]:
    """What the FSDP_* / PARALLELISM_CONFIG_* (ACCELERATE_DEEPSPEED_*) variables written by
    ``accelerate launch`` ask for."""
    if _truthy(env.get("ACCELERATE_USE_DEEPSPEED")):
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "").strip()
        by_stage = {str(v): k for k, v in DEEPSPEED_STAGE.items()}
        return by_stage.get(stage), None
    if not _truthy(env.get("ACCELERATE_USE_FSDP")):
        return None, None
    version = int(env.get("FSDP_VERSION", "1") or 1)
    replicate = int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1") or 1)
    if version == 1:
        raw = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().upper()
        names = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
        if raw.isdigit() and 1 <= int(raw) <= 5:
            raw = names[int(raw) - 1]
        if raw == "HYBRID_SHARD_ZERO2":
            raw = "_HYBRID_SHARD_ZERO2"
        by_name = {v: k for k, v in FSDP1_SHARDING.items()}
        return by_name.get(raw), 1
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower() != "false"
    if replicate > 1:
        return ("hybrid_shard" if reshard else "hybrid_shard_zero2"), 2
    return ("full_shard" if reshard else "shard_grad_op"), 2


def _parent_launch_request() -> tuple[int | None, str | None, str | None]:
    """(num_processes, distributed_type, where) asked of a parent ``accelerate launch``, if any."""
    try:
        import psutil
        import yaml
    except ImportError:
        return None, None, None
    try:
        proc = psutil.Process()
        ancestors = proc.parents()[:3]
    except (psutil.Error, OSError):
        return None, None, None
    for parent in ancestors:
        try:
            argv = parent.cmdline()
        except (psutil.Error, OSError):
            continue
        head = " ".join(argv[:4])
        if "accelerate" not in head or "launch" not in head:
            continue
        num, dtype, config = None, None, None
        for i, arg in enumerate(argv):
            value = argv[i + 1] if i + 1 < len(argv) else None
            if arg.startswith("--num_processes="):
                num = int(arg.split("=", 1)[1])
            elif arg == "--num_processes" and value:
                num = int(value)
            elif arg.startswith("--config_file="):
                config = arg.split("=", 1)[1]
            elif arg == "--config_file" and value:
                config = value
        if config is None:
            default = (
                Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface"))
                / "accelerate/default_config.yaml"
            )
            config = str(default) if default.is_file() else None
        if config:
            try:
                path = Path(config) if os.path.isabs(config) else Path(parent.cwd()) / config
                data = yaml.safe_load(path.read_text()) or {}
                num = num if num is not None else data.get("num_processes")
                dtype = data.get("distributed_type")
            except (OSError, yaml.YAMLError, psutil.Error):
                pass
        return (
            (int(num) if num is not None else None),
            dtype,
            f"the parent `accelerate launch` ({config or 'flags'})",
        )
    return None, None, None


#: What the node entry tells every rank the job asked for; any of them present: the launcher's word.
LAUNCHER_VARIABLES = (
    EXPECTED_WORLD_SIZE_ENV,
    EXPECTED_NUM_NODES_ENV,
    PROCS_PER_NODE_ENV,
    STRATEGY_ENV,
    FSDP_VERSION_ENV,
)


def expectations_from_env(env: dict[str, str] | None = None, look_at_parent: bool = True) -> Expectation:
    env = dict(os.environ if env is None else env)
    if any(k in env for k in LAUNCHER_VARIABLES):
        exp = Expectation(source="the launcher (ORCHESTRATOR_* environment)")
        exp.world_size = _int_env(env, EXPECTED_WORLD_SIZE_ENV)
        exp.num_nodes = _int_env(env, EXPECTED_NUM_NODES_ENV)
        exp.procs_per_node = _int_env(env, PROCS_PER_NODE_ENV)
        strategy = env.get(STRATEGY_ENV, "").strip() or None
        if strategy is not None and strategy not in STRATEGIES:
            raise SelfCheckError(
                f"ORCHESTRATOR_STRATEGY={strategy!r}: expected one of {', '.join(STRATEGIES)}"
            )
        exp.strategy = strategy
        exp.fsdp_version = _int_env(env, FSDP_VERSION_ENV)
        if exp.world_size is None and exp.num_nodes and exp.procs_per_node:
            exp.world_size = exp.num_nodes * exp.procs_per_node
        return exp
    exp = Expectation(source="the Accelerate launch environment (no ORCHESTRATOR_* variables: run by hand)")
    exp.world_size = _int_env(env, "WORLD_SIZE")
    exp.procs_per_node = _int_env(env, "LOCAL_WORLD_SIZE")
    if exp.world_size and exp.procs_per_node:
        exp.num_nodes = exp.world_size // exp.procs_per_node
    exp.strategy, exp.fsdp_version = _strategy_from_accelerate_env(env)
    if exp.strategy is None and exp.world_size and exp.world_size > 1:
        exp.strategy = "ddp"
    if exp.world_size is None and look_at_parent:
        num, dtype, where = _parent_launch_request()
        if num is not None and num > 1:
            exp.world_size = num
            exp.source = where or exp.source
            if dtype == "MULTI_CPU":
                exp.notes.append(
                    "distributed_type MULTI_CPU makes `accelerate launch` start ONE process without mpirun; "
                    "on CPU use a MULTI_GPU or FSDP config with ACCELERATE_USE_CPU=1"
                )
    return exp


def cpu_only_build(torch: Any) -> bool:
    """Whether ``torch`` is built for neither CUDA nor ROCm: it sees no GPU whatever the node has.
    Shared by the self-check, the preflight and the doctor."""
    version = getattr(torch, "version", None)
    return getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None


def training_alone_hint() -> str:
    """Why each process trains alone; a GPU config whose torch sees no GPU says so ("set
    ACCELERATE_USE_CPU=1" alone is the wrong advice on a GPU cluster)."""
    import socket

    import torch

    launched_as_group = (_int_env(dict(os.environ), "WORLD_SIZE") or 1) > 1  # torchrun's, for a GPU config
    if (
        launched_as_group
        and not _truthy(os.environ.get("ACCELERATE_USE_CPU"))
        and not torch.cuda.is_available()
    ):
        build = "a CPU-only build" if cpu_only_build(torch) else f"built for CUDA {torch.version.cuda}"
        return (
            f" Each process is training alone: the config is a GPU one, but torch {torch.__version__} ({build})"
            f" on {socket.gethostname()} sees no CUDA device. On GPU nodes install a CUDA build of torch; on"
            " CPU nodes use a profile with gpus_per_node: 0 (by hand: ACCELERATE_USE_CPU=1)."
        )
    return (
        " Each process is training alone: a GPU-style (MULTI_GPU/FSDP) config on a CPU machine needs "
        "ACCELERATE_USE_CPU=1, and a MULTI_CPU config or `--cpu` starts only one process."
    )
