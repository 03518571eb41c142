"""A sharded load as a plain read: each rank's load plan, written at save time, read straight back.

Where a 2-rank ``base`` load (1.54 GB, FSDP2) spent its time besides reading (bench/results.md, the
sharded-load rows): DCP's planning (every rank unpickles ``.metadata`` and matches ~900 items
against its state dict, then a ``reduce_scatter`` of the plans and an ``all_gather`` after the
reads, for the model and again for the optimizer), a header parse per record, Accelerate's
``get_*_state_dict`` / ``set_*_state_dict`` (the model's ``load_state_dict`` copies every parameter
onto itself) and four barriers. None of it depends on anything but the checkpoint and the
sharding, and a resume at the same world size with the same sharding (every requeue, every
restart) finds both unchanged.

So each rank writes, once its shards are on disk, the byte ranges it will need back
(:func:`write_load_plan`: ``load_plan_<rank>.json``: for every item of its own shard files and every
item all ranks share, the key, the file, where the tensor's bytes start, dtype and chunk). A load
(:func:`fast_fsdp_loads`) checks that every tensor of the model and the optimizer is one of them
with the same chunk, dtype and layout, the ranks agree on it (one ``all_reduce``), and each rank
``preadv``s its ranges in file order straight into the parameters' and the optimizer state's own
memory. Anything else (another world size, another wrapping, a GPU tensor, a missing plan, FSDP1,
a plan that does not match) goes through Accelerate's and DCP's load, unchanged, with
:mod:`orchestrator.rank.dcp_reader` reading.

The files, ``.metadata`` and Accelerate's layout are untouched: the plan is one more small file,
listed and digested in the marker like every other. Why our own code rather than DCP's: DCP has no
load that skips planning (``no_dist`` still plans and parses per item), and its planner is what costs.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from orchestrator.contract.checkpoints import load_plan_name
from orchestrator.rank.dcp_reader import read_exactly, record_header

PLAN_VERSION = 1
_DCP_DIRS = ("pytorch_model_fsdp_0", "optimizer_0")
"""Accelerate's DCP folders of the first model and of the first optimizer."""


class _Item(NamedTuple):
    """One record a rank reads back: a tensor chunk's bytes, or a pickled value (``dtype`` "")."""

    key: str
    file: str
    offset: int
    nbytes: int
    dtype: str = ""
    sizes: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    global_size: tuple[int, ...] = ()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off for a moment: unpickling DCP's ``.metadata`` or parsing a plan makes
    thousands of objects, and in a rank's process (torch, accelerate, the model: millions of
    objects) that set off full collections of 0.3-0.7 s each, measured here, several per load."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ---------------------------------------------------------------------------- save side
def write_load_plan(folder: Path, rank: int, world_size: int) -> str | None:
    """This rank's load plan for the DCP folders of ``folder`` (after the save's barrier: rank 0's
    ``.metadata`` is written). Returns the plan's relative path, or None where there is no DCP
    checkpoint to plan for (a DDP save) or a record is not one plain tensor's contiguous bytes."""
    with gc_paused():
        items = _plan_items(folder, rank)
    if not items:
        return None
    rel = load_plan_name(rank)
    tmp = folder / f".{rel}.tmp"
    plan = {"version": PLAN_VERSION, "world_size": world_size, "rank": rank, "items": items}
    tmp.write_text(json.dumps(plan, separators=(",", ":")))
    os.replace(tmp, folder / rel)
    return rel


