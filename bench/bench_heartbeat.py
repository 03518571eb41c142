"""Heartbeat overhead: the tiny GPT's training step with and without the five beats a step of train/
sends (data, forward, backward, optimizer; and the cost of one beat alone).

Same process, same model, steps alternating (with / without) so the shared machine's load hits
both alike; medians over all steps. The goal (issue 13) is <= 1 % of the step time. The smallest
model is the worst case: a beat costs the same whatever the step costs.

    python bench/bench_heartbeat.py [--rounds 7] [--steps 60]   # writes bench/results_heartbeat.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from orchestrator.contract.heartbeat import Heartbeat  # noqa: E402
from train.model import build_model  # noqa: E402


def one_round(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    beat: Callable[[int, str], None],
) -> float:
    """Median seconds per step over ``steps`` steps."""
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        beat(step, "data")
        x = torch.randint(0, 256, (16, 64))
        beat(step, "forward")
        loss = model(x, x)
        beat(step, "backward")
        loss.backward()
        beat(step, "optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results_heartbeat.json")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model("tiny", 64, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update({"ORCHESTRATOR_RUN_DIR": tmp, "ORCHESTRATOR_ATTEMPT": "0", "RANK": "0"})
        hb = Heartbeat.for_this_rank()
        assert hb is not None
        one_round(model, optimizer, 10, hb.beat)  # warm-up
        base, beats = [], []
        for _ in range(args.rounds):
            # Alternating single steps: the machine's load drifts slower than a step.
            for _ in range(args.steps):
                base.append(one_round(model, optimizer, 1, lambda s, p: None))
                beats.append(one_round(model, optimizer, 1, hb.beat))
        n = 20000
        t0 = time.perf_counter()
        for i in range(n):
            hb.beat(i // 5, "forward")
        per_beat = (time.perf_counter() - t0) / n
        hb.close()
    step_base, step_beats = statistics.median(base), statistics.median(beats)
    result = {
        "step_s_without": round(step_base, 6),
        "step_s_with": round(step_beats, 6),
        "overhead_ratio": round(step_beats / step_base - 1, 4),
        "beat_us": round(per_beat * 1e6, 2),
        "beats_per_step": 4,
        "beats_share_of_step": round(4 * per_beat / step_base, 5),
        "rounds": args.rounds,
        "steps": args.steps,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
