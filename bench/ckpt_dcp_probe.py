"""DCP's sharded save against a raw write of the very same bytes, in the same processes, interleaved.

Run by bench_ckpt_load.py under ``torchrun --nproc-per-node 2``: builds train/'s ``base`` model, shards
it with FSDP2 (one unit per TransformerBlock, as the bench's full_shard config), takes one AdamW step,
then per repetition (order flipped every repetition): ``dcp.save`` of the model and of the optimizer
state dicts (the two saves ``accelerator.save_state`` makes, default FileSystemWriter), and a raw
``os.write`` + fsync of every local shard those state dicts hold (each rank its own file). Both sides
write the same bytes from the same memory on the same disk within seconds of each other, so the disk's
write-back state, which swings the raw figure 0.6-4 s on a shared machine, hits both. Rank 0 prints
one JSON line per repetition.

Not part of ``bench/run.py``: a tool for trying DCP writer options side by side. The third argument
names the variants (default ``dcp,raw``): ``dcp_nocrc`` (torch.save without its zip CRC-32, what
orchestrator.rank.checkpoint_io does), ``dcp_threads2`` (FileSystemWriter thread_count=2).

    torchrun --nproc-per-node 2 bench/ckpt_dcp_probe.py /tmp/probe 6 dcp,raw,dcp_nocrc,dcp_threads2
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train.model import TransformerBlock, build_model  # noqa: E402


def barrier_time() -> float:
    dist.barrier()
    return time.perf_counter()


def main() -> None:
    root, reps = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model("base")
    for block in model.modules():
        if isinstance(block, TransformerBlock):
            fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = model(torch.randint(0, 100, (1, 16)))
    (out[0] if isinstance(out, tuple) else out).float().mean().backward()
    opt.step()

    def dcp_save(folder: Path, **writer: Any) -> None:
        dcp.save(
            {"model": get_model_state_dict(model)},
            storage_writer=FileSystemWriter(str(folder / "m"), **writer),
        )
        dcp.save(
            {"optimizer": get_optimizer_state_dict(model, opt)},
            storage_writer=FileSystemWriter(str(folder / "o"), **writer),
        )

    def raw_save(folder: Path) -> int:
        folder.mkdir(parents=True, exist_ok=True)
        state: Any = get_optimizer_state_dict(model, opt)  # nested dicts of tensors
        tensors: list[Any] = list(get_model_state_dict(model).values())
        for st in state["state"].values():
            tensors += [v for v in st.values() if torch.is_tensor(v)]
        fd = os.open(folder / f"rank{rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        n = 0
        try:
            for v in tensors:
                local = v.to_local() if hasattr(v, "to_local") else v
                data = local.contiguous().view(-1).view(torch.uint8).numpy().data
                n += os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return n

    from torch.serialization import set_crc32_options

    def no_crc(folder: Path) -> None:
        set_crc32_options(False)
        try:
            dcp_save(folder)
        finally:
            set_crc32_options(True)

    variants: dict[str, Any] = {
        "dcp": lambda f: dcp_save(f),
        "raw": lambda f: raw_save(f),
        "dcp_nocrc": no_crc,
        "dcp_threads2": lambda f: dcp_save(f, thread_count=2),
    }
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else ["dcp", "raw"]
    for rep in range(reps):
        folder = root / f"rep{rep}"
        times: dict[str, float] = {}
        nbytes = 0
        for kind in chosen if rep % 2 == 0 else chosen[::-1]:
            t = barrier_time()
            got = variants[kind](folder / kind)
            if isinstance(got, int):
                nbytes = got
            times[kind] = barrier_time() - t
        total = torch.tensor([nbytes], dtype=torch.int64)
        dist.all_reduce(total)
        if rank == 0:
            print(
                json.dumps({"rep": rep, **{f"{k}_s": v for k, v in times.items()}, "bytes": int(total)}),
                flush=True,
            )
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
