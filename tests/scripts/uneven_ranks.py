"""A healthy 2-rank job whose ranks are never alike: each step rank 1 computes for about
``--work`` seconds (the same Python line throughout) while rank 0 waits for it in the all-reduce;
``--stuck``: rank 1 sleeps instead (a rank that stopped outside the collective). Rank 0 writes
``ready`` to the run directory after the first all-reduce; both print each step."""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def work(seconds: float, x: torch.Tensor) -> torch.Tensor:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        x = torch.tanh(x @ x)
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stuck", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.rand(64, 64) / 64
    for step in range(args.steps):
        total = torch.ones(1)
        dist.all_reduce(total)
        if rank == 0 and step == 0:
            Path(os.environ["ORCHESTRATOR_RUN_DIR"], "ready").write_text("1")
        print(f"rank {rank} step {step}", flush=True)
        if rank == 1:
            if args.stuck:
                time.sleep(3600)
            x = work(args.work, x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
