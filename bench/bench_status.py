"""Benchmark ``orchestrator status --json`` over 1,000 registered jobs.

Scenarios (each timed as a fresh CLI process, median of several runs; ``status`` keeps run
summaries in ``$ORCHESTRATOR_HOME/status_cache.json``, so the second and later runs over unchanged
run directories are cheaper: ``*_cold_cache`` removes that file before every run):

* ``scheduler_down``: the real ``squeue``/``sacct`` on PATH with no reachable controller (or, where
  Slurm is not installed, scripts that fail like it): every state comes from the registry, stale.
* ``squeue_answers_all``: an ``squeue`` script that prints a RUNNING line for each of the 1,000 ids
  (a real subprocess with realistic output size), so the fresh path -- parse, record, summarise -- is
  what is timed.

Each run dir holds job.json, a metrics.jsonl of a few thousand events and two checkpoints, so the
per-job run-directory cost is included. Also timed: ``summarize`` on one 100 MB metrics.jsonl
(tail read) against a full JSON parse of the same file, which is what status avoids.

Wrapper scripts count scheduler calls; the result must be 1 squeue (+ at most 1 sacct) per status.
Usage: ``python bench/bench_status.py [--runs 5] [--jobs 1000]``; writes bench/results_status.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.contract.job_states import JobState  # noqa: E402
from orchestrator.registry.store import Registry  # noqa: E402
from orchestrator.rundir.summary import summarize  # noqa: E402


def make_run_dir(run_dir: Path, steps: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(
        json.dumps({"strategy": "fsdp2", "nodes": 2, "procs_per_node": 4, "max_steps": 10000})
    )
    t = time.time() - steps
    lines = []
    for s in range(1, steps + 1):
        lines.append(
            json.dumps(
                {
                    "event": "train",
                    "step": s,
                    "max_steps": 10000,
                    "loss": 3.0 / (1 + s / 100),
                    "lr": 3e-4,
                    "grad_norm": 1.1,
                    "tokens_per_s": 51234.5,
                    "step_time_s": 0.5,
                    "peak_mem_mb": 12000.0,
                    "world_size": 8,
                    "strategy": "fsdp2",
                    "time": t + s,
                }
            )
        )
        if s % 500 == 0:
            lines.append(
                json.dumps({"event": "eval", "step": s, "val_loss": 3.1 / (1 + s / 100), "time": t + s})
            )
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for step in (steps // 2, steps):
        d = run_dir / "checkpoints" / f"step_{step:08d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.distcp").write_bytes(b"\0" * 4096)
        (d / "COMPLETE.json").write_text(
            json.dumps({"step": step, "world_size": 8, "strategy": "fsdp2", "files": {"model.distcp": 4096}})
        )
    (run_dir / "logs" / "attempt_0").mkdir(parents=True, exist_ok=True)


def write_script(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def time_status(env: dict[str, str], counter: Path, runs: int, cold: bool = False) -> dict[str, object]:
    """``cold``: remove the run-summary cache (``$ORCHESTRATOR_HOME/status_cache.json``) before each
    run, so every run directory is read; otherwise unchanged run directories come from it."""
    walls = []
    calls_per_run = []
    last: dict[str, object] = {}
    for _ in range(runs):
        if cold:
            (Path(env["ORCHESTRATOR_HOME"]) / "status_cache.json").unlink(missing_ok=True)
        counter.write_text("")
        t = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-m", "orchestrator", "status", "--json"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        walls.append(time.perf_counter() - t)
        if res.returncode != 0:
            raise SystemExit(f"status failed: {res.stderr}")
        last = json.loads(res.stdout)
        names = [ln.split()[0] for ln in counter.read_text().splitlines() if ln.strip()]
        calls_per_run.append({"squeue": names.count("squeue"), "sacct": names.count("sacct")})
    jobs = last["jobs"]
    assert isinstance(jobs, list)
    return {
        "runs": runs,
        "median_s": round(statistics.median(walls), 4),
        "min_s": round(min(walls), 4),
        "max_s": round(max(walls), 4),
        "all_s": [round(w, 4) for w in walls],
        "scheduler_calls_per_run": calls_per_run,
        "jobs_reported": len(jobs),
        "stale": last["stale"],
        "source": last["source"],
    }


def bench_big_metrics(tmp: Path, runs: int) -> dict[str, object]:
    rd = tmp / "big"
    rd.mkdir()
    line = json.dumps(
        {
            "event": "train",
            "step": 0,
            "max_steps": 10**7,
            "loss": 2.5,
            "lr": 3e-4,
            "grad_norm": 1.0,
            "tokens_per_s": 50000.0,
            "step_time_s": 0.5,
            "peak_mem_mb": 1.0,
            "world_size": 8,
            "strategy": "fsdp2",
            "time": 0.0,
        }
    )
    n = (100 * 1024 * 1024) // (len(line) + 1) + 1
    with open(rd / "metrics.jsonl", "w") as fh:
        for s in range(n):
            fh.write(
                line.replace('"step": 0', f'"step": {s}', 1).replace('"time": 0.0', f'"time": {s * 0.5}')
                + "\n"
            )
    size = (rd / "metrics.jsonl").stat().st_size
    summarize(rd)  # first call also does the one-off resume byte scan (cached per inode)
    tail_times = []
    for _ in range(runs * 4):
        t = time.perf_counter()
        summary = summarize(rd)
        tail_times.append(time.perf_counter() - t)
    assert summary.step == n - 1
    t = time.perf_counter()
    with open(rd / "metrics.jsonl", "rb") as fh:
        parsed = sum(1 for raw in fh if json.loads(raw))
    full = time.perf_counter() - t
    return {
        "file_mb": round(size / 2**20, 1),
        "events": parsed,
        "summarize_median_s": round(statistics.median(tail_times), 5),
        "full_json_parse_s": round(full, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=2000, help="train events per run dir")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results_status.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_status_") as tmp_s:
        tmp = Path(tmp_s)
        home, runs_root, bin_dir = tmp / "home", tmp / "runs", tmp / "bin"
        bin_dir.mkdir()
        ids = [str(8_000_000 + i) for i in range(args.jobs)]
        t = time.perf_counter()
        with Registry.open(home) as reg:
            for i, job_id in enumerate(ids):
                rd = runs_root / job_id
                make_run_dir(rd, args.steps)
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
        setup_s = time.perf_counter() - t

        counter = tmp / "calls.log"
        env = dict(os.environ, ORCHESTRATOR_HOME=str(home), PYTHONPATH=str(REPO))
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        results: dict[str, object] = {}

        real_squeue, real_sacct = shutil.which("squeue"), shutil.which("sacct")
        for name, real in (("squeue", real_squeue), ("sacct", real_sacct)):
            tail = (
                f'exec {real} "$@"\n' if real else "echo 'Unable to contact slurm controller' >&2; exit 1\n"
            )
            write_script(bin_dir / name, f"echo {name} >> {counter}\n" + tail)
        results["scheduler_down"] = time_status(env, counter, args.runs)

        listing = tmp / "squeue_out.txt"
        listing.write_text(
            "".join(
                f"{j}|RUNNING|None|n[{i % 64}-{i % 64 + 1}]|2025-01-01T00:00:00|1:00:00\n"
                for i, j in enumerate(ids)
            )
        )
        write_script(bin_dir / "squeue", f"echo squeue >> {counter}\ncat {listing}\n")
        write_script(bin_dir / "sacct", f"echo sacct >> {counter}\nexit 0\n")
        results["squeue_answers_all"] = time_status(env, counter, args.runs)
        results["squeue_answers_all_cold_cache"] = time_status(env, counter, args.runs, cold=True)

        results["summarize_100mb_metrics"] = bench_big_metrics(tmp, args.runs)

    report = {
        "benchmark": "orchestrator status --json over a registry of N jobs",
        "jobs": args.jobs,
        "train_events_per_run": args.steps,
        "setup_s": round(setup_s, 2),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "slurm_client": real_squeue or "absent",
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
