"""An unmodified Accelerate script that prepares a small model and trains it a few steps, then says
what Accelerate made of it (``--out PREFIX``: one ``PREFIX.rank<R>`` JSON per rank).

The model is two ``Block`` layers and a head, so ``--wrap-cls Block`` names a real layer class. Each
rank records: whether the node's script hooks patched ``Accelerator`` (the patched ``__init__`` leaves
its expectation on the instance), the distributed type, the parameters' dtypes, the dtype of the
head's output inside the forward (autocast shows there: Accelerate casts the model's outputs back to
fp32), how many modules are activation-checkpoint wrappers, and the losses.
"""

import argparse
import json
import math
import sys

import torch
from accelerate import Accelerator
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = Net()
    inner: list[str] = []  # the head's output dtype inside the forward (Accelerate casts outputs to fp32)
    model.head.register_forward_hook(lambda _m, _i, out: inner.append(str(out.dtype)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    losses, out_dtype = [], None
    for _ in range(args.steps):
        x = torch.randn(8, 32, generator=g).to(accelerator.device)
        out = model(x)
        out_dtype = str(out.dtype)
        loss = out.float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    record = {
        "rank": accelerator.process_index,
        "hooked": getattr(accelerator, "_orchestrator_expectation", None) is not None,
        "distributed_type": accelerator.distributed_type.value,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "output_dtype": out_dtype,
        "inner_dtype": inner[-1] if inner else None,
        "checkpoint_wrappers": sum(hasattr(m, "_checkpoint_wrapped_module") for m in model.modules()),
        "losses": losses,
        "finite": all(math.isfinite(v) for v in losses),
    }
    with open(f"{args.out}.rank{accelerator.process_index}", "w") as fh:
        json.dump(record, fh)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
