"""An unchanged Trainer script whose reporting service dies of the stop signal, as wandb's does.

A reporting callback talks to a service process it started (wandb-core's shape: a child the rank
writes each log to). At step ``--term-at``, after orchestrator's step-end check of that step and before
that step's log, TERM reaches the service and the rank, as Slurm's ``scancel`` or ``scontrol requeue``
sends it to every process of the step. The next log call writes into a dead service's pipe.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed


class RandomData(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class ServiceReporter(TrainerCallback):
    """Each log goes down a pipe to a service process (dies of TERM like wandb-core)."""

    def __init__(self) -> None:
        self.service = subprocess.Popen(
            [sys.executable, "-c", "import sys\nfor line in sys.stdin: pass"],
            stdin=subprocess.PIPE,
            text=True,
        )

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        assert self.service.stdin is not None
        self.service.stdin.write(f"{state.global_step} {logs}\n")
        self.service.stdin.flush()  # BrokenPipeError once the service is gone


class StopSignalAt(TrainerCallback):
    """Added after orchestrator's callback: its step end runs after orchestrator's check."""

    def __init__(self, step: int, service: subprocess.Popen[str]) -> None:
        self.step = step
        self.service = service

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.service.send_signal(signal.SIGTERM)
            self.service.wait()
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--term-at", type=int, default=10)
    args = p.parse_args()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=200,
        per_device_train_batch_size=8,
        save_steps=50,
        logging_steps=5,
        report_to="none",
        seed=0,
        use_cpu=True,
    )
    set_seed(0)
    reporter = ServiceReporter()
    trainer = Trainer(model=Net(), args=training_args, train_dataset=RandomData(512), callbacks=[reporter])
    trainer.add_callback(StopSignalAt(args.term_at, reporter.service))
    trainer.train()


if __name__ == "__main__":
    main()
