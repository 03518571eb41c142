"""One command for the orchestrator's performance goals: ``python bench/run.py [--quick]``.

Every comparison runs its baseline and candidate interleaved (order flipped every repetition) in
the same invocation after a warm-up, and reports medians and candidate/baseline ratios, so load
from other work on the machine hits both sides alike. Writes bench/results.md and bench/results.json.

1. CLI latency: ``python -m orchestrator --help`` / ``render`` / ``status --json`` (1,000 registered
   jobs, registry built like bench/bench_status.py) against ``accelerate --help``; ``python -c pass``
   is the interpreter floor. ``status10k`` (bench_status_scale.py): ``status`` and ``list`` over
   registries of 10,000 jobs, wall time and callgrind instructions.
2. Launch overhead: ``orchestrator submit --profile local ... --wait`` against ``accelerate launch
   --config_file <rendered config>``, from command start to the first ``train`` event in metrics.jsonl.
3. Hot path: median step_time_s (first steps excluded) under submit vs plain accelerate launch.
4. Checkpoints: FSDP2 full_shard sharded save (time from train's "saved in" line, bytes from
   COMPLETE.json) vs a Python write+fsync of the same byte count; async save stall vs sync stall
   (stall = gap between the train events around the checkpoint minus the next step's time, less the
   median gap elsewhere).
5. Memory (``mem``, bench_memory.py + memory_probe.py): per-rank model-state bytes and peak RSS of ddp /
   shard_grad_op / full_shard (+ CPU offload), small and base presets, 2 ranks, vs the ZeRO formulas
   restated for fp32 on CPU.
6. Checkpoints of the base preset (``ckpt_base``, bench_ckpt_load.py): sharded and full-state-dict
   save and load vs raw write+fsync / read of the same bytes.
7. Requeue round trip (``requeue``, bench_requeue.py) on the Slurm test cluster: USR2 -> first resumed
   step, broken into checkpoint / exit / scheduler requeue / start-up / load / first step, under both
   AuthInfo cred_expire settings (the test cluster is restarted with the other one, then back), for
   each ``requeue_as`` (``BENCH_REQUEUE_AS=auto`` measures the default alone, keeping the other rows).
   Start-up on the nodes (``startup``, bench_startup.py): job start -> first step per phase against an
   srun ``import torch, accelerate`` + gloo floor, warm and cold page cache. Launch against node count
   (``nodes``, bench_nodes.py): submit -> first step at 2..16 nodes against sbatch + srun + accelerate
   launch with hand-written configs; bench/launch_vs_nodes.png. (All three need the cluster:
   ``NODES=16 CRED_EXPIRE=default bash tests/cluster/run_with_cluster.sh python bench/run.py``.)
8. GPU (``gpu``, bench_gpu.py): with CUDA, runs bench/bench_gpu.py (train/ under ``accelerate launch`` on one GPU:
   ddp / FSDP2 full_shard, bf16 / no, small / base / 1b; --offload; checkpoint round trips) which writes
   bench/results_gpu.json; without CUDA, reports the figures of that file (when it exists) as measured
   elsewhere.

``--only`` runs some items and merges them into the existing results.json / results.md of ``--out``
(other items' rows are kept); without ``--only`` everything runs and the files are rewritten.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

PY = sys.executable
BASE_ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="0")
BASE_ENV.pop("ORCHESTRATOR_RUN_DIR", None)


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(cmd: list[str], env: dict, cwd: Path = REPO, timeout: float = 300) -> float:
    t = time.perf_counter()
    res = subprocess.run(
        cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout
    )
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.decode()[-2000:]}")
    return wall


def interleave(variants: dict[str, Callable[[], Any]], reps: int, warmup: int) -> dict[str, list]:
    """Run each variant ``warmup`` times (discarded), then ``reps`` rounds, order rotated per round."""
    names = list(variants)
    for _ in range(warmup):
        for n in names:
            variants[n]()
    out: dict[str, list] = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:
            order = order[::-1]
        for n in order:
            out[n].append(variants[n]())
    return out


def importtime_top(args: list[str], env: dict, k: int = 6) -> list[dict]:
    """Top-level imports by cumulative time (``-X importtime``) for one CLI command."""
    res = subprocess.run(
        [PY, "-X", "importtime", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    rows: list[dict[str, Any]] = []
    for line in res.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)", line)
        if m and len(m.group(3)) <= 1:  # top level only
            rows.append({"module": m.group(4), "cumulative_ms": round(int(m.group(2)) / 1000, 1)})
    rows.sort(key=lambda r: -r["cumulative_ms"])
    return rows[:k]


# ---------------------------------------------------------------------------
# 1. CLI latency


def bench_cli(tmp: Path, reps: int, warmup: int, jobs: int) -> dict:
    from bench_status import make_run_dir, write_script

    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import Registry

    home, runs_root, bin_dir = tmp / "home", tmp / "runs", tmp / "bin"
    bin_dir.mkdir(parents=True)
    ids = [str(8_000_000 + i) for i in range(jobs)]
    with Registry.open(home) as reg:
        for i, job_id in enumerate(ids):
            rd = runs_root / job_id
            make_run_dir(rd, 200)
            reg.add_job(
                job_id=job_id,
                name=f"sweep-{i}",
                profile="slurm_a100",
                scheduler="slurm",
                strategy="fsdp2",
                nodes=2,
                procs_per_node=4,
                command=["python", "train.py", f"--seed={i}"],
                run_dir=rd,
                state=JobState.RUNNING,
            )
    # squeue answers for every job (the fresh path: one real subprocess, parse, record, summarise).
    listing = tmp / "squeue_out.txt"
    listing.write_text(
        "".join(
            f"{j}|RUNNING|None|n[{i % 64}-{i % 64 + 1}]|2025-01-01T00:00:00|1:00:00\n"
            for i, j in enumerate(ids)
        )
    )
    write_script(bin_dir / "squeue", f"cat {listing}\n")
    write_script(bin_dir / "sacct", "exit 0\n")
    env = dict(BASE_ENV, ORCHESTRATOR_HOME=str(home), ORCHESTRATOR_RUNS=str(runs_root))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    acc = shutil.which("accelerate") or "accelerate"
    cmds = {
        "python -c pass": [PY, "-c", "pass"],
        "python -m orchestrator --help": [PY, "-m", "orchestrator", "--help"],
        "orchestrator render --profile slurm_a100 --strategy full_shard -- train/train.py": [
            PY,
            "-m",
            "orchestrator",
            "render",
            "--profile",
            "slurm_a100",
            "--strategy",
            "full_shard",
            "--",
            "train/train.py",
        ],
        f"orchestrator status --json ({jobs} jobs)": [PY, "-m", "orchestrator", "status", "--json"],
        "accelerate --help": [acc, "--help"],
    }
    out = interleave({n: partial(timed, c, env) for n, c in cmds.items()}, reps, warmup)
    res = {
        n: {"median_s": round(med(v), 4), "min_s": round(min(v), 4), "all_s": [round(x, 4) for x in v]}
        for n, v in out.items()
    }
    # Where the time goes (imports), for the orchestrator commands.
    for n, c in cmds.items():
        if "orchestrator" in n:
            res[n]["top_imports"] = importtime_top(c[1:], env)
    return res


# ---------------------------------------------------------------------------
# 2 + 3. Launch overhead and hot path


def first_train_event(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if '"train"' in line and line.endswith("\n"):
                    return json.loads(line)
    except OSError:
        return None
    return None


def run_until_first_step(
    cmd: list[str], env: dict, metrics_glob: tuple[Path, str], timeout: float = 300
) -> tuple[float, Path]:
    """Wall time from start to the first train event in metrics.jsonl; then waits for a clean exit."""
    root, pattern = metrics_glob
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    found: Path | None = None
    while time.perf_counter() - t0 < timeout:
        if found is None:
            hits = list(root.glob(pattern))
            found = hits[0] if hits else None
        if found is not None and first_train_event(found) is not None:
            first = time.perf_counter() - t0
            break
        if proc.poll() is not None and found is None:
            break
        time.sleep(0.01)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-3000:]}")
    assert found is not None  # first is only set once found is
    return first, found


def step_stats(metrics: Path, skip: int) -> dict:
    ev = [json.loads(line) for line in metrics.read_text().splitlines() if '"train"' in line]
    times = [e["step_time_s"] for e in ev[skip:]]
    m = med(times)
    return {"steps": len(ev), "median_step_time_s": m, "steps_per_s": 1.0 / m if m else float("nan")}


class Launcher:
    def __init__(self, tmp: Path, strategy: str = "ddp", extra: tuple[str, ...] = ()):
        self.tmp = tmp
        self.n = 0
        self.cfg_dir = tmp / f"cfg_{strategy}"
        subprocess.run(
            [
                PY,
                "-m",
                "orchestrator",
                "render",
                "--profile",
                "local",
                "--nodes",
                "1",
                "--strategy",
                strategy,
                *extra,
                "--out",
                str(self.cfg_dir),
            ],
            env=BASE_ENV,
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.cfg = next(self.cfg_dir.glob("accelerate_config*.yaml"))
        self.strategy = strategy

    def _fresh(self) -> Path:
        self.n += 1
        d = self.tmp / f"r{self.n}"
        d.mkdir()
        return d

    def submit(self, train_args: list[str]) -> tuple[float, Path]:
        d = self._fresh()
        env = dict(BASE_ENV, ORCHESTRATOR_RUNS=str(d / "runs"), ORCHESTRATOR_HOME=str(d / "home"))
        cmd = [
            PY,
            "-m",
            "orchestrator",
            "submit",
            "--profile",
            "local",
            "--nodes",
            "1",
            "--procs-per-node",
            "2",
            "--strategy",
            self.strategy,
            "--wait",
            "--poll",
            "0.2",
            "--",
            "train/train.py",
            *train_args,
        ]
        return run_until_first_step(cmd, env, (d / "runs", "*/metrics.jsonl"))

    def accelerate(self, train_args: list[str], extra_env: dict | None = None) -> tuple[float, Path]:
        d = self._fresh()
        # Same env the local profile gives its ranks (profile env: OMP_NUM_THREADS=1; CPU).
        env = dict(BASE_ENV, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", **(extra_env or {}))
        acc = shutil.which("accelerate") or "accelerate"
        cmd = [
            acc,
            "launch",
            "--config_file",
            str(self.cfg),
            "--main_process_port",
            str(free_port()),
            "train/train.py",
            *train_args,
            "--run-dir",
            str(d / "run"),
        ]
        return run_until_first_step(cmd, env, (d, "run/metrics.jsonl"))


def bench_launch(tmp: Path, reps: int, warmup: int) -> dict:
    L = Launcher(tmp / "launch")
    args = ["--preset", "tiny", "--data", "synthetic", "--max-steps", "1"]
    out = interleave(
        {
            "orchestrator submit": lambda: L.submit(args)[0],
            "accelerate launch": lambda: L.accelerate(args)[0],
        },
        reps,
        warmup,
    )
    return {n: {"median_s": round(med(v), 3), "all_s": [round(x, 3) for x in v]} for n, v in out.items()}


def bench_hot(tmp: Path, reps: int, steps: int, skip: int) -> dict:
    L = Launcher(tmp / "hot")
    args = ["--preset", "tiny", "--data", "synthetic", "--max-steps", str(steps), "--log-every", "1000"]
    out = interleave(
        {
            "orchestrator submit": lambda: step_stats(L.submit(args)[1], skip),
            "accelerate launch": lambda: step_stats(L.accelerate(args)[1], skip),
        },
        reps,
        0,
    )
    res = {}
    for n, v in out.items():
        sps = [r["steps_per_s"] for r in v]
        res[n] = {
            "median_steps_per_s": round(med(sps), 3),
            "all_steps_per_s": [round(x, 3) for x in sps],
            "median_step_time_s": round(med([r["median_step_time_s"] for r in v]), 5),
            "steps_per_run": steps,
            "excluded_first_steps": skip,
        }
    return res


# ---------------------------------------------------------------------------
# 4. Checkpoints


def raw_write_fsync(path: Path, nbytes: int, chunk: int = 8 << 20) -> float:
    buf = os.urandom(min(chunk, max(1, nbytes)))
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(len(buf), left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    wall = time.perf_counter() - t
    path.unlink()
    return wall


def ckpt_run(L: Launcher, preset: str, steps: int, every: int, async_: bool) -> dict:
    args = [
        "--preset",
        preset,
        "--data",
        "synthetic",
        "--max-steps",
        str(steps),
        "--ckpt-every",
        str(every),
        "--keep-last",
        "10",
        "--log-every",
        "1000",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
    ]
    if async_:
        args.append("--async-ckpt")
    d = L.tmp / f"r{L.n + 1}"
    env = dict(BASE_ENV, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    acc = shutil.which("accelerate") or "accelerate"
    d.mkdir()
    L.n += 1
    cmd = [
        acc,
        "launch",
        "--config_file",
        str(L.cfg),
        "--main_process_port",
        str(free_port()),
        "train/train.py",
        *args,
        "--run-dir",
        str(d / "run"),
    ]
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"ckpt run failed: {res.stderr[-3000:]}")
    run = d / "run"
    saves = [float(m.group(1)) for m in re.finditer(r"saved in ([\d.]+)s", res.stdout)]
    async_done = [float(m.group(1)) for m in re.finditer(r"complete \(async, ([\d.]+)s\)", res.stdout)]
    markers = sorted((run / "checkpoints").glob("step_*/COMPLETE.json"))
    sizes = [sum(json.loads(m.read_text())["files"].values()) for m in markers]
    ev = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    # Gap between consecutive train events, minus the later step's own time = time outside steps.
    outside = {
        ev[i]["step"]: ev[i + 1]["time"] - ev[i]["time"] - ev[i + 1]["step_time_s"]
        for i in range(len(ev) - 1)
    }
    ck = [s for s in outside if s % every == 0]
    other = [v for s, v in outside.items() if s % every and s > 1]
    stalls = [outside[s] - med(other) for s in ck]
    return {
        "save_s": saves,
        "async_complete_s": async_done,
        "bytes": sizes,
        "stall_s": stalls,
        "median_step_time_s": med([e["step_time_s"] for e in ev[1:]]),
    }


def bench_ckpt(tmp: Path, reps: int, preset: str, steps: int, every: int) -> dict:
    L = Launcher(tmp / "ckpt", strategy="full_shard", extra=("--wrap-cls", "TransformerBlock"))
    sync_runs: list[dict] = []
    async_runs: list[dict] = []
    raw: list[float] = []
    for r in range(reps):
        pair = [("sync", False), ("async", True)]
        for name, a in pair if r % 2 == 0 else pair[::-1]:
            (sync_runs if name == "sync" else async_runs).append(ckpt_run(L, preset, steps, every, a))
        nbytes = int(med([b for run in sync_runs for b in run["bytes"]]))
        raw.append(raw_write_fsync(L.tmp / "raw.bin", nbytes))
    nbytes = int(med([b for run in sync_runs for b in run["bytes"]]))
    save_s = med([s for run in sync_runs for s in run["save_s"]])
    raw_s = med(raw)
    return {
        "preset": preset,
        "strategy": "full_shard (FSDP2, SHARDED_STATE_DICT, wrap TransformerBlock), 2 ranks",
        "steps": steps,
        "ckpt_every": every,
        "checkpoint_bytes": nbytes,
        "sync_save_median_s": round(save_s, 4),
        "sync_save_all_s": [round(s, 4) for run in sync_runs for s in run["save_s"]],
        "save_throughput_MBps": round(nbytes / save_s / 1e6, 1),
        "raw_write_fsync_median_s": round(raw_s, 4),
        "raw_write_fsync_all_s": [round(x, 4) for x in raw],
        "raw_throughput_MBps": round(nbytes / raw_s / 1e6, 1),
        "sync_stall_median_s": round(med([s for run in sync_runs for s in run["stall_s"]]), 4),
        "async_stall_median_s": round(med([s for run in async_runs for s in run["stall_s"]]), 4),
        "async_complete_median_s": round(med([s for run in async_runs for s in run["async_complete_s"]]), 4),
        "median_step_time_s": round(med([run["median_step_time_s"] for run in sync_runs + async_runs]), 4),
    }


# ---------------------------------------------------------------------------
# Report


def fmt(x: float, unit: str = "s", nd: int = 3) -> str:
    return f"{x:.{nd}f} {unit}".strip()


def report(R: dict, quick: bool, wall: float) -> str:
    from bench_ckpt_load import goal_rows as ckpt_base_goals
    from bench_memory import goal_rows as mem_goals
    from bench_memory import table as mem_table

    cli = R.get("cli", {})
    floor = cli.get("python -c pass", {}).get("median_s")
    acc_help = cli.get("accelerate --help", {}).get("median_s")
    R["goals"] = goals = []
    for n, v in cli.items():
        if "orchestrator" not in n:
            continue
        speedup = acc_help / v["median_s"]
        met = v["median_s"] < 0.15 and speedup >= 8
        goals.append(
            {
                "item": n,
                "goal": "< 0.15 s and >= 8x faster than accelerate --help",
                "measured": f"{v['median_s']:.3f} s (accelerate --help {acc_help:.3f} s; floor python -c pass {floor:.3f} s)",
                "ratio": f"{speedup:.1f}x faster",
                "met": met,
            }
        )
    if "status10k" in R:
        from bench_status_scale import goal_rows as status_scale_goals

        goals += status_scale_goals(R["status10k"])
    if "launch" in R:
        a, b = R["launch"]["orchestrator submit"]["median_s"], R["launch"]["accelerate launch"]["median_s"]
        goals.append(
            {
                "item": "launch to first step (submit vs accelerate launch)",
                "goal": "<= 1.15x",
                "measured": f"{a:.2f} s vs {b:.2f} s",
                "ratio": f"{a / b:.3f}x",
                "met": a / b <= 1.15,
            }
        )
    if "hot" in R:
        a, b = (
            R["hot"]["orchestrator submit"]["median_steps_per_s"],
            R["hot"]["accelerate launch"]["median_steps_per_s"],
        )
        goals.append(
            {
                "item": "hot path steps/s (submit vs accelerate launch)",
                "goal": ">= 0.98x",
                "measured": f"{a:.2f} vs {b:.2f} steps/s",
                "ratio": f"{a / b:.3f}x",
                "met": a / b >= 0.98,
            }
        )
    if "ckpt" in R:
        c = R["ckpt"]
        goals.append(
            {
                "item": f"sharded save ({c['preset']}, {c['checkpoint_bytes'] / 1e6:.1f} MB) vs raw write+fsync",
                "goal": "report (throughput vs disk)",
                "measured": f"{c['sync_save_median_s']:.3f} s = {c['save_throughput_MBps']} MB/s vs raw {c['raw_write_fsync_median_s']:.3f} s = {c['raw_throughput_MBps']} MB/s",
                "ratio": f"{c['save_throughput_MBps'] / c['raw_throughput_MBps']:.2f}x of disk",
                "met": None,
            }
        )
        goals.append(
            {
                "item": "async save stall vs sync save stall",
                "goal": "async stall < sync stall",
                "measured": f"{c['async_stall_median_s']:.3f} s vs {c['sync_stall_median_s']:.3f} s (async completes in {c['async_complete_median_s']:.3f} s)",
                "ratio": f"{c['async_stall_median_s'] / c['sync_stall_median_s']:.2f}x"
                if c["sync_stall_median_s"] > 0
                else "n/a",
                "met": c["async_stall_median_s"] < c["sync_stall_median_s"],
            }
        )
    if "ckpt_base" in R:
        goals += ckpt_base_goals(R["ckpt_base"])
    if "mem" in R:
        goals += mem_goals(R["mem"])
    if "requeue" in R:
        for setting, q, mode in _requeue_results(R["requeue"]):
            label = f"requeue round trip, requeue_as: {mode} (USR2 -> first resumed step, Slurm test cluster {setting})"
            if q.get("skipped") or not q.get("round_trip_median_s"):
                goals.append(
                    {
                        "item": label,
                        "goal": "<= 30 s",
                        "measured": f"not measured: {q.get('skipped') or q.get('error')}",
                        "ratio": "n/a",
                        "met": None,
                    }
                )
                continue
            ph = q["phases_median_s"]
            goals.append(
                {
                    "item": f"{label}, {q['reps']} reps",
                    "goal": "<= 30 s",
                    "measured": f"{q['round_trip_median_s']:.1f} s (range {min(q['round_trip_all_s']):.1f}-"
                    f"{max(q['round_trip_all_s']):.1f}; "
                    + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in ph.items() if v is not None)
                    + f"; pending reasons {', '.join(q.get('pending_reasons') or ['-'])})",
                    "ratio": f"{q['round_trip_median_s'] / 30:.2f}x of goal",
                    "met": q["round_trip_median_s"] <= 30,
                }
            )
    if "startup" in R:
        from bench_startup import goal_rows as startup_goals

        goals += startup_goals(R["startup"])
    if "nodes" in R:
        from bench_nodes import goal_rows as nodes_goals

        goals += nodes_goals(R["nodes"])
    gpu = _gpu_results(R)
    if gpu is not None:
        from bench_gpu import goal_rows as gpu_goals

        goals += gpu_goals(gpu)
    elif "gpu" in R:
        goals.append(
            {
                "item": "GPU (NCCL) launch / hot path / memory / checkpoints",
                "goal": "as the CPU items",
                "measured": R["gpu"]["measured"],
                "ratio": "n/a",
                "met": None,
            }
        )
    runs = R.get("runs", {})
    when = "; ".join(
        f"{k}: {v['when']}{' --quick' if v.get('quick') else ''} {v['wall_s']:.0f} s" for k, v in runs.items()
    )
    older = [k for k in ITEMS if k in R and k not in runs]
    if older:
        when += (
            ("; " if when else "") + ", ".join(older) + ": an earlier --quick run (before per-item records)"
        )
    lines = [
        "# orchestrator benchmarks",
        "",
        f"`{R.get('invocation') or 'python bench/run.py' + (' --quick' if quick else '')}` on {R['machine']['cpus']} CPUs, Python {R['machine']['python']}, "
        f"torch {R['machine']['torch']}, accelerate {R['machine']['accelerate']}; last invocation {wall:.0f} s. "
        "Baseline and candidate interleaved in one invocation; medians; the machine is shared (other load).",
        "",
        f"Items (when run, wall): {when}." if when else "",
        "",
        "| item | goal | measured (median) | ratio | met? |",
        "|---|---|---|---|---|",
    ]
    for g in goals:
        met = "n/a" if g["met"] is None else ("yes" if g["met"] else "**no**")
        lines.append(f"| {g['item']} | {g['goal']} | {g['measured']} | {g['ratio']} | {met} |")
    lines += ["", "## Notes", ""]
    if cli:
        lines.append(
            f"- Interpreter floor: `python -c pass` = {floor:.3f} s median here; `python -m orchestrator ...` "
            f"adds at least the `-m` package resolution on top. Any CLI goal below ~{floor:.2f} s + the "
            "command's own imports is unreachable on this machine regardless of the code."
        )
        for n, v in cli.items():
            if "top_imports" in v:
                tops = ", ".join(f"{t['module']} {t['cumulative_ms']} ms" for t in v["top_imports"][:4])
                lines.append(
                    f"- `{n}`: {v['median_s']:.3f} s (min {v['min_s']:.3f}); heaviest imports: {tops}"
                )
    for note in R.get("notes", []):
        lines.append(f"- {note}")
    if "mem" in R:
        m = R["mem"]
        lines += [
            "",
            f"## Memory per rank (2 ranks, fp32 on CPU, AdamW; {m['steps']} steps of {m['batch_size']} x {m['seq_len']} tokens)",
            "",
            "Formulas restated for fp32 on CPU (params 4Ψ, grads 4Ψ, Adam m+v 8Ψ bytes; the issue's 16Ψ / 2Ψ + 14Ψ/N / "
            "16Ψ/N are for Adam in mixed precision). Model state = bytes of the local shards of params + grads + "
            "optimizer state on a rank after the last optimizer.step (DTensor.to_local() for FSDP2); in-step = that "
            "plus the all-gathered parameters FSDP keeps between forward and backward; peak RSS − baseline = VmHWM "
            "over the steps (reset after prepare) minus RSS before the model was built (MALLOC_MMAP_THRESHOLD_=65536). "
            "Worst rank shown.",
            "",
        ]
        lines += mem_table(m)
    requeue_runs = [(s, q, m) for s, q, m in _requeue_results(R.get("requeue", {})) if q.get("records")]
    if requeue_runs:
        lines += [
            "",
            "## Requeue round trip (seconds per phase; see bench_requeue.py for the timestamps used)",
            "",
            "| cluster | requeue_as | rep | round trip | checkpoint | exit | scheduler requeue | start-up | load | first step | start-up split | pending reasons |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for setting, q, mode in requeue_runs:
        for i, r in enumerate(q["records"], 1):
            ph = r["phases_s"]
            split = ", ".join(f"{k} {v}" for k, v in (r.get("startup_split_s") or {}).items())
            lines.append(
                f"| {setting} | {mode} | {i} | {r['round_trip_s']} | "
                + " | ".join(
                    str(ph[k])
                    for k in ("checkpoint", "exit", "scheduler_requeue", "startup", "load", "first_step")
                )
                + f" | {split} | {', '.join(r.get('pending_reasons', []))} |"
            )
    if gpu is not None:
        from bench_gpu import table as gpu_table

        lines += [
            "",
            "## GPU (`gpu`, bench/bench_gpu.py; one process on one GPU through `accelerate launch`)",
            "",
        ]
        lines += gpu_table(gpu)
    lines.append("")
    lines.append(
        "Raw figures (all repetitions): `bench/results.json`"
        + (", GPU: `bench/results_gpu.json`." if gpu is not None else ".")
    )
    return "\n".join(lines) + "\n"


ITEMS = [
    "cli",
    "status10k",
    "launch",
    "hot",
    "ckpt",
    "ckpt_base",
    "mem",
    "requeue",
    "startup",
    "nodes",
    "gpu",
]


def _requeue_results(q: dict) -> list[tuple[str, dict, str]]:
    """(cluster setting, result, requeue_as) per measured run; results of before the profile key
    (one run, no setting: the test cluster's cred_expire=10, scontrol requeue) read as such."""
    if "records" in q or "skipped" in q or "round_trip_median_s" in q:
        return [("cred_expire=10", q, "same_job")]
    return [
        (setting, r, mode)
        for setting, by_mode in sorted(q.items())
        if isinstance(by_mode, dict)
        for mode, r in by_mode.items()
    ]


def _gpu_results(R: dict) -> dict | None:
    """bench/results_gpu.json when the ``gpu`` item points at it (its figures are not copied into results.json)."""
    if not R.get("gpu", {}).get("source"):
        return None
    from bench_gpu import load as load_gpu

    return load_gpu(REPO / R["gpu"]["source"])


def gpu_row() -> dict:
    """With CUDA: run bench/bench_gpu.py (rewrites bench/results_gpu.json). Either way: the figures of that file."""
    import torch
    from bench_gpu import RESULTS, device_line
    from bench_gpu import load as load_gpu

    cuda = torch.cuda.is_available()
    if cuda:
        log("gpu: bench/bench_gpu.py (CUDA available)")
        res = subprocess.run([PY, str(BENCH / "bench_gpu.py")], cwd=REPO, env=BASE_ENV, timeout=3600)
        if res.returncode != 0:
            return {"measured": f"bench/bench_gpu.py failed (exit {res.returncode})", "cuda": True}
    G = load_gpu(RESULTS)
    if G is None:
        why = (
            "no GPU lent (torch.cuda.is_available() is False)"
            if not cuda
            else "bench/bench_gpu.py wrote no results"
        )
        return {"measured": f"not measured: {why}", "cuda": cuda}
    return {
        "measured": f"bench/results_gpu.json: {device_line(G)}"
        + ("" if cuda else " (not re-measured here: no GPU)"),
        "cuda": cuda,
        "source": str(RESULTS.relative_to(REPO)),
        "when": G["when"],
        "device": G["device"].get("device_name"),
    }


def _sections(md: str) -> list[tuple[str, str]]:
    """``(header line, text)`` per ``## `` section; the part before the first one has header ""."""
    parts = ("\n" + md).split("\n## ")
    out = [("", parts[0].lstrip("\n"))]
    out += [(p.split("\n", 1)[0], "## " + p) for p in parts[1:]]
    return out


def _label(row: str) -> str:
    """A goal row's item, without a trailing ``, N reps`` (the same item measured again)."""
    return re.sub(r", \d+ (reps|interleaved pairs)$", "", row.split("|")[1].strip())


def keep_foreign(new: str, old: str) -> str:
    """``new`` (this invocation's report) plus what the previous results.md had that this script does
    not write: goal rows added by other benches (their item not among ``new``'s) and whole sections
    pasted from their scripts (dashboard, export, goodput, chaos). Without it ``--only ITEM`` dropped
    them, and only git had them back."""
    new_parts, old_parts = _sections(new), _sections(old)
    headers = {h for h, _ in new_parts}
    head = new_parts[0][1].rstrip("\n").split("\n")
    labels = {_label(line) for line in head if line.startswith("| ") and not line.startswith("| item")}
    foreign_rows = [
        line
        for line in old_parts[0][1].split("\n")
        if line.startswith("| ") and not line.startswith(("| item", "|---")) and _label(line) not in labels
    ]
    if foreign_rows:
        last = max(i for i, line in enumerate(head) if line.startswith("| "))
        head[last + 1 : last + 1] = foreign_rows
    body = [text.rstrip("\n") for _, text in new_parts[1:]]
    body += [text.rstrip("\n") for h, text in old_parts[1:] if h not in headers]
    return "\n\n".join(["\n".join(head), *body]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (whole bench in ~6 minutes)")
    ap.add_argument(
        "--only",
        nargs="*",
        choices=ITEMS,
        default=None,
        help="run these items and merge them into the existing results of --out",
    )
    ap.add_argument("--out", default=str(BENCH), help="folder for results.md / results.json")
    ap.add_argument(
        "--hot-reps",
        type=int,
        default=None,
        metavar="N",
        help="repetitions of the hot-path pair (default 3, 1 with --quick): its spread needs more",
    )
    a = ap.parse_args()
    q = a.quick
    parts = a.only or ITEMS
    import accelerate
    import torch

    out = Path(a.out)
    R: dict = {}
    if a.only and (out / "results.json").exists():
        R = json.loads((out / "results.json").read_text())  # merge: keep the other items' figures
        R.pop("goals", None)
    R.update(
        {
            "quick": q,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "accelerate": accelerate.__version__,
                "platform": platform.platform(),
            },
        }
    )
    R.setdefault("notes", [])
    R["invocation"] = (
        "python bench/run.py" + (" --quick" if q else "") + (" --only " + " ".join(a.only) if a.only else "")
    )
    runs = R.setdefault("runs", {})
    t0 = time.perf_counter()

    def item(name: str, fn: Callable[[], object]) -> None:
        log(name)
        t = time.perf_counter()
        result = fn()
        if isinstance(result, dict) and result.get("skipped") and name in R and not R[name].get("skipped"):
            # Could not be measured now (no cluster): keep the figures measured before.
            log(f"{name}: {result['skipped']}; keeping the earlier figures")
            return
        R[name] = result
        runs[name] = {
            "when": time.strftime("%Y-%m-%d %H:%M"),
            "quick": q,
            "wall_s": round(time.perf_counter() - t, 1),
        }

    with tempfile.TemporaryDirectory(prefix="orch_bench_") as tmp_s:
        tmp = Path(tmp_s)
        if "cli" in parts:
            item("cli", lambda: bench_cli(tmp / "cli", reps=5 if q else 10, warmup=1, jobs=1000))
        if "status10k" in parts:
            from bench_status_scale import bench_status_scale

            item("status10k", lambda: bench_status_scale(tmp / "status10k", reps=3 if q else 7, log=log))
        if "launch" in parts:
            item("launch", lambda: bench_launch(tmp, reps=2 if q else 4, warmup=1 if not q else 0))
        if "hot" in parts:
            hot_reps = a.hot_reps or (1 if q else 3)
            item("hot", lambda: bench_hot(tmp, reps=hot_reps, steps=40 if q else 80, skip=5))
        if "ckpt" in parts:
            item(
                "ckpt",
                lambda: bench_ckpt(tmp, reps=1 if q else 2, preset="small", steps=4 if q else 6, every=2),
            )
        if "ckpt_base" in parts:
            from bench_ckpt_load import bench_ckpt_base

            item(
                "ckpt_base",
                lambda: bench_ckpt_base(
                    tmp / "ckpt_base",
                    1 if q else 2,
                    BASE_ENV,
                    free_port,
                    raw_write_fsync,
                    log,
                    full_load=not q,
                ),
            )
        if "mem" in parts:
            from bench_memory import bench_memory

            # --quick: the base preset only (the small one adds nothing the formulas do not already say).
            item(
                "mem",
                lambda: bench_memory(
                    tmp / "mem", BASE_ENV, ["base"] if q else ["small", "base"], 2, free_port, log
                ),
            )
        if "startup" in parts:
            from bench_startup import bench_startup

            item("startup", lambda: bench_startup(tmp / "startup", 2 if q else 5, log))
        if "nodes" in parts:
            from bench_nodes import bench_nodes

            item("nodes", lambda: bench_nodes(tmp / "nodes", 2 if q else 3, log, out / "launch_vs_nodes.png"))
        if "requeue" in parts:
            from bench_requeue import bench_requeue

            def requeue_both() -> dict:
                # Both ways back (profile key requeue_as) under both AuthInfo settings: the cluster
                # that is up first (tests/cluster/start_cluster.sh CRED_EXPIRE keys the figures), then
                # the same cluster restarted with the other one, then back. Where it cannot be
                # restarted, the other setting's earlier rows are kept.
                from bench_requeue import restart_cluster_with

                first = os.environ.get("ORCHESTRATOR_TEST_CLUSTER_CRED_EXPIRE", "10")
                # BENCH_REQUEUE_AS=auto: only the default (the profile key's values, comma-separated)
                modes = os.environ.get("BENCH_REQUEUE_AS", "same_job,new_job,auto").split(",")
                kept = {k: v for k, v in R.get("requeue", {}).items() if k.startswith("cred_expire=")}
                out: dict = {}
                for i, setting in enumerate([first, "default" if first != "default" else "10"]):
                    if i and (why := restart_cluster_with(setting)):
                        log(f"requeue: not measured at cred_expire={setting}: {why}")
                        break
                    got = {
                        mode: bench_requeue(
                            tmp / f"requeue_{setting}_{mode}", 2 if q else 3, log, requeue_as=mode
                        )
                        for mode in modes
                    }
                    if any(g.get("skipped") for g in got.values()):
                        if not out:
                            return next(g for g in got.values() if g.get("skipped"))
                        break
                    # a run of some modes keeps the other modes' earlier rows for this setting
                    out[f"cred_expire={setting}"] = {**kept.get(f"cred_expire={setting}", {}), **got}
                if len(out) > 1 and (why := restart_cluster_with(first)):
                    log(f"requeue: could not restore cred_expire={first}: {why}")
                return {**kept, **out}

            item("requeue", requeue_both)
        if "gpu" in parts:
            item("gpu", gpu_row)
    wall = time.perf_counter() - t0
    R["wall_s"] = round(wall, 1)
    md = report(R, q, wall)
    # Written by hand from bench/gpu_submit_check.py's device runs (a GPU lease, not this script's).
    gpu_submit = BENCH / "results_gpu_submit.md"
    if gpu_submit.is_file():
        md = md.rstrip("\n") + "\n\n" + gpu_submit.read_text()
    if (out / "results.md").is_file():
        md = keep_foreign(md, (out / "results.md").read_text())
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(R, indent=1) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
