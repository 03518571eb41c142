"""A sweep and dependency task that trains through the product: ``orchestrator.loop.ResumableLoop``.

The model is one weight ``w`` (``1 + seed`` at step 0) and each batch is ``x = 1``; the loss is
``A * (w * x) ** 2`` with plain SGD at ``--lr`` (written out: a ``torch.optim`` optimizer imports
``torch._dynamo``, seconds per task on a loaded 2-core machine, and plain SGD keeps no state). Each step's loss is therefore known in advance,
``A * (1 + seed) ** 2 * (1 - 2 * A * lr) ** (2 * (step - 1))`` (see :func:`expected_loss`), and with
``A = 4`` the task with lr 0.1 is the best of 0.1, 0.2 and 0.3. Each train event carries ``lr`` and
``seed``. Resume, the agreed stop on USR2/TERM (checkpoint, exit 75 for a requeue), the attempt's
start record and the metrics are the loop's: this script writes none of them itself.

``--hold-lr LR``: in its first attempt the task with that lr waits inside step ``--hold-at`` for
the stop signal (it writes ``holding.json`` to its run directory first), then trains that step, at
whose end the loop saves it and leaves for a requeue: the requeue tests' deterministic point.
``--fail``: exit 1 at once (a job that FAILED); ``--fail-if yes`` too (a grid axis picks the task).
``--step-s``: the time one step takes (the workload's pace); ``--pace-s T`` instead: the steps spread
to end T seconds after the node started (node 0's ``budget.json``), however long the start-up took
(a task's cost that the machine's load does not change); ``--save-every N``: a checkpoint every N steps too (what a
``--budget`` measures the next checkpoint interval by).
Rank 0 appends ``$ORCHESTRATOR_RUN_NAME`` to ``run_names.txt`` in the run directory at each attempt's
start (what a script would name its run after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

A = 4.0
HOLDING_FILE = "holding.json"


def expected_loss(lr: float, seed: int, step: int) -> float:
    """The loss of step ``step`` (1-based) of an uninterrupted run, in exact arithmetic."""
    return A * (1.0 + seed) ** 2 * (1.0 - 2.0 * A * lr) ** (2 * (step - 1))


def node_start(run_dir: object, attempt: int) -> float:
    """When this attempt's node process started (node 0's budget meter), 0.0 while not recorded."""
    try:
        with open(os.path.join(str(run_dir), "logs", f"attempt_{attempt}", "budget.json")) as fh:
            return float(json.load(fh)["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def main() -> int:
    began = time.time()
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument(
        "--save-every", type=int, default=0, help="also checkpoint every N steps (0: on a stop only)"
    )
    p.add_argument(
        "--pace-s", type=float, default=0.0, help="spread the steps to end this long after the node started"
    )
    p.add_argument("--hold-lr", type=float, default=None)
    p.add_argument("--hold-at", type=int, default=2)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--fail-if", default="", help="'yes': as --fail (a grid axis can say which task fails)")
    args = p.parse_args()
    if args.fail or args.fail_if == "yes":
        print("sweep_task: failing on purpose", file=sys.stderr)
        return 1

    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from orchestrator.loop import ResumableLoop

    accelerator = Accelerator()
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0 + args.seed)
    loader = DataLoader(TensorDataset(torch.ones(args.steps, 1)), batch_size=1)
    model, loader = accelerator.prepare(model, loader)
    loop = ResumableLoop(accelerator, max_steps=args.steps, save_every=args.save_every)

    attempt = int(os.environ.get("ORCHESTRATOR_ATTEMPT", "0"))
    if accelerator.is_main_process:
        with open(loop.run_dir / "run_names.txt", "a") as names:
            names.write(os.environ.get("ORCHESTRATOR_RUN_NAME", "") + "\n")
    origin = 0.0
    hold = args.hold_lr is not None and abs(args.lr - args.hold_lr) < 1e-12 and attempt == 0
    for (x,) in loop.batches(loader, epochs=1):
        if hold and loop.step + 1 == args.hold_at:
            # The workload waits for the test's signal (not a test synchronisation): the loop's own
            # stop request notes it, and the loop agrees on it at the end of this step.
            (loop.run_dir / HOLDING_FILE).write_text(json.dumps({"step": args.hold_at}))
            while not loop.stop.signum:
                time.sleep(0.05)
        if args.pace_s > 0:  # step k ends at origin + pace * k / steps, whatever the start-up took
            origin = origin or node_start(loop.run_dir, attempt) or began
            time.sleep(max(0.0, origin + args.pace_s * (loop.step + 1) / args.steps - time.time()))
        else:
            time.sleep(args.step_s)
        loss = A * (model(x) ** 2).mean()
        accelerator.backward(loss)
        with torch.no_grad():
            for param in model.parameters():
                param -= args.lr * param.grad
                param.grad = None
        loop.step_done(loss, lr=args.lr, seed=float(args.seed))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
