"""A script whose one rank raises: the failure every explanation test needs, for real.

``--crash-rank R`` raises ``ValueError`` on global rank R after the process group is up; the other
ranks wait in a collective (as training would), so they only end when the job ends them.
``--error TEXT`` sets the exception's message; ``--abort``: the rank aborts (SIGABRT, as a native
crash in torch or at its teardown does) instead of raising. ``--others-succeed``: the other ranks return at once
instead, so the healthy nodes' torchrun sits in its 300 s exit barrier unless the job ends them.
"""

import argparse
import os
import time

import torch
from accelerate import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--error", default="boom from the test script")
    parser.add_argument(
        "--others-succeed",
        action="store_true",
        help="the other ranks return at once: their nodes' torchrun then waits in its exit barrier",
    )
    parser.add_argument("--abort", action="store_true", help="os.abort() instead of raising")
    args = parser.parse_args()
    accelerator = Accelerator()
    accelerator.wait_for_everyone()
    if accelerator.process_index == args.crash_rank:
        time.sleep(0.5)
        if args.abort:
            os.abort()
        raise ValueError(f"{args.error} (rank {accelerator.process_index})")
    if args.others_succeed:
        return
    # The others block in a collective the crashed rank never joins.
    accelerator.reduce(torch.ones(1), reduction="sum")
    print(f"rank {os.environ.get('RANK')} unexpectedly finished", flush=True)


if __name__ == "__main__":
    main()
