"""train/'s step boundary: the time between one step's end and the next one's start (issue 31).

``orchestrator cost`` bills that gap as ``step_overhead``. It is measured here from ``metrics.jsonl``
(a step's record carries its end, ``time``, and its length, ``step_time_s``), for two versions of
``train/`` run the same way in one invocation, interleaved (order flipped every round):

* ``candidate``: the working tree's ``train/``;
* ``baseline``: ``train/`` at ``--baseline-ref`` (``git archive``), by default 81f24b3, the last commit
  before the stop agreement rode along with the loss' all_reduce and trackers were logged every
  ``--log-every`` steps (Accelerate's TensorBoard tracker flushes its file at every ``log()``).

Each run is ``orchestrator submit --profile local --nodes 2 --strategy ddp --wait -- train.py
--preset tiny --data synthetic`` (2 ranks on this machine's cores). Losses of both must be equal:
the change may not alter training. Writes ``bench/results_step_boundary.json`` and prints the row
for ``bench/results.md``::

    python bench/bench_step_boundary.py --steps 400 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: Steps left out at the start of each run (allocator and thread-pool warm-up).
WARMUP_STEPS = 20


def baseline_tree(ref: str, into: Path) -> Path:
    """``train/`` as of ``ref``, unpacked under ``into``; its train.py."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "train"], capture_output=True, check=True
    )
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "train" / "train.py"


def run_once(script: Path, steps: int, workdir: Path, name: str) -> Path:
    """One 2-rank DDP run through the product; its run directory."""
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "submit", "--profile", "local", "--nodes", "2", "--strategy", "ddp",
         "--name", name, "--wait", "--", str(script), "--preset", "tiny", "--data", "synthetic",
         "--max-steps", str(steps)],
        cwd=workdir, capture_output=True, text=True, timeout=60 + steps, check=False,
    )  # fmt: skip
    line = [ln for ln in proc.stdout.splitlines() if "run directory" in ln]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return Path(line[-1].rsplit("run directory ", 1)[1].strip())


def gaps_of(run_dir: Path) -> dict[str, Any]:
    """The step boundary of one run: gaps between steps and the steps' own times (seconds)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in records if r.get("event") == "train"]
    gaps = [b["time"] - b["step_time_s"] - a["time"] for a, b in zip(train, train[1:], strict=False)]
    steps = [b["step_time_s"] for b in train[1:]]
    gaps, steps = gaps[WARMUP_STEPS:], steps[WARMUP_STEPS:]
    return {
        "gap_median_ms": statistics.median(gaps) * 1e3,
        "gap_mean_ms": statistics.mean(gaps) * 1e3,
        "gap_p99_ms": sorted(gaps)[int(0.99 * len(gaps))] * 1e3,
        "step_median_ms": statistics.median(steps) * 1e3,
        "boundary_share": sum(gaps) / (sum(gaps) + sum(steps)),
        "losses": [r["loss"] for r in train],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-ref", default="81f24b3")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results_step_boundary.json")
    args = ap.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"candidate": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="bench-step-boundary-") as tmp:
        work = Path(tmp)
        scripts = {
            "candidate": REPO / "train" / "train.py",
            "baseline": baseline_tree(args.baseline_ref, work / "base"),
        }
        env_home = work / "home"
        env_home.mkdir()
        os.environ["ORCHESTRATOR_HOME"] = str(env_home)
        for i in range(args.rounds):
            order = ["candidate", "baseline"] if i % 2 == 0 else ["baseline", "candidate"]
            for which in order:
                run = gaps_of(run_once(scripts[which], args.steps, work, f"sb-{which}-{i}"))
                results[which].append(run)
                print(f"round {i} {which}: gap median {run['gap_median_ms']:.2f} ms, mean {run['gap_mean_ms']:.2f} ms, "
                      f"step {run['step_median_ms']:.1f} ms, boundary {100 * run['boundary_share']:.2f} %", flush=True)  # fmt: skip
    equal = all(
        c["losses"] == b["losses"] for c, b in zip(results["candidate"], results["baseline"], strict=True)
    )

    def med(which: str, key: str) -> float:
        return statistics.median(r[key] for r in results[which])

    summary = {
        k: {
            m: med(k, m)
            for m in ("gap_median_ms", "gap_mean_ms", "gap_p99_ms", "step_median_ms", "boundary_share")
        }
        for k in results
    }
    c, b = summary["candidate"], summary["baseline"]
    row = (
        f"| train/'s step boundary (gap between steps, 2 ranks DDP tiny on CPU through `submit --profile local`, "
        f"{args.rounds} interleaved rounds x {args.steps} steps) vs train/ at {args.baseline_ref} | report "
        f"(losses equal: {'yes' if equal else 'NO'}) | mean gap {c['gap_mean_ms']:.2f} ms vs {b['gap_mean_ms']:.2f} ms "
        f"(median {c['gap_median_ms']:.2f} vs {b['gap_median_ms']:.2f}; p99 {c['gap_p99_ms']:.1f} vs "
        f"{b['gap_p99_ms']:.1f}); share of training time {100 * c['boundary_share']:.2f} % vs "
        f"{100 * b['boundary_share']:.2f} % at {c['step_median_ms']:.0f} ms steps | "
        f"{b['gap_mean_ms'] / c['gap_mean_ms']:.1f}x less | n/a |"
    )
    for r in (*results["candidate"], *results["baseline"]):
        r.pop("losses")
    args.out.write_text(
        json.dumps({"summary": summary, "losses_equal": equal, "runs": results}, indent=1) + "\n"
    )
    print(row)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
