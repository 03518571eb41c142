"""FSDP2 in bf16 on CPU ranks, as train/ and every hooked script get it: ``Accelerator()`` with the
orchestrator workarounds, one tiny model whose forward returns an fp32 loss, one step. Rank 0
writes the dtypes of the policy ``fully_shard`` was given and of the loss to ``--out`` (JSON)."""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator
from torch import nn

from orchestrator.rank import workarounds
from orchestrator.rank.run_script import leave


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).float().pow(2).mean()  # the loss in fp32, as train/model.py computes it


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    pending = workarounds.before_accelerator()
    accelerator = Accelerator()
    applied = workarounds.after_accelerator(accelerator, pending)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    policy = model._get_fsdp_state()._mp_policy
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(accelerator.process_index))
    loss = model(x)
    accelerator.backward(loss)
    grad = next(iter(model.parameters())).grad
    optimizer.step()
    if accelerator.is_main_process:
        record = {
            "distributed_type": accelerator.distributed_type.value,
            "world_size": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "param_dtype": str(policy.param_dtype),
            "reduce_dtype": str(policy.reduce_dtype),
            "output_dtype": str(policy.output_dtype),
            "loss_dtype": str(loss.dtype),
            "grad_dtype": str(grad.dtype) if grad is not None else None,
            "applied": applied,
        }
        with open(args.out, "w") as fh:
            json.dump(record, fh)
    workarounds.finish(accelerator)


if __name__ == "__main__":
    main()
    # As every rank the product starts (run_script.leave): torch 2.13's gloo teardown at the
    # interpreter's exit aborted rank 0 once in a CI run ("terminate called without an active exception").
    leave(0)
