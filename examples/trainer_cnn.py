"""An HF ``Trainer`` script (MNIST-shaped CNN on random data, no download), as written for one machine.

    orchestrator submit --profile local --nodes 2 --strategy ddp -- examples/trainer_cnn.py --max-steps 200

Submitted through orchestrator it gets, unchanged, resume from the newest *complete* ``checkpoint-N``,
the agreed stop on USR2/TERM and progress in ``status``: the node's import hook adds the two lines
below. Run elsewhere (or with ``--no-script-hooks``), add them yourself:

    from orchestrator.hf import OrchestratorCallback, last_complete_checkpoint
    trainer = Trainer(..., callbacks=[OrchestratorCallback()])
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments, set_seed


class RandomMNIST(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 1, 28, 28, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.images[i], "labels": self.labels[i]}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(
        self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        x = F.relu(self.conv1(pixel_values))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        logits = self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", default="trainer_out")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--report-to", default="none")
    p.add_argument("--samples", type=int, default=4096)
    args = p.parse_args()

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        report_to=args.report_to,
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )
    set_seed(0)  # before the model is built: Trainer seeds only when it starts, after Net() drew its weights
    trainer = Trainer(model=Net(), args=training_args, train_dataset=RandomMNIST(args.samples, seed=1))
    trainer.train()


if __name__ == "__main__":
    main()
