"""Start-up self-check: the run is the run that was asked for, or it stops (exit 3) within seconds.

Accelerate on CPU fails silently in several ways: a MULTI_CPU
config starts one process, a GPU config without ``ACCELERATE_USE_CPU=1`` gives
N processes that each train alone, FSDP is dropped for plain DDP, FSDP1 hybrids
shard over one rank. Each of those passes every other test; the self-check
makes them impossible.

Expectations: :mod:`orchestrator.rank.expectations`.

Two phases: ``check_launch`` right after ``Accelerator()`` (world size, nodes,
distributed type), ``check_model`` right after ``prepare`` (wrapping applied,
shard and replicate group sizes, local shard sizes), both before the first step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

from orchestrator.contract.run_dir import EXIT_SELFCHECK, write_exit_status
from orchestrator.rank.expectations import (
    DEEPSPEED_STAGE,
    FSDP1_SHARDING,
    FSDP2_RESHARD,
    HYBRID,
    STRATEGIES,
    Expectation,
    SelfCheckError,
    _strategy_from_accelerate_env,
    _truthy,
    expectations_from_env,
    training_alone_hint,
)

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from deepspeed import DeepSpeedEngine

__all__ = [
    "DEEPSPEED_STAGE",
    "FSDP1_SHARDING",
    "FSDP2_RESHARD",
    "HYBRID",
    "STRATEGIES",
    "Expectation",
    "SelfCheckError",
    "_strategy_from_accelerate_env",
    "expectations_from_env",
]


def _found_launch(accelerator: Accelerator) -> str:
    return f"world size {accelerator.num_processes}, distributed type {accelerator.distributed_type.value}"


def check_launch(accelerator: Accelerator, exp: Expectation) -> list[str]:
    """Phase 1, right after ``Accelerator()``: world size, node layout, distributed type."""
    problems: list[str] = []
    world = accelerator.num_processes
    dtype = accelerator.distributed_type.value
    if exp.world_size is not None and world != exp.world_size:
        hint = training_alone_hint() if world == 1 and exp.world_size > 1 else ""
        problems.append(f"expected world size {exp.world_size}, found {world}.{hint}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if exp.procs_per_node is not None and world > 1 and local_world != exp.procs_per_node:
        problems.append(
            f"expected {exp.procs_per_node} process(es) per node, found LOCAL_WORLD_SIZE={local_world}"
        )
    if exp.num_nodes is not None and world > 1 and local_world and world // local_world != exp.num_nodes:
        problems.append(
            f"expected {exp.num_nodes} node(s), found {world // local_world} ({world} ranks / {local_world} per node)"
        )
    if exp.strategy in DEEPSPEED_STAGE:
        problems += _check_deepspeed_launch(accelerator, exp)
    elif exp.strategy is not None and (exp.world_size or world) > 1:
        if exp.strategy == "ddp":
            if dtype not in ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU"):
                problems.append(
                    f"expected DDP (distributed type MULTI_CPU/MULTI_GPU), found distributed type {dtype}"
                )
        elif dtype != "FSDP":
            hint = (
                " Accelerate silently drops FSDP on CPU and runs plain DDP unless the CPU shim "
                "(orchestrator/rank/workarounds.py: enable_fsdp_on_cpu) is applied."
                if dtype == "MULTI_CPU"
                else ""
            )
            problems.append(f"expected FSDP ({exp.strategy}), found distributed type {dtype}.{hint}")
        else:
            plugin = accelerator.state.fsdp_plugin
            if exp.fsdp_version is not None and plugin.fsdp_version != exp.fsdp_version:
                problems.append(f"expected FSDP version {exp.fsdp_version}, found {plugin.fsdp_version}")
    problems += [f"note: {n}" for n in exp.notes if problems]
    return problems


def _check_deepspeed_launch(accelerator: Accelerator, exp: Expectation) -> list[str]:
    """DeepSpeed asked for: it is active, at the asked ZeRO stage, over every rank (the world size is
    checked above; on CPU without the gloo backend Accelerate sees 1 while DeepSpeed sees them all)."""
    assert exp.strategy is not None
    dtype = accelerator.distributed_type.value
    stage = DEEPSPEED_STAGE[exp.strategy]
    if dtype != "DEEPSPEED":
        hint = ""
        if dtype in ("MULTI_CPU", "NO") and _truthy(os.environ.get("ACCELERATE_USE_CPU")):
            hint = (
                " ACCELERATE_USE_CPU=1 is set: Accelerate then ignores the DeepSpeed config and runs MULTI_CPU DDP"
                " (the orchestrator leaves it unset for DeepSpeed)."
            )
        elif not _truthy(os.environ.get("ACCELERATE_USE_DEEPSPEED")):
            hint = " ACCELERATE_USE_DEEPSPEED is not set: the config given to `accelerate launch` is not a DeepSpeed one."
        return [f"DeepSpeed asked for ({exp.strategy}), not active: found distributed type {dtype}.{hint}"]
    problems = []
    found = getattr(accelerator.state.deepspeed_plugin, "zero_stage", None)
    if found != stage:
        problems.append(f"expected DeepSpeed ZeRO stage {stage} ({exp.strategy}), found {found}")
    if exp.world_size and exp.world_size > 1 and accelerator.num_processes == 1:
        problems.append(
            "Accelerate found no process-group backend (world size 1) though DeepSpeed runs over every rank: "
            "on CPU it needs gloo (the orchestrator supplies it through orchestrator/rank/site/sitecustomize.py "
            "on PYTHONPATH; by hand, InitProcessGroupKwargs(backend='gloo'))"
        )
    return problems


def _check_deepspeed_model(
    accelerator: Accelerator, model: torch.nn.Module, exp: Expectation, num_params: int
) -> tuple[list[str], str]:
    """After ``prepare``: a DeepSpeed engine at the asked stage, data-parallel over every rank, and at
    ZeRO-3 the parameters really partitioned (this rank holds about 1/world of them)."""
    assert exp.strategy is not None
    world = accelerator.num_processes
    stage = DEEPSPEED_STAGE[exp.strategy]
    if type(model).__name__ != "DeepSpeedEngine":
        return [
            f"expected the model wrapped in a DeepSpeedEngine ({exp.strategy}), found {type(model).__name__}"
        ], ""
    engine = cast("DeepSpeedEngine", model)
    problems = []
    found_stage = engine.zero_optimization_stage()
    if found_stage != stage:
        problems.append(f"expected ZeRO stage {stage}, the engine runs stage {found_stage}")
    dp = int(getattr(engine, "dp_world_size", world))
    if dp != world:
        problems.append(f"expected DeepSpeed data parallelism over {world} ranks, found {dp}")
    found = f"DeepSpeed ZeRO-{found_stage} over {dp} ranks"
    if found_stage == 3:
        held = full = 0
        for p in engine.module.parameters():
            partition = getattr(p, "ds_tensor", None)
            if partition is None:
                problems.append("ZeRO-3: a parameter without a partition (ds_tensor): not partitioned")
                break
            held += partition.numel()
            full += int(p.ds_numel)
            if p.numel() != 0:
                problems.append("ZeRO-3: a parameter still holds its full data outside forward")
                break
        limit = _ceil_div(num_params, world) + sum(1 for _ in engine.module.parameters())
        if full != num_params:
            problems.append(f"ZeRO-3: partitions describe {full} parameters, the model has {num_params}")
        elif world > 1 and held > limit:
            problems.append(f"ZeRO-3: this rank holds {held} of {num_params} parameters, expected <= {limit}")
        found += f", this rank holds {held} of {full} parameters"
    return problems, found


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expected_groups(exp: Expectation, world: int) -> tuple[int, int]:
    """(shard group size, replicate group size) the strategy should produce."""
    per_node = exp.procs_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if exp.strategy in HYBRID:
        return per_node, world // per_node
    if exp.strategy == "no_shard" or exp.strategy == "ddp":
        return 1, world
    return world, 1


def check_model(
    accelerator: Accelerator, model: torch.nn.Module, exp: Expectation, num_params: int
) -> tuple[list[str], str]:
    """Phase 2, after ``prepare``: the wrapping really happened, with the expected groups.

    Returns (problems, one-line description of what was found)."""
    import torch.distributed as dist

    problems: list[str] = []
    world = accelerator.num_processes
    strategy = exp.strategy
    if strategy is None or world == 1:
        return problems, f"{_found_launch(accelerator)}, no distributed wrapping checked"
    if strategy in DEEPSPEED_STAGE:
        return _check_deepspeed_model(accelerator, model, exp, num_params)
    shard, replicate = expected_groups(exp, world)
    dtype = accelerator.distributed_type.value
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not isinstance(model, DDP):
            return [
                f"expected the model wrapped in DistributedDataParallel, found {type(model).__name__}"
            ], ""
        size = (
            dist.get_world_size(model.process_group)
            if model.process_group is not None
            else dist.get_world_size()
        )
        if size != world:
            problems.append(f"expected DDP over {world} ranks, found a process group of {size}")
        return problems, f"DDP over {size} ranks"
    if dtype != "FSDP":
        return [f"expected FSDP ({strategy}), found distributed type {dtype}"], ""
    version = accelerator.state.fsdp_plugin.fsdp_version
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if not isinstance(model, FSDP):
            return [
                f"expected the model wrapped in FSDP1 FullyShardedDataParallel, found {type(model).__name__}"
            ], ""
        found_strategy = model.sharding_strategy.name
        if found_strategy != FSDP1_SHARDING[strategy]:
            problems.append(
                f"expected FSDP1 sharding strategy {FSDP1_SHARDING[strategy]}, found {found_strategy}"
            )
        shard_group = model.process_group  # typed Optional; always set once FSDP1 has wrapped the module
        assert shard_group is not None
        shard_size = shard_group.size()
        inter = getattr(model, "_inter_node_pg", None)
        replicate_size = (
            inter.size() if inter is not None else (world // shard_size if strategy != "no_shard" else world)
        )
        if strategy == "no_shard":
            shard_size_expected, shard_size_effective = (
                world,
                1,
            )  # NO_SHARD keeps the world group, shards nothing
        else:
            shard_size_expected, shard_size_effective = shard, shard_size
        if shard_size != shard_size_expected:
            problems.append(
                f"expected FSDP1 shard groups of {shard_size_expected} rank(s), found {shard_size}"
                + (
                    " (torch sized them by torch.cpu.device_count() == 1: gradients are never synchronised "
                    "across nodes; an explicit replicate x shard device mesh is needed)"
                    if strategy in HYBRID and shard_size == 1
                    else ""
                )
            )
        if strategy in HYBRID and replicate_size != replicate:
            problems.append(f"expected FSDP1 replicate groups of {replicate} rank(s), found {replicate_size}")
        local = sum(m._handle.flat_param.numel() for m in FSDP.fsdp_modules(model) if m._handle is not None)
        bound = (
            _ceil_div(num_params, shard_size_effective)
            + 64 * len(FSDP.fsdp_modules(model)) * shard_size_effective
        )
        if local > bound:
            problems.append(
                f"expected about {_ceil_div(num_params, shard_size_effective)} local parameters "
                f"({num_params} / {shard_size_effective}), found {local}: not sharded"
            )
        if strategy != "no_shard" and shard_size_effective > 1 and local >= num_params:
            problems.append(
                f"expected a 1/{shard_size_effective} parameter shard, found all {local} parameters locally"
            )
        return problems, (
            f"FSDP1 {found_strategy}, shard group {shard_size}, replicate group {replicate_size}, "
            f"{local} of {num_params} parameters local, {describe_units(model)}{_root_only_hint(accelerator, model)}"
        )
    # FSDP2
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return [f"expected the model sharded with FSDP2 fully_shard, found {type(model).__name__}"], ""
    params = list(model.parameters())
    shards = [p for p in params if isinstance(p, DTensor)]
    if len(shards) != len(params):
        return ["expected every parameter to be an FSDP2 DTensor, found plain tensors"], ""
    mesh = shards[0].device_mesh
    shape = tuple(mesh.shape)
    placements = tuple(type(p).__name__ for p in shards[0].placements)
    want_shape = (replicate, shard) if strategy in HYBRID else (shard,)
    want_placements = ("Replicate", "Shard") if strategy in HYBRID else ("Shard",)
    if shape != want_shape:
        problems.append(f"expected an FSDP2 device mesh of shape {want_shape}, found {shape}")
    if placements != want_placements:
        problems.append(f"expected parameter placements {want_placements}, found {placements}")
    local = sum(p.to_local().numel() for p in shards)
    # fully_shard splits each parameter along dim 0: a rank holds at most ceil(rows / shard) rows of it
    # (more than num_params / shard when the rows do not divide, e.g. a 10-class output layer on 4 ranks).
    most = sum(
        _ceil_div(p.shape[0], shard) * (p.numel() // max(1, p.shape[0])) if p.dim() else 1 for p in shards
    )
    if local > most:
        problems.append(
            f"expected at most {most} local parameters (about {num_params} / {shard}), found {local}"
        )
    reshard = _fsdp2_reshard_after_forward(model)
    want = FSDP2_RESHARD.get(strategy)
    if reshard is not None and want is not None and reshard != want:
        problems.append(f"expected reshard_after_forward={want} ({strategy}), found {reshard}")
    return problems, (
        f"FSDP2 mesh {shape} placements {placements}, reshard_after_forward={reshard}, "
        f"{local} of {num_params} parameters local, units {_fsdp2_units(model)}{_root_only_hint(accelerator, model)}"
    )


def _root_only_hint(accelerator: Accelerator, model: torch.nn.Module) -> str:
    """Size-based wrapping that made none of the model's layers a unit of its own (each is under
    ``min_num_params``) shards the model in one or two big units: say so, and which classes
    ``--wrap-cls`` could name."""
    if wrap_class_names(accelerator):
        return ""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    units = set()
    for module in model.modules():
        if isinstance(module, FSDP1):
            units.add(type(module.module).__name__)
        elif isinstance(module, FSDPModule):
            units.add(type(module).__name__.removeprefix("FSDP"))
    inner = getattr(model, "module", model)
    candidates = candidate_layer_classes(inner)
    if not candidates or any(c in units for c in candidates):
        return ""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    limit = getattr(plugin, "min_num_params", None)
    return (
        f"; size-based wrapping (min_num_params {limit}) made none of the model's layers a unit of its own "
        f"(--wrap-cls {', '.join(candidates[:4])} would make each one a unit)"
    )


def _fsdp2_units(model: torch.nn.Module) -> str:
    """Which modules are FSDP2 units, e.g. ``GPT, MLP x4``: what the wrap policy really did."""
    from collections import Counter

    from torch.distributed.fsdp import FSDPModule

    names = Counter(
        type(m).__name__.removeprefix("FSDP") for m in model.modules() if isinstance(m, FSDPModule)
    )
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in names.items())


def _fsdp2_reshard_after_forward(model: torch.nn.Module) -> bool | None:
    """reshard_after_forward of the FSDP2 units that carry the strategy's setting; None if there are none.

    Accelerate shards the root with torch's default (None: False for the root) and its "tail" (final norm,
    output head) with False whatever the strategy, so only the other units (e.g. TransformerBlocks
    wrapped by the auto-wrap policy) say whether full_shard or shard_grad_op was applied. A model too
    small for the size-based policy has none: then the two strategies run identically."""
    try:
        from torch import nn
        from torch.distributed.fsdp import FSDPModule

        values = set()
        for module in model.modules():
            if not isinstance(module, FSDPModule) or module is model:
                continue
            if "Norm" in type(module).__name__ or isinstance(module, (nn.Embedding, nn.Linear)):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                values.add(group.post_forward_mesh_info is not None)
        return values.pop() if len(values) == 1 else None
    except Exception:
        return None


def fail(problems: list[str], exp: Expectation, found: str, run_dir: str | None, rank: int) -> None:
    """Print what was expected and what was found, and exit with code 3 at once."""
    lines = [
        f"[rank {rank}] SELF-CHECK FAILED (exit {EXIT_SELFCHECK}): expected {exp.describe()} (from {exp.source})"
    ]
    if found:
        lines.append(f"[rank {rank}]   found: {found}")
    lines += [f"[rank {rank}]   - {p}" for p in problems]
    print("\n".join(lines), file=sys.stderr, flush=True)
    # Every failing rank writes the record (atomically; the problems are the job's, not the rank's):
    # the first rank to fail ends its peers, so rank 0 may be stopped before it gets here (CI, load).
    if run_dir:
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            write_exit_status(Path(run_dir), EXIT_SELFCHECK, "selfcheck", problems=problems)
        except OSError:
            pass
    sys.stdout.flush()
    os._exit(EXIT_SELFCHECK)


# ---------------------------------------------------------------------------
# Wrapping: the layer class named for TRANSFORMER_BASED_WRAP must exist in the model, and a
# size-based policy says which units it made. Accelerate finds a missing class only inside
# ``prepare`` ("Could not find the transformer layer class ..."), after the job queued and loaded;
# a profile default such as our GPT's ``TransformerBlock`` then failed every other model.


def wrap_class_names(accelerator: Accelerator) -> list[str]:
    """The layer classes the FSDP plugin will wrap (TRANSFORMER_BASED_WRAP); [] for any other policy."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None) if plugin is not None else None
    if not names:
        raw = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
        names = [n.strip() for n in raw.split(",") if n.strip()] if plugin is not None else []
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    return list(names)


