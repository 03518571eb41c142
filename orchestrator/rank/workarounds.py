"""Every workaround for Accelerate (1.15.0) / torch (2.13) behaviour, in one place.

Most are about CPU; ``fsdp2_size_based_wrap`` and ``fsdp2_fp32_reduce`` are wrong on GPUs as well.

One function per workaround; each says what Accelerate (or torch under it) does
wrong, so it can be deleted when that is fixed. ``train.py`` calls them through
the small lifecycle hooks at the bottom (``before_accelerator``,
``after_accelerator``, ``wrap_model``, ``before_load_state``, ``finish``).

For tests, ``ORCHESTRATOR_DISABLE_WORKAROUNDS`` (comma-separated names from
``WORKAROUNDS``, or ``all``) turns workarounds off, so the self-check can be
shown to catch what Accelerate does without them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import DeviceMesh

WORKAROUNDS = (
    "fsdp_on_cpu",
    "cpu_device_index",
    "parallelism_config_on_cpu",
    "sync_module_states_on_cpu",
    "fsdp1_hybrid_mesh",
    "fsdp1_optimizer_state_on_load",
    "wait_before_end_training",
    "fsdp2_size_based_wrap",
    "fsdp2_fp32_reduce",
)


def disabled(name: str) -> bool:
    value = os.environ.get("ORCHESTRATOR_DISABLE_WORKAROUNDS", "")
    names = {n.strip() for n in value.split(",") if n.strip()}
    return "all" in names or name in names


def _truthy(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def on_cpu_only_machine() -> bool:
    return _truthy("ACCELERATE_USE_CPU") or not torch.cuda.is_available()


@dataclass
class Pending:
    """What ``before_accelerator`` took out of Accelerate's hands, to be applied after it."""

    fsdp_requested: bool = False
    fsdp_plugin: Any = None
    """A ``FullyShardedDataParallelPlugin`` the script passed to ``Accelerator()`` (which drops it on CPU)."""
    parallelism_config_env: dict[str, str] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------
# The workarounds


def _fsdp_plugin(
    workaround: str, accelerator: Accelerator, fsdp_version: int
) -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin when ``workaround`` is enabled and the run is FSDP of that version, else None."""
    from accelerate.utils import DistributedType

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if (
        disabled(workaround)
        or accelerator.distributed_type != DistributedType.FSDP
        or plugin is None
        or plugin.fsdp_version != fsdp_version
    ):
        return None
    return plugin


def _set_state(accelerator: Accelerator, name: str, value: object) -> None:
    """Set a field of Accelerate's process state so that it sticks: ``AcceleratorState()`` is rebuilt all
    over Accelerate and each time copies PartialState's fields over its own, so set both."""
    from accelerate.state import PartialState

    setattr(accelerator.state, name, value)
    if name in PartialState._shared_state:
        PartialState._shared_state[name] = value


def defer_parallelism_config_on_cpu(pending: Pending) -> None:
    """Accelerate validates ``ParallelismConfig`` inside ``Accelerator()``, before FSDP can be enabled
    on CPU (see ``enable_fsdp_on_cpu``): with distributed type MULTI_CPU it raises "ParallelismConfig is
    only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device}". So the env switch
    is hidden from ``Accelerator()`` and ``apply_parallelism_config_on_cpu`` applies it afterwards."""
    if disabled("parallelism_config_on_cpu") or not on_cpu_only_machine():
        return
    if _truthy("ACCELERATE_USE_PARALLELISM_CONFIG"):
        pending.parallelism_config_env["ACCELERATE_USE_PARALLELISM_CONFIG"] = os.environ.pop(
            "ACCELERATE_USE_PARALLELISM_CONFIG"
        )


