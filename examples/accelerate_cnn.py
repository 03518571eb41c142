"""An Accelerate training loop (MNIST-shaped CNN on random data, no download) with orchestrator's
three lines: resume from the newest complete checkpoint, the agreed stop on USR2/TERM, progress.

    orchestrator submit --profile local --nodes 2 --strategy ddp -- examples/accelerate_cnn.py --epochs 2

Without the three lines (marked ``# orchestrator``) it is the loop of Accelerate's own examples; it
still launches, shows its logs and passes the self-check, but a requeue trains it again from step 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from orchestrator.loop import ResumableLoop  # orchestrator


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def random_mnist(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument(
        "--memory-ckpt-every",
        type=lambda v: v if v == "auto" else int(v),
        default=0,
        help="steps or auto; state into node memory (0: none)",
    )
    args = p.parse_args()

    set_seed(0)
    # A seedable sampler makes each epoch's order a function of (seed, epoch): exact on resume.
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(random_mnist(args.samples, seed=1), batch_size=args.batch_size, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    loop = ResumableLoop(  # orchestrator
        accelerator,
        save_every=args.save_every,
        max_steps=args.max_steps,
        memory_ckpt_every=args.memory_ckpt_every,
    )
    model.train()
    for images, labels in loop.batches(loader, epochs=args.epochs):  # orchestrator
        loss = F.cross_entropy(model(images), labels)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loop.step_done(loss)  # orchestrator
    accelerator.print(f"done: step {loop.step}, loss {loss.item():.6f}")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