def candidate_layer_classes(model: torch.nn.Module) -> list[str]:
    """Classes that make sense as FSDP units: a Hugging Face model's ``_no_split_modules``, else the
    classes of modules repeated in a ``ModuleList``/``Sequential`` (the transformer blocks)."""
    import torch

    declared = getattr(model, "_no_split_modules", None)
    if declared:
        return sorted(set(declared))
    found: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) >= 2:
            for child in module:
                found[type(child).__name__] = found.get(type(child).__name__, 0) + 1
    return sorted(found, key=lambda n: -found[n])


def check_wrap_class(accelerator: Accelerator, model: torch.nn.Module) -> list[str]:
    """Problems with the wrap classes asked for (none when every one exists in ``model``)."""
    wanted = wrap_class_names(accelerator)
    if not wanted:
        return []
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in wanted if name not in present]
    if not missing:
        return []
    candidates = candidate_layer_classes(model)
    hint = ", ".join(candidates[:8]) if candidates else "none found (no repeated layers)"
    return [
        f"--wrap-cls {','.join(missing)}: the model ({type(model).__name__}) has no such layer class; "
        f"candidates: {hint}. Pass --wrap-cls with one of them, or leave it out for size-based wrapping"
    ]


def fail_wrap(problems: list[str], rank: int) -> None:
    """Stop at once (exit 3), before any GPU memory or collective is spent on a model that cannot wrap."""
    lines = [f"[rank {rank}] SELF-CHECK FAILED (exit {EXIT_SELFCHECK}): wrapping cannot work"]
    lines += [f"[rank {rank}]   - {p}" for p in problems]
    print("\n".join(lines), file=sys.stderr, flush=True)
    run_dir = os.environ.get("ORCHESTRATOR_RUN_DIR")
    if run_dir and rank == 0:
        try:
            write_exit_status(Path(run_dir), EXIT_SELFCHECK, "selfcheck", problems=problems)
        except OSError:
            pass
    sys.stdout.flush()
    os._exit(EXIT_SELFCHECK)


def describe_units(model: torch.nn.Module) -> str:
    """The FSDP units ``prepare`` made, by class: ``3 units: 2 x Block, 1 x GPT`` (root included)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # pragma: no cover - torch without FSDP
        return ""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, FSDP1):
            name = type(module.module).__name__
        elif isinstance(module, FSDPModule):
            name = type(module).__name__.removeprefix("FSDP")
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    total = sum(counts.values())
    return f"{total} FSDP unit(s): " + ", ".join(
        f"{n} x {c}" for c, n in sorted(counts.items(), key=lambda kv: -kv[1])
    )
