"""What DDP memory checkpoints cost a node: one copy of the model per rank (the baseline commit)
against one copy per node (this tree), with no memory checkpoints as the floor, in one invocation.

``train/`` (``--preset``, synthetic data, DDP, one simulated node of ``--ranks`` processes on
``--profile local``, a memory checkpoint at every step, no shared checkpoint until the end) runs three
times in turn:

* ``none``: this tree, ``--memory-ckpt-every 0`` (the step with nothing saved);
* ``per rank``: the baseline commit (``--baseline``, checked out with ``git worktree`` and imported
  through ``PYTHONPATH``): every DDP rank writes the whole model and optimizer;
* ``per node``: this tree: the node's first rank writes them, every other rank its own small state.

Each run's memory checkpoints go to a folder of its own (``ORCHESTRATOR_MEMORY_CKPT_ROOT``), whose
bytes are sampled every 0.1 s while it runs (the peak: what the node holds). The step's wall time is
the median gap between consecutive ``train`` events of ``metrics.jsonl`` (the save included, which the
event's ``step_time_s`` leaves out)::

    .venv/bin/python bench/bench_memory_checkpoints_ddp.py --ranks 2

Writes ``bench/results_memory_checkpoints_ddp.json`` and prints the rows for ``bench/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_goodput import REPO

#: The last commit whose DDP ranks each wrote a whole copy of the model and optimizer.
BASELINE = "34d6f2b"


def _bytes_under(root: Path) -> int:
    total = 0
    for path in root.rglob("*.pt"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # pruned while this looked
            pass
    return total


def one_run(tree: Path, opts: argparse.Namespace, every: int, scratch: Path) -> dict[str, Any]:
    root = scratch / "memory"
    root.mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "ORCHESTRATOR_MEMORY_CKPT_ROOT": str(root),
        "ORCHESTRATOR_HOME": str(scratch / "home"),
        "ORCHESTRATOR_RUNS": str(scratch / "runs"),
    }
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            peak[0] = max(peak[0], _bytes_under(root))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cmd = [
        sys.executable, "-m", "orchestrator", "submit", "--profile", "local",
        *("--strategy", getattr(opts, "strategy", "ddp"), "--nodes", str(getattr(opts, "nodes", 1))),
        *("--procs-per-node", str(opts.ranks), "--wait", "--"),
        str(tree / "train" / "train.py"),
        *("--preset", opts.preset, "--data", "synthetic", "--batch-size", "4", "--seq-len", "64"),
        *("--max-steps", str(opts.steps), "--ckpt-every", "0", "--memory-ckpt-every", str(every)),
        *("--log-every", "10"),
    ]  # fmt: skip
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False)
    done.set()
    sampler.join()
    if res.returncode != 0:
        raise RuntimeError(f"{tree}: {res.stdout[-3000:]}{res.stderr[-3000:]}")
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    times = [
        e["time"]
        for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if e.get("event") == "train"
    ]
    gaps = [b - a for a, b in zip(times[5:], times[6:], strict=False)]  # past the first steps' warm-up
    return {"median_step_wall_s": statistics.median(gaps), "peak_node_bytes": peak[0]}


def against_baseline(opts: argparse.Namespace, old_name: str, new_name: str) -> dict[str, dict[str, Any]]:
    """``none`` (this tree, no memory checkpoints), ``old_name`` (the baseline commit, ``opts.baseline``,
    checked out with ``git worktree``) and ``new_name`` (this tree), each with its ``save_s``: its median
    step's wall time over ``none``'s."""
    with tempfile.TemporaryDirectory(prefix="bench_mckpt_") as tmp:
        old = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(old), opts.baseline], check=True
        )
        try:
            rows = {
                "none": one_run(REPO, opts, 0, Path(tmp) / "none"),
                old_name: one_run(old, opts, 1, Path(tmp) / "old"),
                new_name: one_run(REPO, opts, 1, Path(tmp) / "new"),
            }
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    floor = rows["none"]["median_step_wall_s"]
    for name in (old_name, new_name):
        rows[name]["save_s"] = round(rows[name]["median_step_wall_s"] - floor, 3)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--out", default=str(REPO / "bench" / "results_memory_checkpoints_ddp.json"))
    opts = ap.parse_args()
    rows = against_baseline(opts, "per rank", "per node")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "preset": opts.preset,
        "ranks": opts.ranks,
        "baseline": opts.baseline,
        "load": round(os.getloadavg()[0], 1),
        "rows": rows,
        "bytes per rank / per node": round(
            rows["per rank"]["peak_node_bytes"] / rows["per node"]["peak_node_bytes"], 2
        ),
        "save per rank / per node": round(
            rows["per rank"]["save_s"] / max(rows["per node"]["save_s"], 1e-3), 2
        ),
    }
    Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
