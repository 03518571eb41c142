"""``orchestrator ui``'s server time over a 10,000-job registry and a 100,000-event run
(``python bench/bench_ui.py [--reps N]``).

Goals (issue 30): the jobs page over 10,000 jobs <= 0.5 s of server time; a run page's chart over
100,000 metric events <= 0.5 s (downsampled on the server).

The registry is made like bench_status_scale's ``history_10k``: 1,000 RUNNING jobs (answered by a
fake ``squeue``, a real subprocess) and 9,000 that COMPLETED a week ago, each with a run directory of
50 steps (bench_status.make_run_dir). One more job's run has 100,000 train events. The dashboard runs
as its own process (``orchestrator ui --port 0``); each figure is the wall time of one HTTP GET on
loopback (request, server work, JSON encoding, transfer). Baselines, same invocation, interleaved:
``orchestrator status --json`` over the same registry (the CLI's 1,000 active rows), and reading the
100,000 events the way ``plot`` did before the follower (one ``json.loads`` per line).

Concurrent jobs pages (issue 41): ``--concurrent N`` (default 100) clients each open a connection and
GET ``/api/jobs`` at once (released together by a barrier); the figure is the wall time until the last
answer, and the server's peak RSS (``VmHWM``) minus its RSS before the first burst. The same bursts go,
interleaved, to a second server over the same registry running the code of ``--before REF`` (default
f364cc5, the dashboard before issue 41), extracted with ``git archive``; ``--only-concurrent`` skips
the other cases.

Cold chart: the run's metrics.jsonl is replaced by a copy (a new inode) before the request, so the
server reads all 100,000 events again. Warm: 100 events were appended since the previous poll.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

WEEK_S = 7 * 86400.0
CHART_EVENTS = 100_000


def build(tmp: Path) -> tuple[dict[str, str], str, Path]:
    from bench_status import make_run_dir, write_script

    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import Registry

    runs, home, bin_dir = tmp / "runs", tmp / "home", tmp / "bin"
    bin_dir.mkdir(parents=True)
    ids = [str(7_000_000 + i) for i in range(10_000)]
    running = set(ids[9000:])
    for j in ids:
        make_run_dir(runs / j, 50)
    big = runs / "big"
    make_run_dir(big, 10)
    write_events(big / "metrics.jsonl", CHART_EVENTS)
    now = time.time()
    with Registry.open(home) as reg:
        for i, j in enumerate([*ids, "8000000"]):
            live = j in running or j == "8000000"
            reg.add_job(
                job_id=j,
                name=f"sweep-{i}",
                profile="slurm_a100",
                scheduler="slurm",
                strategy="fsdp2",
                nodes=2,
                procs_per_node=4,
                command=["python", "train.py", f"--seed={i}"],
                run_dir=big if j == "8000000" else runs / j,
                state=JobState.RUNNING if live else JobState.COMPLETED,
                submitted_at=now - (60.0 if live else WEEK_S),
            )
            reg.add_attempt(j, attempt=0, scheduler_job_id=j, started_at=now - (50.0 if live else WEEK_S))
    listing = tmp / "squeue_out.txt"
    listing.write_text(
        "".join(f"{j}|RUNNING|None|n[1-2]|2025-01-01T00:00:00|1:00:00\n" for j in [*running, "8000000"])
    )
    write_script(bin_dir / "squeue", f"cat {listing}\n")
    write_script(bin_dir / "sacct", "exit 0\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), ORCHESTRATOR_HOME=str(home))
    env.pop("ORCHESTRATOR_RUN_DIR", None)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env, "8000000", big


def write_events(path: Path, n: int, start: int = 1) -> None:
    t = time.time() - n
    with open(path, "w" if start == 1 else "a") as fh:
        for s in range(start, start + n):
            fh.write(
                json.dumps(
                    {
                        "event": "train",
                        "step": s,
                        "loss": 3.0 / (1 + s / 100),
                        "lr": 3e-4,
                        "grad_norm": 1.1,
                        "tokens_per_s": 51234.5,
                        "step_time_s": 0.5,
                        "world_size": 8,
                        "strategy": "fsdp2",
                        "time": t + s,
                    }
                )
                + "\n"
            )


def get(port: int, path: str) -> tuple[float, dict[str, Any]]:
    t = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("GET", path)
    res = conn.getresponse()
    body = res.read()
    wall = time.perf_counter() - t
    conn.close()
    if res.status != 200:
        raise RuntimeError(f"GET {path}: {res.status} {body[:500]!r}")
    return wall, json.loads(body)


def per_line_read(run_dir: Path) -> int:
    """The baseline: every line parsed on its own (iter_metrics, plot's reader before the follower)."""
    from orchestrator.rundir.summary import iter_metrics

    return sum(1 for _ in iter_metrics(run_dir))


def start_ui(env: dict[str, str], code: Path = REPO) -> tuple[subprocess.Popen[str], int]:
    """``orchestrator ui --port 0`` from the sources in ``code``; the process and its port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "ui", "--port", "0"],
        env=dict(env, PYTHONPATH=str(code)),
        cwd=code,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    m = re.search(r":(\d+)/", proc.stdout.readline())
    assert m, "no address from orchestrator ui"
    return proc, int(m.group(1))


def rss_kb(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak) of a process, in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def burst(port: int, clients: int, resets: list[int]) -> float:
    """``clients`` GETs of /api/jobs released together; the wall time until the last answer. A
    connection the server resets (its listen backlog overflowed) is tried again, as a browser does,
    and counted in ``resets[0]``."""
    gate = threading.Barrier(clients + 1)
    errors: list[str] = []

    def one() -> None:
        gate.wait()
        for _ in range(20):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            try:
                conn.request("GET", "/api/jobs")
                res = conn.getresponse()
                body = res.read()
                break
            except (ConnectionResetError, BrokenPipeError):
                resets[0] += 1
            finally:
                conn.close()
        else:
            errors.append("reset 20 times")
            return
        if res.status != 200 or len(json.loads(body)["jobs"]) != 100:
            errors.append(f"{res.status} {body[:200]!r}")

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {clients} answers failed, e.g. {errors[0]}")
    return wall


def measure_concurrent(
    env: dict[str, str], before: Path, clients: int, reps: int
) -> dict[str, dict[str, Any]]:
    """The same bursts against this tree's server and the ``before`` one, interleaved."""
    servers = {"now": start_ui(env), "before": start_ui(env, before)}
    try:
        base = {}
        for name, (proc, port) in servers.items():
            get(port, "/api/jobs")  # imports and the first read done before the baseline RSS
            base[name] = rss_kb(proc.pid, "VmRSS")
        walls: dict[str, list[float]] = {n: [] for n in servers}
        resets = {n: [0] for n in servers}
        for r in range(reps):
            for name in ("now", "before") if r % 2 == 0 else ("before", "now"):
                walls[name].append(burst(servers[name][1], clients, resets[name]))
                print(f"{name}: burst {r + 1}: {walls[name][-1]:.2f} s", flush=True)
        grown = {n: (rss_kb(proc.pid, "VmHWM") - base[n]) / 1024 for n, (proc, _) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    label = {
        "now": f"{clients} concurrent /api/jobs, 10,001 jobs (this tree)",
        "before": f"{clients} concurrent /api/jobs, 10,001 jobs (before)",
    }
    return {
        label[n]: {
            "median_s": round(statistics.median(w), 4),
            "min_s": round(min(w), 4),
            "max_s": round(max(w), 4),
            "note": f"; peak RSS growth {grown[n]:.0f} MB; {resets[n][0]} connections reset and tried again",
            "peak_rss_growth_mb": round(grown[n], 1),
            "resets": resets[n][0],
        }
        for n, w in walls.items()
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=7)
    p.add_argument(
        "--concurrent", type=int, default=100, metavar="N", help="clients of a burst (default 100)"
    )
    p.add_argument("--concurrent-reps", type=int, default=3)
    p.add_argument("--before", default="f364cc5", metavar="REF", help="the code to compare the bursts with")
    p.add_argument("--only-concurrent", action="store_true")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_ui_"))
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    try:
        before = tmp / "before"
        before.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.before, "orchestrator"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        env, big_id, big = build(tmp)
        print(f"built 10,001 jobs in {time.perf_counter() - started:.1f} s", flush=True)
        if not args.only_concurrent:
            proc, port = start_ui(env)
            try:
                results.update(measure(port, env, big_id, big, args.reps))
            finally:
                proc.terminate()
                proc.wait(30)
        results.update(measure_concurrent(env, before, args.concurrent, args.concurrent_reps))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, r in results.items():
        print(
            f"{name}: median {r['median_s']:.3f} s (range {r['min_s']:.3f}-{r['max_s']:.3f}){r.get('note', '')}"
        )
    print(json.dumps(results))
    return 0


def measure(port: int, env: dict[str, str], big_id: str, big: Path, reps: int) -> dict[str, dict[str, Any]]:
    status_cmd = [sys.executable, "-m", "orchestrator", "status", "--json"]
    notes: dict[str, str] = {}
    step = [CHART_EVENTS + 1]

    def jobs_page() -> float:
        wall, data = get(port, "/api/jobs")
        assert data["total"] == 10_001 and len(data["jobs"]) == 100
        notes["jobs page (/api/jobs), 10,001 jobs"] = f"; {len(data['jobs'])} rows of {data['total']}"
        return wall

    def jobs_filtered() -> float:
        wall, data = get(port, "/api/jobs?state=COMPLETED&q=sweep-4")
        assert data["jobs"] and all(j["name"].startswith("sweep-4") for j in data["jobs"])
        return wall

    def status_cli() -> float:
        t = time.perf_counter()
        subprocess.run(status_cmd, env=env, stdout=subprocess.DEVNULL, check=True, timeout=300)
        return time.perf_counter() - t

    def chart_cold() -> float:
        copy = big / "metrics.copy"
        shutil.copyfile(big / "metrics.jsonl", copy)
        os.replace(copy, big / "metrics.jsonl")  # a new inode: the server reads every event again
        wall, data = get(port, f"/api/job/{big_id}/chart")
        loss = data["curves"]["loss"]
        assert loss["points"] >= CHART_EVENTS and len(loss["x"]) <= 2000
        notes["run chart, cold (100,000 events read)"] = (
            f"; {loss['points']:,} steps -> {len(loss['x'])} points sent"
        )
        return wall

    def chart_warm() -> float:
        write_events(big / "metrics.jsonl", 100, start=step[0])
        step[0] += 100
        wall, data = get(port, f"/api/job/{big_id}/chart")
        assert data["curves"]["loss"]["points"] == step[0] - 1
        return wall

    def job_page_warm() -> float:
        return get(port, f"/api/job/{big_id}")[0]

    def baseline_read() -> float:
        t = time.perf_counter()
        per_line_read(big)
        return time.perf_counter() - t

    cases = {
        "jobs page (/api/jobs), 10,001 jobs": jobs_page,
        "jobs page filtered (?state=COMPLETED&q=sweep-4)": jobs_filtered,
        "baseline: orchestrator status --json (CLI, 1,001 active rows)": status_cli,
        "run chart, cold (100,000 events read)": chart_cold,
        "run chart, warm (100 new events since the last poll)": chart_warm,
        "job page (/api/job/ID: row, attempts, chart), warm": job_page_warm,
        "baseline: 100,000 events parsed line by line (plot's reader before)": baseline_read,
    }
    for fn in cases.values():  # warm-up
        fn()
    walls: dict[str, list[float]] = {n: [] for n in cases}
    names = list(cases)
    for r in range(reps):
        for n in names if r % 2 == 0 else names[::-1]:
            walls[n].append(cases[n]())
    return {
        n: {
            "median_s": round(statistics.median(w), 4),
            "min_s": round(min(w), 4),
            "max_s": round(max(w), 4),
            "note": notes.get(n, ""),
        }
        for n, w in walls.items()
    }


if __name__ == "__main__":
    sys.exit(main())
