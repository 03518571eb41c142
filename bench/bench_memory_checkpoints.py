"""What a killed rank costs with and without memory checkpoints, side by side on one test cluster.

``train/`` (``--preset``, synthetic data, 2 nodes x 1 process, DDP, a shared checkpoint every
``--ckpt-every`` steps, ``max_restarts: 100``) runs in two configurations at once, each on a partition
of its own (2 nodes):

* ``shared``: restarts in place resume from the newest shared checkpoint (the product before);
* ``memory``: the same plus ``--memory-ckpt-every``: each rank's state in its node's memory
  (``orchestrator/rank/memory_checkpoints.py``); a restart in place resumes from the newest step
  every rank holds.

Each round kills rank 1 of both at the same moment (SIGKILL), once each has trained past a shared
checkpoint of its attempt, and reads from ``metrics.jsonl`` and the attempt's ``start.json``: the step
it had reached, the step the restart resumed from, the steps trained again, and the seconds from the
kill until it trains a step it had not reached before (its progress back). The steady cost is each
configuration's median step time and the seconds a memory checkpoint and a shared checkpoint took
(the ranks' log lines). Run it through the cluster wrapper::

    NODES=4 bash tests/cluster/run_with_cluster.sh .venv/bin/python bench/bench_memory_checkpoints.py --rounds 7

Writes ``bench/results_memory_checkpoints.json`` and prints the rows for ``bench/results.md``.

``--cost`` (no cluster: ``--profile local``, 2 simulated nodes of 1 process, one job per strategy in
turn, nothing killed): what a memory checkpoint costs against the step and against a shared checkpoint
of the same run (``--ckpt-every 10 --memory-ckpt-every 1``; rank 0 logs every tenth memory checkpoint and
every shared one; the step time is ``metrics.jsonl``'s, saves excluded). Writes
``bench/results_memory_checkpoints_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import soak_preemption as soak
from bench_chaos import ChaosProduct, train_events
from bench_goodput import REPO, run
from bench_restart import _steps_since_start, rank1

CONFIGS = ("shared", "memory")


def make_configs(tmp: Path, opts: argparse.Namespace) -> dict[str, ChaosProduct]:
    out: dict[str, ChaosProduct] = {}
    for i, name in enumerate(CONFIGS):
        first = 2 * i + 1
        partition = f"snap_{name}"
        run(
            *("scontrol", "create", f"PartitionName={partition}"),
            *(f"Nodes=n[{first}-{first + 1}]", "MaxTime=INFINITE", "State=UP"),
        )
        args = [
            *("--preset", opts.preset, "--data", "synthetic", "--batch-size", "4", "--seq-len", "64"),
            *("--max-steps", "1000000", "--ckpt-every", str(opts.ckpt_every), "--log-every", "1"),
        ]
        if name == "memory":
            args += ["--memory-ckpt-every", str(opts.memory_ckpt_every)]
        out[name] = ChaosProduct(name, tmp, {"max_restarts": 100, "spare_nodes": 0}, args, partition)
    return out


def reached(cfg: ChaosProduct, before: float) -> int:
    """The newest step logged before ``before``."""
    events = train_events(cfg.run_dir)
    return max((e["step"] for e in events if e.get("event") == "train" and e["time"] < before), default=0)


def newest_start(cfg: ChaosProduct) -> dict[str, Any] | None:
    attempts = sorted(
        (int(p.name.split("_")[1]), p)
        for p in (cfg.run_dir / "logs").glob("attempt_*")
        if p.name[8:].isdigit()
    )
    path = attempts[-1][1] / "start.json" if attempts else None
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def seconds_said(cfg: ChaosProduct, pattern: str) -> list[float]:
    """Seconds in rank 0's log lines matching ``pattern`` (its group 1)."""
    found = []
    for log in (cfg.run_dir / "logs").glob("attempt_*/node_0_ranks/rank_0.log"):
        if log.is_file():
            found += [float(m) for m in re.findall(pattern, log.read_text(errors="replace"))]
    return found


