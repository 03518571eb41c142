"""An unmodified Accelerate script: plain Accelerator(), no orchestrator imports.

It checks the world size it was given, and that an all-reduce really crosses
every rank (sum of ranks), then writes one line per rank into --out.
"""

import argparse
import json
import os
import socket
import sys

import torch
from accelerate import Accelerator


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--expect-world-size", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    total = accelerator.reduce(torch.tensor([float(rank)]), reduction="sum").item()
    record = {
        "rank": rank,
        "world_size": world,
        "rank_sum": total,
        "host": socket.gethostname(),
        "distributed_type": str(accelerator.distributed_type),
        "marker": os.environ.get("MARKER_VALUE"),
        "python": sys.executable,
        "prefix": sys.prefix,
    }
    with open(f"{args.out}.rank{rank}", "w") as fh:
        json.dump(record, fh)
    accelerator.wait_for_everyone()
    if world != args.expect_world_size:
        print(f"world size {world} != expected {args.expect_world_size}", file=sys.stderr)
        return 1
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