def _plan_items(folder: Path, rank: int) -> list[list[Any]] | None:
    import pickle

    items: list[list[Any]] = []
    for sub in _DCP_DIRS:
        if not (folder / sub / ".metadata").is_file():
            continue
        with open(folder / sub / ".metadata", "rb") as f:
            md = pickle.load(f)  # DCP's own read_metadata does this; our own just-written file
        fds: dict[str, int] = {}
        try:
            for index, info in md.storage_data.items():
                if info.transform_descriptors:
                    return None
                meta = md.state_dict_metadata[index.fqn]
                rel = f"{sub}/{info.relative_path}"
                chunks = getattr(meta, "chunks", None)
                if chunks is None:  # a pickled value (param_groups): every rank needs them
                    items.append([index.fqn, rel, info.offset, info.length])
                    continue
                whole = len(chunks) == 1 and tuple(chunks[0].sizes) == tuple(meta.size)
                if not info.relative_path.startswith(f"__{rank}_") and not whole:
                    continue  # another rank's shard
                if rel not in fds:
                    fds[rel] = os.open(folder / rel, os.O_RDONLY)
                got = record_header(fds[rel], info.offset, info.length)
                chunk = next((c for c in chunks if tuple(c.offsets) == tuple(index.offset)), None)
                if got is None or chunk is None:
                    return None
                (dtype, _key, numel), storage_offset, size, stride = got[0]
                expected = 1
                for dim in reversed(range(len(size))):
                    if size[dim] != 1 and stride[dim] != expected:
                        return None  # not contiguous
                    expected *= size[dim]
                if tuple(size) != tuple(chunk.sizes) or storage_offset + expected > numel:
                    return None
                start = info.offset + got[1] + storage_offset * dtype.itemsize
                dt = str(dtype).removeprefix("torch.")
                items.append(
                    [
                        index.fqn,
                        rel,
                        start,
                        expected * dtype.itemsize,
                        dt,
                        list(size),
                        list(chunk.offsets),
                        list(meta.size),
                    ]
                )
        finally:
            for fd in fds.values():
                os.close(fd)
    return items


# ---------------------------------------------------------------------------- load side
class FastLoadReport:
    """What the fast path did over one ``load_state`` (rank-local)."""

    def __init__(self) -> None:
        self.model = False
        self.optimizer = False
        self.why_not = ""
        self.tensors = 0


def _read_plan(folder: Path, rank: int, world_size: int) -> dict[str, _Item] | str:
    try:
        plan = json.loads((folder / load_plan_name(rank)).read_text())
    except (OSError, ValueError) as exc:
        return f"no load plan ({type(exc).__name__})"
    if (
        plan.get("version") != PLAN_VERSION
        or plan.get("world_size") != world_size
        or plan.get("rank") != rank
    ):
        return f"a plan of world size {plan.get('world_size')}, rank {plan.get('rank')}"
    out = {}
    for row in plan["items"]:
        if len(row) == 4:
            out[row[0]] = _Item(row[0], row[1], row[2], row[3])
        else:
            out[row[0]] = _Item(
                row[0], row[1], row[2], row[3], row[4], tuple(row[5]), tuple(row[6]), tuple(row[7])
            )
    return out


