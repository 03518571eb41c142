"""The model's weights in a checkpoint folder, one tensor at a time, whatever strategy wrote it.

Every layout Accelerate's ``save_state`` and a Trainer's ``checkpoint-N`` leave, read by the library
that wrote it, on one CPU process with no process group:

=====================================  ===========================================================
layout                                 read with
=====================================  ===========================================================
``pytorch_model_fsdp_0/`` (DCP)        FSDP1/FSDP2/HSDP ``SHARDED_STATE_DICT``: DCP's own
                                       ``load`` (``no_dist``, default planner), one tensor per call:
                                       DCP reassembles each tensor from every rank's shard file
``pytorch_model_fsdp_0.bin``           FSDP ``FULL_STATE_DICT``: ``torch.load(mmap=True)``
``pytorch_model/`` or ``global_stepN/``  DeepSpeed ZeRO-1/2/3: ``zero_to_fp32``'s
+ ``latest``                           ``get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)``
``model.safetensors`` (+ shards)       DDP (Accelerate), a Trainer's ``save_pretrained``: safetensors
``pytorch_model.bin``                  older Trainers: ``torch.load(mmap=True)``
=====================================  ===========================================================

A :class:`Source` lists every tensor's name, shape and dtype before reading any (the streaming
writer needs them for its header), and reads one tensor on request, so an export holds about one
tensor at a time (DCP, safetensors). A ``torch.load(mmap=True)`` file (full state dicts) and ZeRO's
lazy mode (``mmap``-ed optimizer partitions) are mapped: their pages, once read, count as resident
until the export ends (clean file pages the kernel may drop, not the export's own memory).
torch is imported inside: ``import orchestrator`` stays torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    import torch

#: The wrappers' name segments a state dict may still carry (DDP, torch.compile, FSDP1, checkpointing).
_WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
#: Accelerate's FSDP model files (``save_fsdp_model``, model index 0).
FSDP_SHARDED_DIR = "pytorch_model_fsdp_0"
FSDP_FULL_FILES = ("pytorch_model_fsdp_0.bin", "pytorch_model_fsdp.bin")
#: The tag Accelerate's ``save_state`` gives DeepSpeed's engine checkpoint, when no ``latest`` names one.
DEEPSPEED_TAG = "pytorch_model"


@dataclass
class Source:
    """A checkpoint's model tensors: ``entries`` ``{clean name: (shape, dtype)}`` in the checkpoint's
    order, ``read(name)`` one full tensor."""

    kind: str
    folder: Path
    entries: dict[str, tuple[tuple[int, ...], torch.dtype]]
    read: Callable[[str], torch.Tensor]

    def largest_bytes(self) -> int:
        import math

        return max((math.prod(s) * d.itemsize for s, d in self.entries.values()), default=0)


def clean_name(name: str) -> str:
    """``module._orig_mod.blocks.0.w`` -> ``blocks.0.w``: the name the unwrapped model uses."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _named(
    kind: str, folder: Path, raw: dict[str, tuple[tuple[int, ...], Any]], read_raw: Callable[[str], Any]
) -> Source:
    entries: dict[str, tuple[tuple[int, ...], Any]] = {}
    raw_of: dict[str, str] = {}
    for name, meta in raw.items():
        clean = clean_name(name)
        if clean in raw_of:
            raise UserError(f"{folder}: tensors {raw_of[clean]} and {name} both unwrap to {clean}")
        raw_of[clean] = name
        entries[clean] = meta
    if not entries:
        raise UserError(f"{folder}: {kind} checkpoint holds no model tensors")
    return Source(kind, folder, entries, lambda name: read_raw(raw_of[name]))


def _dcp(folder: Path) -> Source:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model_dir = folder / FSDP_SHARDED_DIR
    meta = dcp.FileSystemReader(str(model_dir)).read_metadata()
    raw: dict[str, tuple[tuple[int, ...], Any]] = {}
    for key, item in meta.state_dict_metadata.items():
        # Accelerate saves {"model": state_dict}; DCP flattens it to "model.<fqn>".
        if isinstance(item, TensorStorageMetadata) and key.startswith("model."):
            raw[key.removeprefix("model.")] = (tuple(item.size), item.properties.dtype)

    def read(fqn: str) -> torch.Tensor:
        shape, dtype = raw[fqn]
        target = {"model": {fqn: torch.empty(shape, dtype=dtype)}}
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(model_dir)), no_dist=True)
        return target["model"][fqn]

    return _named("FSDP sharded (DCP)", folder, raw, read)


def _torch_file(kind: str, folder: Path, path: Path) -> Source:
    import torch

    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise UserError(f"{path}: not a state dict (a {type(state).__name__})")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    raw = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    return _named(kind, folder, raw, lambda k: tensors[k])


def _deepspeed_tag(folder: Path) -> str | None:
    latest = folder / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if (folder / tag).is_dir():
            return tag
    if any((folder / DEEPSPEED_TAG).glob("*model_states.pt")):
        return DEEPSPEED_TAG
    return None


def _deepspeed(folder: Path, tag: str) -> Source:
    import contextlib
    import io

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per parameter group
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag, lazy_mode=True)
    raw = {k: (tuple(v.shape), getattr(v, "dtype", torch.float32)) for k, v in lazy.items()}

    def read(name: str) -> torch.Tensor:
        value = lazy[name]
        return value if isinstance(value, torch.Tensor) else value.contiguous()

    return _named(f"DeepSpeed ZeRO ({tag}/)", folder, raw, read)


def _safetensors(folder: Path, files: list[Path]) -> Source:
    """A handle per tensor read: safetensors maps the file, and tensors read through one open handle
    keep their pages resident (the whole file, by the last tensor)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    raw: dict[str, tuple[tuple[int, ...], Any]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                piece = handle.get_slice(key)
                raw[key] = (tuple(piece.get_shape()), _safetensors_dtype(piece.get_dtype()))
                where[key] = path

    def read(key: str) -> Any:
        with safe_open(str(where[key]), framework="pt") as handle:
            return handle.get_tensor(key)

    return _named("safetensors", folder, raw, read)


def _safetensors_dtype(name: str) -> Any:
    import torch

    names = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}  # fmt: skip
    return names[name]


def _safetensors_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [folder / name for name in sorted(set(weight_map.values()))]
    return []


def open_source(folder: Path) -> Source:
    """The model tensors of checkpoint ``folder``, by the layout it holds (module docstring)."""
    folder = Path(folder)
    tag = _deepspeed_tag(folder)
    if tag is not None:
        return _deepspeed(folder, tag)
    if (folder / FSDP_SHARDED_DIR / ".metadata").is_file():
        return _dcp(folder)
    for name in FSDP_FULL_FILES:
        if (folder / name).is_file():
            return _torch_file("FSDP full state dict", folder, folder / name)
    files = _safetensors_files(folder)
    if files:
        return _safetensors(folder, files)
    if (folder / "pytorch_model.bin").is_file():
        return _torch_file("torch state dict", folder, folder / "pytorch_model.bin")
    raise UserError(
        f"{folder}: no model weights found (looked for {FSDP_SHARDED_DIR}/, {', '.join(FSDP_FULL_FILES)}, "
        "a DeepSpeed tag folder, model.safetensors, pytorch_model.bin)"
    )
