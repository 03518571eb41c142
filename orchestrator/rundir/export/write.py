"""Writing an export: safetensors streamed tensor by tensor, a ``from_pretrained`` folder, or torch.

safetensors' own ``save_file`` takes the whole state dict and turns each tensor into ``bytes`` first:
twice the model in memory. The format is an 8-byte header length, a JSON header naming every
tensor's dtype, shape and byte range, then the bytes in that order; with every shape and dtype known
before any tensor is read (:class:`orchestrator.rundir.export.read.Source`), the header goes first and
each tensor's bytes follow as soon as it is read, and then the tensor is dropped. ``--verify`` reads
the file back with the safetensors library itself.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from orchestrator.rundir.export.read import Source

#: What ``--format hf`` copies from the checkpoint (or the Trainer's output_dir) besides the weights.
HF_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
)  # fmt: skip
WEIGHTS = {"safetensors": "model.safetensors", "hf": "model.safetensors", "torch": "pytorch_model.bin"}


def target_dtype(dtype: torch.dtype, wanted: str) -> torch.dtype:
    """``--dtype``: floating tensors become fp32 or bf16; integer and bool tensors stay as they are."""
    import torch

    if not dtype.is_floating_point:
        return dtype
    return torch.bfloat16 if wanted == "bf16" else torch.float32


def _safetensors_name(dtype: torch.dtype) -> str:
    import torch

    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}  # fmt: skip
    return names[dtype]


def converted(source: Source, name: str, wanted: str) -> torch.Tensor:
    """Tensor ``name`` of ``source`` in the export's dtype, contiguous, on the CPU."""
    shape, dtype = source.entries[name]
    tensor = source.read(name).detach().to("cpu", target_dtype(dtype, wanted)).contiguous()
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: read shape {tuple(tensor.shape)}, the checkpoint lists {shape}")
    return tensor


def write_safetensors(path: Path, source: Source, wanted: str, metadata: dict[str, str]) -> int:
    """Stream ``source`` into one safetensors file at ``path``; returns the bytes of tensor data."""
    import torch

    header: dict[str, Any] = {}
    offset = 0
    for name, (shape, dtype) in source.entries.items():
        out_dtype = target_dtype(dtype, wanted)
        size = math.prod(shape) * out_dtype.itemsize
        header[name] = {
            "dtype": _safetensors_name(out_dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the library writes it
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for name in source.entries:
            tensor = converted(source, name, wanted)
            if tensor.numel():
                fh.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor
        fh.flush()
        os.fsync(fh.fileno())
    return offset


def write_torch(path: Path, source: Source, wanted: str) -> int:
    """``torch.save`` of the whole state dict: the format needs it all at once (not streamed)."""
    import torch

    state = {name: converted(source, name, wanted) for name in source.entries}
    torch.save(state, path)
    return sum(t.numel() * t.element_size() for t in state.values())


def hf_config_folder(checkpoint: Path) -> Path | None:
    """Where the transformers ``config.json`` of a checkpoint is: in it (a Trainer's ``checkpoint-N``)
    or in the folder above (the Trainer's ``output_dir``)."""
    for folder in (checkpoint, checkpoint.parent):
        if (folder / "config.json").is_file():
            return folder
    return None


def copy_hf_files(config_folder: Path, out: Path) -> list[str]:
    copied = []
    for name in HF_FILES:
        if (config_folder / name).is_file():
            shutil.copyfile(config_folder / name, out / name)
            copied.append(name)
    return copied


def write(fmt: str, out: Path, source: Source, wanted: str, metadata: dict[str, str],
          config_folder: Path | None, say: Callable[[str], None]) -> Path:  # fmt: skip
    """The export's files in ``out`` (which exists, empty); returns the weights file."""
    weights = out / WEIGHTS[fmt]
    if fmt == "torch":
        write_torch(weights, source, wanted)
    else:
        write_safetensors(weights, source, wanted, metadata)
    if fmt == "hf" and config_folder is not None:
        copied = copy_hf_files(config_folder, out)
        say(f"copied {', '.join(copied)} from {config_folder}")
    return weights
