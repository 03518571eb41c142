"""A killed rank's restart inside the allocation, side by side: in place, as a new step, torchrun.

``train/`` (tiny preset, synthetic data, 2 nodes x 1 process, DDP, a checkpoint every
``--ckpt-every`` steps) runs in three configurations at once on one test cluster, each on a
partition of its own (2 nodes):

* ``in_place``: ``orchestrator submit`` with ``max_restarts: 100``: the nodes keep their launchers
  and fork the new ranks from the imports they hold (``orchestrator.node.restart_in_place``);
* ``new_step``: the same with the profile's ``env: {ORCHESTRATOR_RESTART_IN_PLACE: "0"}``: every
  restart a new srun step whose node tasks import everything again (the product before this);
* ``torchrun``: ``sbatch`` + ``srun torchrun --max-restarts`` (bench_chaos's script), whose agent
  respawns its workers.

Each round kills rank 1 of every configuration at the same moment (SIGKILL, as the OOM killer
does), once each has trained past its first checkpoint of the attempt, and takes the time from the
kill to the first step it trains after it (``metrics.jsonl``). All meet the same load at the same
time; the ratios are per round, the medians over ``--rounds``. Run it through the cluster wrapper::

    NODES=6 bash tests/cluster/run_with_cluster.sh .venv/bin/python bench/bench_restart.py --rounds 7

Writes ``bench/results_restart.json`` and prints the rows for ``bench/results.md``. ``--fault hang``
stops rank 1 instead (SIGSTOP): the hang watchdog (``--hang-timeout``) saves the stacks and the job
restarts, in place or as a new step; torchrun has no watchdog and is left out
(``bench/results_restart_hang.json``). ``--launcher torchrun`` gives both product configurations the
profile's ``launcher: torchrun`` (DeepSpeed's way before 2026-11-29): in place, the kept launcher starts a
new torchrun agent whose ranks import for themselves (``bench/results_restart_torchrun.json``).
``--strategy deepspeed_zero2``: the product's configurations train with DeepSpeed, and torchrun's
place goes to DeepSpeed's restart before 2026-11-29 (``before``: a new step, ranks through
torchrun) (``bench/results_restart_deepspeed.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_chaos
import soak_preemption as soak
from bench_chaos import ChaosProduct, Launched, train_events
from bench_goodput import REPO, run

CONFIGS = ("in_place", "new_step", "torchrun")
NODES_PER_CONFIG = 2


def train_args(ckpt_every: int) -> list[str]:
    return [
        *("--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64"),
        *("--max-steps", "1000000", "--ckpt-every", str(ckpt_every), "--log-every", "1"),
    ]


def make_configs(
    tmp: Path,
    args: list[str],
    hang_timeout: int | None = None,
    launcher: str = "direct",
    strategy: str = "ddp",
) -> dict[str, Any]:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    out: dict[str, Any] = {}
    names = CONFIGS if strategy == "ddp" else ("in_place", "new_step", "before")
    for i, name in enumerate(names):
        if hang_timeout is not None and name == "torchrun":
            continue  # no watchdog: a stopped rank holds its job until the collective's timeout
        first = i * NODES_PER_CONFIG + 1
        partition = f"restart_{name}"
        run(
            *("scontrol", "create", f"PartitionName={partition}"),
            *(f"Nodes=n[{first}-{first + NODES_PER_CONFIG - 1}]", "MaxTime=INFINITE", "State=UP"),
        )
        cfg: Any
        if name == "torchrun":
            cfg = Launched(name, tmp, args, torchrun, str(REPO), partition)
        else:
            over: dict[str, Any] = {"max_restarts": 100, "spare_nodes": 0, "launcher": launcher}
            if hang_timeout is not None:
                over["hang_timeout"] = hang_timeout
            if name in ("new_step", "before"):
                over["env"] = {"ORCHESTRATOR_RESTART_IN_PLACE": "0"}
            if name == "before":
                over["launcher"] = "torchrun"
            cfg = ChaosProduct(name, tmp, over, args, partition)
            cfg.strategy = strategy
        out[name] = cfg
    return out


def trained_after(cfg: Any, since: float) -> list[dict[str, Any]]:
    return [e for e in train_events(cfg.run_dir) if e.get("event") == "train" and e["time"] > since]


def rank1(cfg: Any, not_pid: int) -> int | None:
    """Rank 1's pid once it is a new process that trains (its heartbeat or /proc says so)."""
    pid = cfg.rank_pids().get(1, (0, ""))[0]
    return pid if pid and pid != not_pid else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--fault", choices=("kill", "hang"), default="kill")
    ap.add_argument("--hang-timeout", type=int, default=8, help="seconds; with --fault hang")
    ap.add_argument("--launcher", choices=("direct", "torchrun"), default="direct", help="the product's")
    ap.add_argument("--strategy", default="ddp", help="the product's (ddp, deepspeed_zero2, ...)")
    ap.add_argument("--out", default=None, help="default: bench/results_restart[_hang|_torchrun].json")
    opts = ap.parse_args()
    hang = opts.fault == "hang"
    suffix = "_hang" if hang else "_torchrun" if opts.launcher == "torchrun" else ""
    suffix += "" if opts.strategy == "ddp" else f"_{opts.strategy.split('_')[0]}"
    out = opts.out or str(REPO / "bench" / f"results_restart{suffix}.json")
    fault = signal.SIGSTOP if hang else signal.SIGKILL
    args = train_args(opts.ckpt_every)
    tmp = Path(tempfile.mkdtemp(prefix="bench_restart_"))
    configs = make_configs(tmp, args, opts.hang_timeout if hang else None, opts.launcher, opts.strategy)
    # bench_chaos's script lets torchrun restart 3 times: here one per round and two to spare.
    bench_chaos.SCRIPT = bench_chaos.SCRIPT.replace("--max-restarts=3", f"--max-restarts={opts.rounds + 2}")
    for cfg in configs.values():
        cfg.submit()
    rows: list[dict[str, Any]] = []
    killed = {name: 0 for name in configs}
    gone: dict[str, str] = {}  # configurations whose job ended by itself: out of later rounds
    try:
        for r in range(opts.rounds):
            live = {n: c for n, c in configs.items() if n not in gone}
            pids = {n: soak.wait(lambda c=c, n=n: rank1(c, killed[n]), 300) for n, c in live.items()}
            for name, cfg in live.items():  # every configuration past a checkpoint of this attempt
                if not pids[name] or not soak.wait(
                    lambda c=cfg: _steps_since_start(c) > opts.ckpt_every + 1, 300
                ):
                    gone[name] = f"round {r + 1}: not training again within 300 s (job {cfg.current_job()})"
            at = time.time()
            for name in live:
                if name not in gone:
                    os.kill(pids[name], fault)
                    killed[name] = pids[name]
            row: dict[str, Any] = {"round": r + 1, "load": os.getloadavg()[0]}
            for name, cfg in configs.items():
                first = None if name in gone else soak.wait(lambda c=cfg, t=at: trained_after(c, t), 300)
                row[name] = round(first[0]["time"] - at, 2) if first else None
                if first is None and name not in gone:
                    gone[name] = f"round {r + 1}: no step within 300 s of the kill (job {cfg.current_job()})"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for cfg in configs.values():
            cfg.stop()
    summary = {
        name: {
            "median_s": statistics.median(t)
            if (t := [r[name] for r in rows if r[name] is not None])
            else None,
            "all_s": [r[name] for r in rows],
            "ended": gone.get(name),
        }
        for name in configs
    }
    ratios = {
        f"{other}/in_place": statistics.median(q) if (q := _ratios(rows, other)) else None
        for other in configs
        if other != "in_place"
    }
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "fault": f"SIGSTOP, hang_timeout {opts.hang_timeout:g} s" if hang else "SIGKILL",
        "launcher": opts.launcher,
        "strategy": opts.strategy,
        "rows": rows,
        "summary": summary,
        "ratios": ratios,
    }
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=2))
    return 0


def _ratios(rows: list[dict[str, Any]], other: str) -> list[float]:
    """Per round, ``other``'s time over in_place's: the same kill, the same load."""
    return [r[other] / r["in_place"] for r in rows if r[other] is not None and r["in_place"]]


def _steps_since_start(cfg: Any) -> int:
    """Steps trained by the newest attempt (since its last ``startup`` event)."""
    events = train_events(cfg.run_dir)
    starts = [i for i, e in enumerate(events) if e.get("event") == "startup"]
    return sum(1 for e in events[(starts[-1] if starts else 0) :] if e.get("event") == "train")


if __name__ == "__main__":
    sys.exit(main())