def cost(opts: argparse.Namespace) -> int:
    rows = []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for strategy in ("ddp", "full_shard"):
        res = run(
            sys.executable, "-m", "orchestrator", "submit", "--profile", "local", "--strategy", strategy,
            *("--nodes", "2", "--procs-per-node", "1", "--wait", "--", str(REPO / "train" / "train.py")),
            *("--preset", opts.preset, "--data", "synthetic", "--batch-size", "4", "--seq-len", "64"),
            *("--max-steps", "40", "--ckpt-every", "10", "--memory-ckpt-every", "1", "--log-every", "10"),
            env=env, timeout=1800,
        )  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(f"{strategy}: {res.stdout}{res.stderr}")
        run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
        log = (run_dir / "logs" / "attempt_0" / "node_0_ranks" / "rank_0.log").read_text(errors="replace")
        shared = [float(s) for s in re.findall(r"checkpoint step \d+ saved in ([\d.]+)s", log)]
        memory = [float(s) for s in re.findall(r"memory checkpoint step \d+: ([\d.]+)s", log)]
        steps = [e["step_time_s"] for e in train_events(run_dir) if e.get("event") == "train"]
        row = {
            "strategy": strategy,
            "median_step_s": _median(steps),
            "median_memory_ckpt_s": _median(memory),
            "median_shared_checkpoint_s": _median(shared),
            "memory/step": _ratio(memory, steps),
            "memory/shared": _ratio(memory, shared),
            "load": round(os.getloadavg()[0], 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "preset": opts.preset, "rows": rows}
    out = opts.out.replace(".json", "_cost.json") if opts.out.endswith("checkpoints.json") else opts.out
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _ratio(top: list[float], bottom: list[float]) -> float | None:
    return round(statistics.median(top) / statistics.median(bottom), 3) if top and bottom else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--memory-ckpt-every", type=int, default=5)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out", default=str(REPO / "bench" / "results_memory_checkpoints.json"))
    ap.add_argument("--cost", action="store_true", help="the cost of a save, on --profile local")
    opts = ap.parse_args()
    if opts.cost:
        return cost(opts)
    configs = make_configs(Path(tempfile.mkdtemp(prefix="bench_memory_ckpts_")), opts)
    for cfg in configs.values():
        cfg.submit()
    rows: list[dict[str, Any]] = []
    killed = {name: 0 for name in configs}
    try:
        for r in range(opts.rounds):
            pids = {n: soak.wait(lambda c=c, n=n: rank1(c, killed[n]), 300) for n, c in configs.items()}
            for name, cfg in configs.items():
                if not pids[name] or not soak.wait(
                    lambda c=cfg: _steps_since_start(c) > opts.ckpt_every, 600
                ):
                    raise RuntimeError(f"{name}: round {r + 1}: not training past a checkpoint within 600 s")
            # Vary where in the checkpoint interval the kill falls: a few steps more each round.
            extra = (r * 7) % opts.ckpt_every
            target = {n: reached(c, time.time() + 1) + extra for n, c in configs.items()}
            soak.wait(
                lambda t=target: all(reached(c, time.time() + 1) >= t[n] for n, c in configs.items()), 600
            )
            at = time.time()
            for name in configs:
                os.kill(pids[name], signal.SIGKILL)
                killed[name] = pids[name]
            row: dict[str, Any] = {"round": r + 1, "load": round(os.getloadavg()[0], 1)}
            for name, cfg in configs.items():
                was = reached(cfg, at)
                back = soak.wait(
                    lambda c=cfg, w=was, k=at: [e for e in train_events(c.run_dir)
                                          if e.get("event") == "train" and e["time"] > k and e["step"] > w],
                    600,
                )  # fmt: skip
                start = newest_start(cfg) or {}
                row[name] = {
                    "reached": was,
                    "resumed_from": start.get("step"),
                    "memory": bool(start.get("memory")),
                    "steps_again": was - int(start.get("step", 0)),
                    "progress_back_s": round(back[0]["time"] - at, 2) if back else None,
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for cfg in configs.values():
            cfg.stop()
    summary: dict[str, Any] = {}
    for name, cfg in configs.items():
        steps = [e["step_time_s"] for e in train_events(cfg.run_dir) if e.get("event") == "train"]
        summary[name] = {
            "median_steps_again": statistics.median(r[name]["steps_again"] for r in rows),
            "median_progress_back_s": statistics.median(
                r[name]["progress_back_s"] for r in rows if r[name]["progress_back_s"] is not None
            ),
            "median_step_s": round(statistics.median(steps), 4) if steps else None,
            "median_shared_checkpoint_s": _median(
                seconds_said(cfg, r"checkpoint step \d+ saved in ([\d.]+)s")
            ),
            "median_memory_ckpt_s": _median(seconds_said(cfg, r"memory checkpoint step \d+: ([\d.]+)s")),
        }
    ratios = [
        r["shared"]["progress_back_s"] / r["memory"]["progress_back_s"]
        for r in rows
        if r["shared"]["progress_back_s"] and r["memory"]["progress_back_s"]
    ]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "preset": opts.preset,
        "ckpt_every": opts.ckpt_every,
        "memory_ckpt_every": opts.memory_ckpt_every,
        "rows": rows,
        "summary": summary,
        "progress_back_shared/memory": statistics.median(ratios) if ratios else None,
    }
    Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    return 0


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


if __name__ == "__main__":
    sys.exit(main())