def enable_fsdp_on_cpu(accelerator: Accelerator, pending: Pending) -> None:
    """Accelerate enables FSDP only for GPU-like devices: on CPU (``ACCELERATE_USE_CPU=1``) it keeps the
    distributed type MULTI_CPU and silently drops the FSDP plugin, so the run is plain DDP. Put the
    plugin (built from the same FSDP_* env vars Accelerate reads) back and set the type to FSDP."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if disabled("fsdp_on_cpu") or not pending.fsdp_requested:
        return
    if state.distributed_type == DistributedType.FSDP or accelerator.device.type != "cpu":
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        return  # nothing to fix (a single process); the self-check reports it
    plugin = getattr(state, "fsdp_plugin", None) or pending.fsdp_plugin or FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state.fsdp_plugin = plugin
    _set_state(accelerator, "distributed_type", DistributedType.FSDP)
    pending.applied.append("fsdp_on_cpu")


def use_cpu_device_without_index(accelerator: Accelerator, pending: Pending) -> None:
    """For MULTI_CPU Accelerate sets the device to ``cpu:0``; FSDP then compares it with the ``cpu``
    its tensors live on and fails: "Inconsistent compute device and device_id on rank 0: cpu vs cpu:0"."""
    if disabled("cpu_device_index"):
        return
    if accelerator.device.type == "cpu" and accelerator.device.index is not None:
        _set_state(accelerator, "device", torch.device("cpu"))
        pending.applied.append("cpu_device_index")


def disable_sync_module_states_on_cpu(accelerator: Accelerator, pending: Pending) -> None:
    """``fsdp_sync_module_states: true`` on CPU fails in FSDP1 with "RuntimeError: There are currently no
    available devices found" (it broadcasts from an accelerator device). Every rank builds the model from
    the same seed, so there is nothing to synchronise: switch it off, loudly."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if disabled("sync_module_states_on_cpu") or plugin is None or accelerator.device.type != "cpu":
        return
    if getattr(plugin, "sync_module_states", False):
        plugin.sync_module_states = False
        if getattr(plugin, "cpu_ram_efficient_loading", False):
            plugin.cpu_ram_efficient_loading = False  # needs sync_module_states
        if accelerator.is_main_process:
            warnings.warn(
                "fsdp_sync_module_states=true does not work on CPU; switched off "
                "(every rank initialises the model from the same seed)",
                stacklevel=2,
            )
        pending.applied.append("sync_module_states_on_cpu")


def apply_parallelism_config_on_cpu(accelerator: Accelerator, pending: Pending) -> None:
    """Second half of ``defer_parallelism_config_on_cpu``: build the replicate x shard ParallelismConfig
    (HSDP on FSDP2) and its CPU device mesh now that the distributed type is FSDP."""
    if not pending.parallelism_config_env:
        return
    from accelerate.parallelism_config import ParallelismConfig

    os.environ.update(pending.parallelism_config_env)
    config = ParallelismConfig()  # reads PARALLELISM_CONFIG_* like Accelerator() would
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh("cpu")
    config._validate_accelerator(accelerator)
    pending.applied.append("parallelism_config_on_cpu")


