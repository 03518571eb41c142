"""An Accelerate loop written the way the FSDP how-tos teach: the plugin built in code, no orchestrator
lines, no checkpoints. Each rank writes how many parameters it holds (``--out``.rank<R>, one JSON line
per attempt); rank 0 appends each step to ``--out``.progress so a test can tell when training runs."""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.fsdp.fully_sharded_data_parallel import FullOptimStateDictConfig, FullStateDictConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    plugin = FullyShardedDataParallelPlugin(
        state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    with open(f"{args.out}.rank{accelerator.process_index}", "a") as fh:
        record = {
            "rank": accelerator.process_index,
            "world_size": accelerator.num_processes,
            "distributed_type": accelerator.distributed_type.value,
            "local_params": local,
            "total_params": total,
            "attempt": os.environ.get("ORCHESTRATOR_ATTEMPT"),
        }
        fh.write(json.dumps(record) + "\n")
    g = torch.Generator().manual_seed(accelerator.process_index)
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 256, generator=g)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.is_main_process:
            with open(f"{args.out}.progress", "a") as fh:
                fh.write(f"{os.environ.get('ORCHESTRATOR_ATTEMPT')} {step}\n")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
