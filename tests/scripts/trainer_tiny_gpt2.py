"""An unchanged HF ``Trainer`` script on a tiny randomly initialised GPT-2 (no download): what a user brings.

Random token sequences; ``--save-model DIR`` calls ``trainer.save_model(DIR)`` after training, as the
Transformers examples do. Rank 0 appends ``{"step"}`` to ``--progress`` at every step (when given), so a
test can tell that training runs.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed


class RandomTokens(Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(TrainerCallback):
    def __init__(self, path: str | None) -> None:
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.path and state.is_world_process_zero:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"step": state.global_step}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--save-model")
    p.add_argument("--progress")
    args = p.parse_args()
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=args.save_steps,
        logging_steps=5,
        report_to="none",
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )
    set_seed(0)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(256, 16, config.vocab_size),
        callbacks=[Progress(args.progress)],
    )
    trainer.train()
    if args.save_model:
        trainer.save_model(args.save_model)


if __name__ == "__main__":
    main()
