"""``status`` and ``list`` over a registry of 10,000 jobs (``python bench/run.py --only status10k``).

Registries (one set of run directories, made like bench_status.make_run_dir, shared by all):

* ``active_1k``: 1,000 RUNNING jobs, every one answered by a fake ``squeue`` (a real subprocess
  printing 1,000 lines) -- what ``status`` over 1,000 jobs measured before;
* ``history_10k``: the same 1,000 RUNNING jobs plus 9,000 that COMPLETED a week ago: a user's
  registry after months of sweeps. ``status`` shows the 1,000 active ones; the 9,000 finished ones
  must cost nothing per call (the difference to ``active_1k``, in callgrind instructions);
* ``recent_10k``: the 1,000 RUNNING plus 9,000 COMPLETED two hours ago: all 10,000 are shown;
  finished jobs recorded over FINAL_AFTER_S ago are not asked about again (``sacct`` calls: 0);
* ``running_10k``: 10,000 RUNNING jobs, all answered by squeue (10,000 rows, 10,000 run dirs).

Commands are timed as fresh CLI processes, interleaved with ``python -c pass`` (the interpreter
floor), medians. Callgrind counts instructions of the Python process (not its squeue child), which
load on the machine does not change.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WEEK_S, TWO_HOURS_S = 7 * 86400.0, 2 * 3600.0


def build(tmp: Path, log: Callable[[str], None]) -> dict[str, dict[str, str]]:
    """The four registries; returns ``{name: env}``."""
    from bench_status import make_run_dir, write_script

    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import Registry

    runs = tmp / "runs"
    ids = [str(7_000_000 + i) for i in range(10_000)]
    t = time.perf_counter()
    for j in ids:
        make_run_dir(runs / j, 50)
    log(f"status10k: 10,000 run dirs in {time.perf_counter() - t:.1f} s")
    now = time.time()
    # (jobs, which are running, when the others finished)
    layouts: dict[str, tuple[list[str], set[str], float]] = {
        "active_1k": (ids[9000:], set(ids[9000:]), 0.0),
        "history_10k": (ids, set(ids[9000:]), WEEK_S),
        "recent_10k": (ids, set(ids[9000:]), TWO_HOURS_S),
        "running_10k": (ids, set(ids), 0.0),
    }
    envs: dict[str, dict[str, str]] = {}
    for name, (jobs, running, ago) in layouts.items():
        d = tmp / name
        home, bin_dir = d / "home", d / "bin"
        bin_dir.mkdir(parents=True)
        with Registry.open(home) as reg:
            for i, j in enumerate(jobs):
                live = j in running
                reg.add_job(
                    job_id=j,
                    name=f"sweep-{i}",
                    profile="slurm_a100",
                    scheduler="slurm",
                    strategy="fsdp2",
                    nodes=2,
                    procs_per_node=4,
                    command=["python", "train.py", f"--seed={i}"],
                    run_dir=runs / j,
                    state=JobState.RUNNING if live else JobState.COMPLETED,
                    submitted_at=now - (60.0 if live else ago),
                )
                # Every real job has attempts (one per start): status must not pay for old jobs' ones.
                reg.add_attempt(j, attempt=0, scheduler_job_id=j, started_at=now - (50.0 if live else ago))
        listing = d / "squeue_out.txt"
        listing.write_text(
            "".join(f"{j}|RUNNING|None|n[1-2]|2025-01-01T00:00:00|1:00:00\n" for j in jobs if j in running)
        )
        calls = d / "calls.log"
        # squeue logs how many ids it was asked about; sacct answers nothing (any finished job asked
        # about would fall back to the registry, stale -- and show up in the call count).
        write_script(
            bin_dir / "squeue",
            f"echo \"squeue $(echo \"$3\" | tr ',' '\\n' | wc -l)\" >> {calls}\ncat {listing}\n",
        )
        write_script(bin_dir / "sacct", f"echo sacct >> {calls}\nexit 0\n")
        env = dict(os.environ, PYTHONPATH=str(REPO), ORCHESTRATOR_HOME=str(home))
        env.pop("ORCHESTRATOR_RUN_DIR", None)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # .pyc files, as a user has them: no compile per call
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        env["BENCH_CALLS"] = str(calls)
        envs[name] = env
    log(f"status10k: registries built ({time.perf_counter() - t:.1f} s in all)")
    return envs


def _run(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    res = subprocess.run(
        cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300
    )
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.decode()[-2000:]}")
    return wall


def instructions(cmd: list[str], env: dict[str, str]) -> int | None:
    """Instructions the Python process executes (callgrind, children not traced); None without valgrind."""
    vg = shutil.which("valgrind")
    if vg is None:
        return None
    res = subprocess.run(
        [vg, "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=900,
    )
    m = re.search(r"Collected\s*:\s*(\d+)", res.stderr)
    return int(m.group(1)) if m and res.returncode == 0 else None


def bench_status_scale(
    tmp: Path, reps: int, log: Callable[[str], None], callgrind: bool = True
) -> dict[str, Any]:
    envs = build(tmp, log)
    py = sys.executable
    status = [py, "-m", "orchestrator", "status", "--json"]
    cases: dict[str, tuple[list[str], str]] = {
        "python -c pass": ([py, "-c", "pass"], "active_1k"),
        "status --json, 1,000 active": (status, "active_1k"),
        "status --json, 10,000 (1,000 active + 9,000 finished last week)": (status, "history_10k"),
        "status (table), 10,000 (1,000 active + 9,000 finished last week)": (status[:-1], "history_10k"),
        "list --state RUNNING --json, 10,000": (
            [py, "-m", "orchestrator", "list", "--state", "RUNNING", "--json"],
            "history_10k",
        ),
        "list --since 1d, 10,000": ([py, "-m", "orchestrator", "list", "--since", "1d"], "history_10k"),
        "status --json, 10,000 shown (1,000 active + 9,000 finished 2 h ago)": (status, "recent_10k"),
        "status --json, 10,000 running": (status, "running_10k"),
    }
    for cmd, reg in cases.values():  # warm-up: page cache, summary caches, .pyc
        _run(cmd, envs[reg])
        _run(cmd, envs[reg])
    names = list(cases)
    walls: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            cmd, reg = cases[n]
            walls[n].append(_run(cmd, envs[reg]))
    out: dict[str, Any] = {}
    for n in names:
        cmd, reg = cases[n]
        calls = Path(envs[reg]["BENCH_CALLS"])
        calls.write_text("")
        _run(cmd, envs[reg])
        sched = calls.read_text().split()
        out[n] = {
            "registry": reg,
            "median_s": round(statistics.median(walls[n]), 4),
            "min_s": round(min(walls[n]), 4),
            "max_s": round(max(walls[n]), 4),
            "all_s": [round(w, 4) for w in walls[n]],
            "squeue_calls": sched.count("squeue"),
            "squeue_ids": sum(int(sched[i + 1]) for i, w in enumerate(sched) if w == "squeue"),
            "sacct_calls": sched.count("sacct"),
        }
    if callgrind:
        for n in names:
            if "10,000 running" in n or "10,000 shown" in n:
                continue  # minutes under valgrind; the wall time says enough
            cmd, reg = cases[n]
            out[n]["instructions"] = instructions(cmd, envs[reg])
            log(f"status10k: callgrind {n}: {out[n]['instructions']}")
    return out


def goal_rows(S: dict[str, Any]) -> list[dict[str, Any]]:
    floor = S["python -c pass"]["median_s"]
    one_k = S["status --json, 1,000 active"]
    hist = S["status --json, 10,000 (1,000 active + 9,000 finished last week)"]
    rows = []
    ins_1k, ins_10k = one_k.get("instructions"), hist.get("instructions")
    per_finished = (
        f"; callgrind {ins_10k / 1e6:.0f}M vs {ins_1k / 1e6:.0f}M instructions for the 1,000 alone: "
        f"{(ins_10k - ins_1k) / 9000:,.0f} per finished job ({(ins_10k - ins_1k) / ins_1k * 100:+.1f}%)"
        if ins_1k and ins_10k
        else ""
    )
    for n, v in S.items():
        if n == "python -c pass":
            continue
        goal_met = v["median_s"] <= 0.15
        shown_all = "10,000 running" in n or "10,000 shown" in n
        sched = (
            f"squeue {v['squeue_calls']}x ({v['squeue_ids']} ids), sacct {v['sacct_calls']}x"
            if "status" in n
            else "no scheduler call"
        )
        rows.append(
            {
                "item": f"{n} (registry `{v['registry']}`, bench_status_scale.py)",
                "goal": "report (every row printed)"
                if shown_all
                else "<= 0.15 s, one scheduler query, finished jobs cost nothing",
                "measured": f"{v['median_s']:.3f} s (range {v['min_s']:.3f}-{v['max_s']:.3f}; floor python -c pass {floor:.3f} s); {sched}"
                + (per_finished if v is hist else "")
                + (
                    f"; {v['instructions'] / 1e6:.0f}M instructions"
                    if v.get("instructions") and v is not hist
                    else ""
                ),
                "ratio": f"{v['median_s'] / 0.15:.2f}x of 0.15 s",
                "met": None
                if shown_all
                else (goal_met and ("status" not in n or (v["squeue_calls"] == 1 and v["sacct_calls"] == 0))),
            }
        )
    return rows