def fsdp1_hybrid_device_mesh(accelerator: Accelerator) -> DeviceMesh | None:
    """FSDP1 HYBRID_SHARD / _HYBRID_SHARD_ZERO2 without a device mesh sizes its shard groups by
    ``torch.cpu.device_count()`` (1 on CPU): one-rank shard groups, a warning "switching to NO_SHARD",
    and gradients never synchronised across nodes. Accelerate passes no mesh (and has no option for
    one), so return the explicit 2-D mesh (replicate = nodes, shard = processes per node), or None
    where none is needed. ``wrap_model`` wraps the model with it before ``accelerator.prepare``."""
    plugin = _fsdp_plugin("fsdp1_hybrid_mesh", accelerator, fsdp_version=1)
    if plugin is None or accelerator.device.type != "cpu":
        return None
    from torch.distributed.fsdp import ShardingStrategy

    if plugin.sharding_strategy not in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    per_node = procs_per_node(world)
    return init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def procs_per_node(world: int) -> int:
    """Processes per node: the launcher's word first, then torchrun's LOCAL_WORLD_SIZE."""
    for name in ("ORCHESTRATOR_PROCS_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name)
        if value and value.isdigit() and int(value) > 0 and world % int(value) == 0:
            return int(value)
    return world


def wrap_fsdp1_with_mesh(
    accelerator: Accelerator, model: torch.nn.Module, mesh: DeviceMesh
) -> torch.nn.Module:
    """Wrap with FSDP1 exactly as ``Accelerator.prepare_model`` would, plus ``device_mesh`` (which it
    cannot pass). Accelerate sees an FSDP module afterwards and does not wrap it again."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)
    return FSDP(
        model,
        sharding_strategy=plugin.sharding_strategy,
        cpu_offload=plugin.cpu_offload,
        auto_wrap_policy=plugin.auto_wrap_policy,
        mixed_precision=plugin.mixed_precision_policy,
        sync_module_states=plugin.sync_module_states,
        backward_prefetch=plugin.backward_prefetch,
        forward_prefetch=plugin.forward_prefetch,
        use_orig_params=plugin.use_orig_params,
        limit_all_gathers=plugin.limit_all_gathers,
        device_id=accelerator.device,
        device_mesh=mesh,
    )


def fsdp2_size_based_wrap(accelerator: Accelerator, pending: Pending) -> None:
    """Accelerate's FSDP2 version of SIZE_BASED_WRAP (``fsdp2_prepare_auto_wrap_policy``) claims to mimic
    FSDP1's but differs in two ways: it wraps ``nn.ModuleList``/``nn.ModuleDict`` containers, which
    ``fully_shard`` refuses ("fully_shard does not support containers that do not implement forward":
    every model that keeps its blocks in a ModuleList larger than ``min_num_params`` fails, e.g. our
    ``small`` and ``base`` presets), and it counts parameters already sharded by wrapped children, so
    every ancestor of a large module becomes a unit of its own. Replace the policy with FSDP1's rule:
    containers are never wrapped, and only parameters not yet in a wrapped descendant count. Accelerate
    applies the policy bottom-up and shards each match at once, so "wrapped" is ``FSDPModule``."""
    if _fsdp_plugin("fsdp2_size_based_wrap", accelerator, fsdp_version=2) is None:
        return
    import functools

    import accelerate.utils.fsdp_utils as fsdp_utils
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    accelerate_policy = fsdp_utils.fsdp2_prepare_auto_wrap_policy
    if getattr(accelerate_policy, "_orchestrator_patched", False):
        return

    def unwrapped_numel(module: torch.nn.Module) -> int:
        total = sum(p.numel() for p in module.parameters(recurse=False))
        return total + sum(unwrapped_numel(c) for c in module.children() if not isinstance(c, FSDPModule))

    def prepare_policy(
        fsdp2_plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module
    ) -> Callable[[torch.nn.Module], bool] | None:
        fn = fsdp2_plugin.auto_wrap_policy
        fn = fn.func if isinstance(fn, functools.partial) else fn
        if fn is not size_based_auto_wrap_policy:
            return accelerate_policy(fsdp2_plugin, model)
        # Logged as applied only now: installed, it changes nothing for transformer-based wrapping.
        if "fsdp2_size_based_wrap" not in pending.applied:
            pending.applied.append("fsdp2_size_based_wrap")
        containers = (torch.nn.ModuleList, torch.nn.ModuleDict)

        def policy(module: torch.nn.Module) -> bool:
            if isinstance(module, containers):
                return False
            return unwrapped_numel(module) > fsdp2_plugin.min_num_params

        return policy

    prepare_policy._orchestrator_patched = True  # type: ignore[attr-defined]
    fsdp_utils.fsdp2_prepare_auto_wrap_policy = prepare_policy


def fsdp2_fp32_reduce(accelerator: Accelerator, pending: Pending) -> None:
    """With ``mixed_precision: bf16`` (or fp16) Accelerate builds FSDP2's policy as
    ``MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low, output_dtype=low)``: gradients are
    reduce-scattered across ranks in 16 bits (the sum of N ranks' gradients rounded to 8 mantissa
    bits), and the root module's outputs are cast to 16 bits, so a loss the model computes in fp32
    comes back rounded (bf16 losses move in steps of 1/32 near 5). Keep the 16-bit parameters for
    compute, but reduce gradients and return outputs in fp32, as FSDP1's default does for buffers and
    as torch's FSDP2 recipes do. Only Accelerate's own default is replaced: a policy the script built
    with other dtypes is left alone."""
    plugin = _fsdp_plugin("fsdp2_fp32_reduce", accelerator, fsdp_version=2)
    if plugin is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = plugin.mixed_precision_policy
    if not isinstance(policy, MixedPrecisionPolicy):
        return
    low = policy.param_dtype
    if low not in (torch.bfloat16, torch.float16) or policy.reduce_dtype != low or policy.output_dtype != low:
        return
    plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=low,
        reduce_dtype=torch.float32,
        output_dtype=torch.float32,
        cast_forward_inputs=policy.cast_forward_inputs,
    )
    pending.applied.append("fsdp2_fp32_reduce")


def init_fsdp1_optimizer_state(accelerator: Accelerator, optimizer: torch.optim.Optimizer) -> None:
    """``load_state`` with FSDP1 builds its load template from the live optimizer; one that never
    stepped has no state, so the checkpoint's optimizer state is silently dropped (moments restart at
    zero, losses drift, no error). Initialise the state (a zero-lr step on zero gradients) first."""
    from accelerate.utils import DistributedType
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if disabled("fsdp1_optimizer_state_on_load"):
        return
    if (
        accelerator.distributed_type == DistributedType.FSDP
        and plugin is not None
        and plugin.fsdp_version == 1
    ):
        _init_optim_state(getattr(optimizer, "optimizer", optimizer))


def wait_before_end_training(accelerator: Accelerator) -> None:
    """An FSDP run that reaches ``end_training()`` (process-group teardown) while another rank is still
    working aborts with SIGABRT ("terminate called without an active exception"). Barrier first."""
    if disabled("wait_before_end_training"):
        return
    accelerator.wait_for_everyone()


# ---------------------------------------------------------------------------
# Lifecycle hooks used by train.py


def before_accelerator() -> Pending:
    pending = Pending(fsdp_requested=_truthy("ACCELERATE_USE_FSDP"))
    defer_parallelism_config_on_cpu(pending)
    return pending


def after_accelerator(accelerator: Accelerator, pending: Pending) -> list[str]:
    """Fix the freshly built Accelerator in place; returns the names of the workarounds applied."""
    enable_fsdp_on_cpu(accelerator, pending)
    if accelerator.distributed_type.value == "FSDP":
        use_cpu_device_without_index(accelerator, pending)
        disable_sync_module_states_on_cpu(accelerator, pending)
        apply_parallelism_config_on_cpu(accelerator, pending)
        fsdp2_size_based_wrap(accelerator, pending)
        fsdp2_fp32_reduce(accelerator, pending)
    elif pending.parallelism_config_env:
        os.environ.update(pending.parallelism_config_env)
    return pending.applied


def wrap_model(
    accelerator: Accelerator, model: torch.nn.Module, pending: Pending | None = None
) -> torch.nn.Module:
    """Before the optimizer is built and before ``accelerator.prepare``: also where a ``--wrap-cls``
    the model lacks stops the run at once, naming the candidate classes (Accelerate would find it
    only inside ``prepare``)."""
    from orchestrator.rank import selfcheck

    problems = selfcheck.check_wrap_class(accelerator, model)
    if problems:
        selfcheck.fail_wrap(problems, accelerator.process_index)
    mesh = fsdp1_hybrid_device_mesh(accelerator)
    if mesh is None:
        return model
    if pending is not None:
        pending.applied.append("fsdp1_hybrid_mesh")
    return wrap_fsdp1_with_mesh(accelerator, model, mesh)


def before_load_state(accelerator: Accelerator, optimizer: torch.optim.Optimizer) -> None:
    init_fsdp1_optimizer_state(accelerator, optimizer)


def finish(accelerator: Accelerator) -> None:
    wait_before_end_training(accelerator)
    accelerator.end_training()