class _Layouts:
    """This rank's chunk of a tensor (offsets in the global tensor, global size), computed once per
    sharding and global shape: a model's blocks repeat a handful of shapes."""

    def __init__(self) -> None:
        self.cache: dict[Any, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def __call__(self, t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        spec = getattr(t, "_spec", None)
        if spec is None:
            return (0,) * t.dim(), tuple(t.shape)
        key = (id(spec.mesh), spec.placements, tuple(t.shape))
        got = self.cache.get(key)
        if got is None:
            chunks = t.__create_chunk_list__()  # type: ignore[attr-defined]
            if len(chunks) != 1:
                raise ValueError("not one chunk")
            got = self.cache[key] = (tuple(chunks[0].offsets), tuple(t.shape))
        return got


def _match(item: _Item | None, t: torch.Tensor, layouts: _Layouts) -> torch.Tensor | str:
    """The memory holding this rank's bytes of ``t``, if ``item`` is exactly them."""
    if item is None or not item.dtype:
        return "not in the plan"
    local = getattr(t, "_local_tensor", t)  # a DTensor's own memory; its detach() is a dispatched op
    if local.requires_grad:
        local = local.detach()
    offsets, size = layouts(t)
    if (
        local.device.type != "cpu"
        or not local.is_contiguous()
        or str(local.dtype).removeprefix("torch.") != item.dtype
        or tuple(local.shape) != item.sizes
        or offsets != item.offsets
        or size != item.global_size
        or local.numel() * local.element_size() != item.nbytes
    ):
        return f"{item.key}: another layout than the checkpoint's"
    return local


Reads = list[tuple[_Item, torch.Tensor]]


def _model_targets(model: torch.nn.Module, plan: dict[str, _Item], layouts: _Layouts) -> Reads | str:
    """Every parameter and persistent buffer of ``model`` with the record it is read from."""
    keys = set()
    reads: Reads = []
    for mod_name, module in model.named_modules():
        prefix = f"model.{mod_name}." if mod_name else "model."
        tensors = [(n, p) for n, p in module._parameters.items() if p is not None]
        tensors += [
            (n, b)
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        ]
        for name, t in tensors:
            key = prefix + name
            keys.add(key)
            got = _match(plan.get(key), t, layouts)
            if isinstance(got, str):
                return got
            reads.append((plan[key], got))
    extra = {k for k in plan if k.startswith("model.")} - keys
    return f"the checkpoint has {sorted(extra)[0]}" if extra else reads


def _optimizer_targets(
    names: dict[int, str], optimizer: torch.optim.Optimizer, plan: dict[str, _Item], layouts: _Layouts
) -> tuple[Reads, list[tuple[dict, dict[str, _Item]]]] | str:
    """Every state tensor of ``optimizer`` with its record, and each param group's pickled values."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)  # a fresh process: the state the checkpoint's values go into (as DCP's path)
    keys = set()
    reads: Reads = []
    for param, state in optimizer.state.items():
        fqn = names.get(id(param))
        if fqn is None:
            return "a parameter without a name"
        for sk, value in state.items():
            key = f"optimizer.state.{fqn}.{sk}"
            keys.add(key)
            if not torch.is_tensor(value):
                return f"{key} is not a tensor"
            got = _match(plan.get(key), value, layouts)
            if isinstance(got, str):
                return got
            reads.append((plan[key], got))
    extra = {k for k in plan if k.startswith("optimizer.state.")} - keys
    if extra:
        return f"the checkpoint has {sorted(extra)[0]}"
    groups: list[tuple[dict, dict[str, _Item]]] = []
    for i, group in enumerate(optimizer.param_groups):
        head = f"optimizer.param_groups.{i}."
        mine = {k[len(head) :]: it for k, it in plan.items() if k.startswith(head)}
        if "params" not in mine or any(it.dtype for it in mine.values()):
            return f"param group {i} is not in the plan"
        groups.append((group, mine))
    if any(k.startswith(f"optimizer.param_groups.{len(groups)}.") for k in plan):
        return "the checkpoint has more param groups"
    return reads, groups


def _group_values(
    folder: Path, groups: list[tuple[dict, dict[str, _Item]]], names: dict[int, str]
) -> list[dict] | str:
    """The saved values of each param group, if every group holds the same parameters as saved."""
    out = []
    for group, items in groups:
        saved = {}
        for k, it in items.items():
            with open(folder / it.file, "rb") as f:
                data = os.pread(f.fileno(), it.nbytes, it.offset)
            if len(data) != it.nbytes:
                return f"{it.file}: {it.nbytes - len(data)} bytes missing at offset {it.offset}"
            saved[k] = torch.load(io.BytesIO(data), weights_only=True)
        if list(saved.pop("params")) != [names.get(id(p)) for p in group["params"]]:
            return "the param groups hold other parameters"
        out.append(saved)
    return out


def _read_files(folder: Path, reads: Reads) -> None:
    """Every read straight into its tensor, in file order, one file after another (one sequential
    pass, as a plain read makes; reads from several threads were slower here, cold and warm)."""
    by_file: dict[str, Reads] = {}
    for item, target in reads:
        by_file.setdefault(item.file, []).append((item, target))
    for rel in sorted(by_file):
        fd = os.open(folder / rel, os.O_RDONLY)
        try:
            for item, target in sorted(by_file[rel], key=lambda r: r[0].offset):
                if target.numel():
                    read_exactly(
                        fd, target.view(-1).view(torch.uint8).numpy().data.cast("B"), item.offset, rel
                    )
        finally:
            os.close(fd)


def _agree(ok: bool, accelerator: Any) -> bool:
    """Every rank takes the fast path or none does (DCP's load is collective)."""
    if accelerator.num_processes <= 1:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=accelerator.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _prepare(
    folder: Path, accelerator: Any, plugin: Any, model: Any
) -> tuple[Reads, Reads, list, list] | str:
    """Everything the fast path reads for the first model and optimizer, or why it cannot."""
    from torch.distributed.fsdp import StateDictType

    if plugin.fsdp_version != 2 or plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
        return "not an FSDP2 sharded state dict"
    if len(accelerator._models) != 1 or len(accelerator._optimizers) != 1:
        return "not one model and one optimizer"
    optimizer = accelerator._optimizers[0]
    inner = getattr(optimizer, "optimizer", optimizer)
    plan = _read_plan(folder, accelerator.process_index, accelerator.num_processes)
    if isinstance(plan, str):
        return plan
    layouts = _Layouts()
    model_reads = _model_targets(model, plan, layouts)
    if isinstance(model_reads, str):
        return model_reads
    names = {id(p): n for n, p in model.named_parameters()}
    got = _optimizer_targets(names, inner, plan, layouts)
    if isinstance(got, str):
        return got
    try:
        values = _group_values(folder, got[1], names)
    except Exception as exc:  # a value that does not unpickle as plain data: DCP's path decides
        return f"param groups: {type(exc).__name__}: {exc}"
    if isinstance(values, str):
        return values
    return model_reads, got[0], [g for g, _ in got[1]], values


@contextlib.contextmanager
def fast_fsdp_loads(folder: Path) -> Iterator[FastLoadReport]:
    """Inside, Accelerate's ``load_state`` loads an FSDP2 model and its optimizer through this rank's
    load plan where every rank's plan fits (one ``all_reduce`` decides), else through its own code,
    as before. The GC is paused meanwhile (:func:`gc_paused`)."""
    import accelerate.accelerator as acc_mod

    report = FastLoadReport()
    real_model, real_optim = acc_mod.load_fsdp_model, acc_mod.load_fsdp_optimizer
    pending: dict[str, Any] = {}

    def load_model(
        plugin: Any, accelerator: Any, model: Any, input_dir: str, index: int = 0, *a: Any, **k: Any
    ) -> Any:
        got = _prepare(folder, accelerator, plugin, model) if index == 0 else "not the first model"
        if not _agree(not isinstance(got, str), accelerator):
            report.why_not = got if isinstance(got, str) else "another rank cannot"
            return real_model(plugin, accelerator, model, input_dir, index, *a, **k)
        assert not isinstance(got, str)
        model_reads, pending["reads"], pending["groups"], pending["values"] = got
        _read_files(folder, model_reads)
        report.model, report.tensors = True, report.tensors + len(model_reads)
        return None

    def load_optimizer(
        plugin: Any,
        accelerator: Any,
        optimizer: Any,
        model: Any,
        input_dir: str,
        index: int = 0,
        *a: Any,
        **k: Any,
    ) -> Any:
        if not report.model or index != 0:  # the same on every rank: decided together above
            return real_optim(plugin, accelerator, optimizer, model, input_dir, index, *a, **k)
        _read_files(folder, pending["reads"])
        for group, saved in zip(pending["groups"], pending["values"], strict=True):
            # As Optimizer.load_state_dict: the saved group, with this optimizer's parameters.
            keep = {"params": group["params"]}
            if "param_names" in group and "param_names" not in saved:
                keep["param_names"] = group["param_names"]
            group.clear()
            group.update(saved)
            group.update(keep)
        report.optimizer, report.tensors = True, report.tensors + len(pending["reads"])
        return None

    acc_mod.load_fsdp_model, acc_mod.load_fsdp_optimizer = load_model, load_optimizer
    try:
        with gc_paused():
            yield report
    finally:
        acc_mod.load_fsdp_model, acc_mod.load_fsdp_optimizer = real_model, real_optim
