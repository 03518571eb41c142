"""A user's Accelerate loop with orchestrator's three lines (a small MLP on random data), run by
tests/rank/test_loop_shard_check.py.

``--stop-at K``: a run that resumed nothing sends itself USR2 at step K, as Slurm's pre-timeout signal
would: every rank saves step K and the job leaves for a requeue. ``--reads DIR``: each rank writes the
DCP shard files (``*.distcp``) this process opened while ``ResumableLoop`` restored (Python's ``open``
audit events: ``open()`` and ``os.open``, in every thread) to ``DIR/reads.attempt<A>.rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

OPENED: list[str] = []
RECORDING = [True]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and RECORDING[0] and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.endswith(".distcp"):
            OPENED.append(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--stop-at", type=int, default=0)
    p.add_argument("--reads", default=None)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--keep-last", type=int, default=8)
    args = p.parse_args()
    sys.addaudithook(_audit)

    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from orchestrator.loop import ResumableLoop

    set_seed(0)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(args.samples, 64, generator=g), torch.randint(0, 10, (args.samples,), generator=g)
    )
    loader = DataLoader(data, batch_size=16, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    loop = ResumableLoop(
        accelerator, save_every=args.save_every, max_steps=args.max_steps, keep_last=args.keep_last
    )
    RECORDING[0] = False
    if args.reads:
        attempt, rank = os.environ.get("ORCHESTRATOR_ATTEMPT", "0"), accelerator.process_index
        record = {"rank": rank, "resumed_from": str(loop.resumed_from or ""), "opened": sorted(set(OPENED))}
        (Path(args.reads) / f"reads.attempt{attempt}.rank{rank}.json").write_text(json.dumps(record))
    model.train()
    for x, y in loop.batches(loader):
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if loop.resumed_from is None and loop.step + 1 == args.stop_at and accelerator.is_main_process:
            os.kill(os.getpid(), signal.SIGUSR2)  # noted now, agreed on by every rank in step_done
        loop.step_done(loss)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
