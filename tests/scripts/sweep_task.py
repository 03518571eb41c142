"""A training stand-in for sweep and dependency tests: no torch, a step every ``--step-s`` seconds.

Each step appends a train event (with its ``lr`` and ``seed``) to the run's metrics.jsonl; the loss
is a pure function of (lr, seed, step), so the best task of a sweep is known in advance. On the
profile's stop signal (USR2) it writes a complete checkpoint of the step it reached and exits with
the requeue code, like train/; a new attempt resumes from the newest complete checkpoint and says so
(a ``resume`` event). ``--hold-lr LR``: the task with that lr stops after ``--hold-at`` steps of its
first attempt and waits there for the signal (the requeue tests' deterministic point).
``--fail``: exit 1 at once (a job that FAILED); ``--fail-if yes`` too (a grid axis picks the task).
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from orchestrator.contract.checkpoints import file_digest
from orchestrator.contract.run_dir import (
    EXIT_REQUEUE,
    METRICS_FILE,
    last_complete_checkpoint,
    write_json_atomic,
)


def event(run_dir: Path, **fields: object) -> None:
    with open(run_dir / METRICS_FILE, "a") as fh:
        fh.write(json.dumps({**fields, "time": time.time()}) + "\n")


def checkpoint(run_dir: Path, step: int) -> None:
    root = run_dir / "checkpoints"
    tmp = root / f".tmp-step_{step:08d}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    files = {"state.json": (tmp / "state.json").stat().st_size}
    marker = {
        "step": step,
        "world_size": 1,
        "files": files,
        "sha256": {"state.json": file_digest(tmp / "state.json")},
    }
    (tmp / "COMPLETE.json").write_text(json.dumps(marker))
    os.replace(tmp, root / f"step_{step:08d}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--hold-lr", type=float, default=None)
    p.add_argument("--hold-at", type=int, default=2)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--fail-if", default="", help="'yes': as --fail (a grid axis can say which task fails)")
    args = p.parse_args()
    if args.fail or args.fail_if == "yes":
        print("sweep_task: failing on purpose", file=sys.stderr)
        return 1
    run_dir = Path(os.environ["ORCHESTRATOR_RUN_DIR"])
    attempt = int(os.environ.get("ORCHESTRATOR_ATTEMPT", "0"))
    stopped: list[int] = []
    signal.signal(signal.SIGUSR2, lambda signum, _frame: stopped.append(signum))
    found = last_complete_checkpoint(run_dir)
    step = found.step if found else 0
    if found:
        event(run_dir, event="resume", step=step, attempt=attempt)
    hold = args.hold_lr is not None and abs(args.lr - args.hold_lr) < 1e-12 and attempt == 0
    while step < args.steps:
        if stopped:
            break
        if hold and step >= args.hold_at:
            time.sleep(0.1)  # the workload waiting for the test's signal (not a test synchronisation)
            continue
        time.sleep(args.step_s)
        step += 1
        event(
            run_dir,
            event="train",
            step=step,
            loss=args.lr + args.seed + 1.0 / step,
            lr=args.lr,
            seed=args.seed,
            attempt=attempt,
        )
    if stopped:
        checkpoint(run_dir, step)
        write_json_atomic(
            run_dir / "exit_status.json",
            {"code": EXIT_REQUEUE, "reason": "USR2", "step": step, "time": time.time()},
        )
        return EXIT_REQUEUE
    return 0


if __name__ == "__main__":
    sys.exit(main())
