"""A training stand-in that trains until stopped, for the "nothing trains twice" tests: no torch,
a train event in metrics.jsonl every ``--step-s`` seconds. ``--leave-child``: rank 0 first forks a
child that outlives it (as a script's own helper process may), its pid in ``<run_dir>/stray.pid``.
``--ignore-term``: SIGTERM is ignored (a rank stuck where no handler runs)."""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--leave-child", action="store_true")
    p.add_argument("--ignore-term", action="store_true")
    args = p.parse_args()
    run_dir = Path(os.environ["ORCHESTRATOR_RUN_DIR"])
    rank = int(os.environ.get("RANK", "0"))
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.leave_child and rank == 0:
        pid = os.fork()
        if pid == 0:
            time.sleep(600)  # the stray process itself, not a synchronisation
            os._exit(0)
        (run_dir / "stray.pid").write_text(str(pid))
    step = 0
    while True:
        time.sleep(args.step_s)
        step += 1
        with open(run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"event": "train", "step": step, "rank": rank, "loss": 1.0}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
