"""An unmodified Accelerate script for DeepSpeed: plain Accelerator(), a model, an optimizer and a data
loader through prepare, a few steps. No orchestrator imports, no backend named, nothing DeepSpeed-specific.

Each rank writes what it got into ``<--out>.rank<R>``: world size, distributed type, ZeRO stage, and how
many parameter elements it holds locally after prepare, and the size of its partition, against the
model's total (ZeRO-3 partitions them).
"""

import argparse
import json
import sys

import torch
from accelerate import Accelerator


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # Before the first forward: ZeRO-3 keeps parameters below stage3_param_persistence_threshold whole
    # once they were gathered, so "nothing held locally" is a fact of the freshly partitioned model.
    local_numel = sum(p.numel() for p in model.parameters())
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
    plugin = accelerator.state.deepspeed_plugin
    partitions = [getattr(p, "ds_tensor", None) for p in model.parameters()]
    record = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "zero_stage": None if plugin is None else plugin.zero_stage,
        "local_numel": local_numel,
        "partition_numel": sum(t.numel() for t in partitions if t is not None),
        "model_numel": total,
        "losses": losses,
    }
    with open(f"{args.out}.rank{accelerator.process_index}", "w") as fh:
        json.dump(record, fh)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
