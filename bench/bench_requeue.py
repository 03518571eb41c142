"""Requeue round trip on the Slurm test cluster: preemption signal -> first resumed step, broken down.

One job (``orchestrator submit --profile slurm_test --strategy full_shard --nodes 2 --procs-per-node 1
-- train/train.py --preset tiny --data synthetic ...``, its own ORCHESTRATOR_HOME/RUNS under /tmp)
is preempted ``reps`` times with ``scancel --signal=USR2`` once the current attempt is training. For
each preemption, from timestamps the run directory already has plus squeue polled every 0.2 s:

=================  =====================================================================================
phase              from -> to
=================  =====================================================================================
checkpoint         signal sent (bench clock) -> checkpoint marker written (COMPLETE.json ``time``)
exit               marker -> job leaves RUNNING (workers exit, node entry waits for the record, node 0
                   runs ``scontrol requeue``)
scheduler requeue  job leaves RUNNING -> RUNNING again (squeue; PENDING with reason BeginTime while the
                   old job credential expires: ``cred_expire`` in the test cluster's slurm.conf)
start-up           RUNNING again -> checkpoint load begins (``resume`` event time - ``loaded.json``
                   load_s); split at the launcher start (mtime of ``logs/attempt_N/node_0.pid``): sbatch
                   script + node entry; then, from the glog stamps of torch's first c10d lines in
                   node_0.log: accelerate launch imports until its TCPStore is up; worker start-up
                   (imports) until worker 0's process group connects; then Accelerator, self-check,
                   model build and prepare until the load begins
load               load begins -> ``resume`` event (load_s + restored-state checksums)
first step         ``resume`` event -> first ``train`` event of the new attempt (the step's own time)
=================  =====================================================================================

The phases telescope: their sum is the round trip (signal -> first resumed step). ``sacct -D``
(Start/End/Eligible per attempt, 1 s resolution) is kept alongside as a cross-check.

Reuses the helpers of soak_preemption.py (metrics events, job state, wait, submit).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak_preemption as soak  # noqa: E402

from orchestrator.rundir.summary import iter_metrics  # noqa: E402

PHASES = ("checkpoint", "exit", "scheduler_requeue", "startup", "load", "first_step")


def cluster_up() -> str | None:
    """None when the Slurm test cluster answers, else why not."""
    if not os.environ.get("SLURM_CONF"):
        return "SLURM_CONF not set (source /tmp/orchestrator-slurm/cluster.env)"
    try:
        res = soak.run("scontrol", "ping", timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol ping: {exc}"
    if res.returncode != 0 or "UP" not in res.stdout:
        return f"scontrol ping: {res.stdout.strip()} {res.stderr.strip()}"
    return None


def restart_cluster_with(cred_expire: str) -> str | None:
    """Restart the running test cluster with another ``AuthInfo cred_expire`` (start_cluster.sh
    restarts it when slurm.conf changes; same nodes, mode and state folder) and load its new env
    file, so one invocation measures the requeue under both settings. None when done, else why not.
    Only for the cluster run_with_cluster.sh started (it holds the cluster's lock for us)."""
    base = os.environ.get("ORCHESTRATOR_TEST_CLUSTER_BASE")
    if not base:
        return "no ORCHESTRATOR_TEST_CLUSTER_BASE (not under tests/cluster/run_with_cluster.sh)"
    env = dict(
        os.environ,
        BASE=base,
        CRED_EXPIRE=cred_expire,
        NODES=os.environ.get("ORCHESTRATOR_TEST_CLUSTER_NODES", "3"),
        MODE=os.environ.get("ORCHESTRATOR_TEST_CLUSTER_MODE", "auto"),
        ACCOUNTING=os.environ.get("ORCHESTRATOR_TEST_CLUSTER_ACCOUNTING", "1"),
    )
    script = Path(__file__).resolve().parent.parent / "tests" / "cluster" / "start_cluster.sh"
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        return f"start_cluster.sh CRED_EXPIRE={cred_expire} failed: {res.stderr[-1000:]}"
    for line in (Path(base) / "cluster.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#"):
            os.environ[key] = value
    return cluster_up()


class StatePoller(threading.Thread):
    """squeue (every job: the test cluster runs only the bench's) every ``interval`` s; records
    (time, job, state, reason) on every change, so a successor job (``requeue_as: new_job``) is
    followed from its submission on."""

    def __init__(self, interval: float = 0.2):
        super().__init__(daemon=True)
        self.interval = interval
        self.changes: list[tuple[float, str, str, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        last: dict[str, tuple[str, str]] = {}
        while not self.stop.is_set():
            t = time.time()
            res = soak.run("squeue", "-h", "-o", "%i|%T|%r", timeout=15)
            seen = set()
            for line in res.stdout.splitlines():
                job, _, rest = line.strip().partition("|")
                state, _, reason = rest.partition("|")
                seen.add(job)
                if job and state and last.get(job) != (state, reason):
                    self.changes.append((t, job, state, reason))
                    last[job] = (state, reason)
            for job in set(last) - seen if res.returncode == 0 else ():
                # squeue lists pending, running and completing jobs only: an ended job just vanishes.
                if last[job][0] != "GONE":
                    self.changes.append((t, job, "GONE", ""))
                    last[job] = ("GONE", "")
            self.stop.wait(self.interval)

    def first(self, after: float, job: str, pred: Callable[[str], bool]) -> float | None:
        for t, j, s, _ in self.changes:
            if t >= after and j == job and pred(s):
                return t
        return None


def train_events_since_last_resume(run_dir: Path) -> list[dict]:
    out: list[dict] = []
    for e in list(iter_metrics(run_dir)):
        if e.get("event") == "resume":
            out = []
        elif e.get("event") == "train":
            out.append(e)
    return out


def sacct_attempts(job_id: str) -> list[dict]:
    res = soak.run(
        "sacct", "-D", "-X", "-P", "-n", "-j", job_id, "-o", "State,Submit,Eligible,Start,End", timeout=30
    )
    rows = []
    for line in res.stdout.splitlines():
        f = line.split("|")
        if len(f) == 5:
            rows.append(dict(zip(("state", "submit", "eligible", "start", "end"), f)))
    return rows


GLOG = re.compile(r"^(\[default0\]:)?\[W(\d\d)(\d\d) (\d\d):(\d\d):(\d\d(?:\.\d+)?)")


def c10d_stamps(node_log: Path) -> dict:
    """Times of the first c10d log lines of the launcher (its TCPStore is up) and of worker 0 (its
    process group connects), from the glog-style ``[WMMDD HH:MM:SS.us ...]`` prefix torch prints;
    local time, this year. Empty where the log has none (they are warnings that may go away)."""
    out: dict = {}
    try:
        lines = node_log.read_text(errors="replace").splitlines()
    except OSError:
        return out
    year = time.localtime().tm_year
    for line in lines:
        m = GLOG.match(line)
        if not m:
            continue
        key = "worker_pg" if m.group(1) else "launcher_store"
        if key in out:
            continue
        sec = float(m.group(6))
        t = time.mktime(
            (year, int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), int(sec), 0, 0, -1)
        )
        out[key] = t + (sec - int(sec))
    return out


def one_preemption(job_id: str, run_dir: Path, poller: StatePoller, timeout: float = 300) -> dict:
    # The current attempt trains (>= 3 steps since its start/resume).
    if not soak.wait(
        lambda: len(train_events_since_last_resume(run_dir)) >= 3, timeout=timeout, interval=0.2
    ):
        raise RuntimeError("the attempt never started training")
    resumes_before = sum(1 for e in list(iter_metrics(run_dir)) if e.get("event") == "resume")
    attempts_before = {p.name for p in (run_dir / "logs").glob("attempt_*")}
    t_signal = time.time()
    soak.run("scancel", "--signal=USR2", job_id, timeout=30)

    def exit_record() -> dict[str, Any] | None:
        try:
            d = json.loads((run_dir / "exit_status.json").read_text())
        except (OSError, ValueError):
            return None
        return d if d.get("code") == 75 and float(d.get("time", 0)) >= t_signal else None

    rec: dict = {"t_signal": t_signal}
    ex = soak.wait(exit_record, timeout=120, interval=0.05)
    if not ex:
        raise RuntimeError("no requeue exit record (exit_status.json code 75) after the signal")
    rec["exit_status_time"] = ex["time"]
    rec["checkpoint_step"] = int(ex["step"])
    marker = json.loads((run_dir / "checkpoints" / f"step_{ex['step']:08d}" / "COMPLETE.json").read_text())
    rec["marker_time"] = float(marker["time"])
    rec["checkpoint_bytes"] = sum(marker["files"].values())

    def resumed() -> tuple[dict[str, Any], dict[str, Any]] | None:
        evs = list(iter_metrics(run_dir))
        res = [e for e in evs if e.get("event") == "resume"][resumes_before:]
        if not res:
            return None
        after = []
        seen = False
        for e in evs:
            if e is res[0]:
                seen = True
            elif seen and e.get("event") == "train":
                after.append(e)
        return (res[0], after[0]) if after else None

    got = soak.wait(resumed, timeout=timeout, interval=0.1)
    if not got:
        raise RuntimeError("no resumed step within the timeout")
    resume, first = got
    loaded = json.loads((run_dir / "loaded.json").read_text())
    new_attempts = sorted(
        set(p.name for p in (run_dir / "logs").glob("attempt_*")) - attempts_before,
        key=lambda n: int(n.split("_")[1]),
    )
    pid_file = run_dir / "logs" / new_attempts[-1] / "node_0.pid" if new_attempts else None
    rec.update(
        attempt=new_attempts[-1] if new_attempts else None,
        resume_time=float(resume["time"]),
        load_s=float(loaded["load_s"]),
        resumed_step=int(resume["step"]),
        first_step_time=float(first["time"]),
        first_step_s=float(first["step_time_s"]),
        launcher_start_time=pid_file.stat().st_mtime if pid_file and pid_file.exists() else None,
    )
    # The job that trains now: the same one (requeued) or its successor (requeue_as: new_job).
    successor = (run_dir / "job_id").read_text().strip()
    rec["job"], rec["successor"] = job_id, successor
    rec["left_running"] = poller.first(rec["marker_time"], job_id, lambda s: s != "RUNNING")
    rec["running_again"] = poller.first(rec["left_running"] or t_signal, successor, lambda s: s == "RUNNING")
    rec["states"] = [(round(t - t_signal, 2), j, s, r) for t, j, s, r in poller.changes if t >= t_signal - 1]
    # Why the job waited while PENDING (BeginTime = the requeue hold; Dependency = a successor waiting
    # for its predecessor to end; Resources/Priority = other jobs).
    rec["pending_reasons"] = sorted(
        {
            r
            for t, j, s, r in poller.changes
            if s == "PENDING"
            and j == successor
            and rec["left_running"]
            and t >= rec["left_running"]
            and (rec["running_again"] is None or t <= rec["running_again"])
        }
    )
    load_begin = rec["resume_time"] - rec["load_s"]
    ph = {
        "checkpoint": rec["marker_time"] - t_signal,
        "exit": (rec["left_running"] - rec["marker_time"]) if rec["left_running"] else None,
        "scheduler_requeue": (rec["running_again"] - rec["left_running"])
        if rec["running_again"] and rec["left_running"]
        else None,
        "startup": (load_begin - rec["running_again"]) if rec["running_again"] else None,
        "load": rec["resume_time"] - load_begin,
        "first_step": rec["first_step_time"] - rec["resume_time"],
    }
    rec["phases_s"] = {k: (round(v, 2) if v is not None else None) for k, v in ph.items()}
    if rec["launcher_start_time"] and rec["running_again"]:
        split = {"job_start_to_launcher": rec["launcher_start_time"] - rec["running_again"]}
        assert pid_file is not None  # launcher_start_time is only set from it
        stamps = c10d_stamps(pid_file.parent / "node_0.log")
        if "launcher_store" in stamps and "worker_pg" in stamps:
            split.update(
                launcher_to_store=stamps["launcher_store"] - rec["launcher_start_time"],
                store_to_worker_pg=stamps["worker_pg"] - stamps["launcher_store"],
                worker_pg_to_load=load_begin - stamps["worker_pg"],
            )
        else:
            split["launcher_to_load"] = load_begin - rec["launcher_start_time"]
        rec["startup_split_s"] = {k: round(v, 2) for k, v in split.items()}
    rec["round_trip_s"] = round(rec["first_step_time"] - t_signal, 2)
    return rec


def last_attempt_logs(run_dir: Path, lines: int = 20) -> dict:
    """The tails of the newest attempt's node logs and the exit record (the run dir is temporary)."""
    out: dict = {}
    attempts = sorted((run_dir / "logs").glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if attempts:
        for log_file in sorted(attempts[-1].glob("node_*.log")):
            text = log_file.read_text(errors="replace").splitlines()
            out[f"{attempts[-1].name}/{log_file.name}"] = [line[:300] for line in text[-lines:]]
    for name in ("exit_status.json", "local_state.json"):
        try:
            out[name] = (run_dir / name).read_text()[:2000]
        except OSError:
            pass
    return out


def bench_requeue(
    tmp: Path, reps: int, log: Callable[[str], None] = print, requeue_as: str = "same_job"
) -> dict:
    """``requeue_as``: the profile key (``same_job``: scontrol requeue; ``new_job``: a successor)."""
    why = cluster_up()
    if why:
        return {"skipped": f"Slurm test cluster not reachable: {why}"}
    tmp.mkdir(parents=True, exist_ok=True)
    profiles = tmp / "profiles"
    profiles.mkdir(exist_ok=True)
    base_profile = (soak.REPO / "cluster_profiles" / "slurm_test.yaml").read_text()
    (profiles / "slurm_test.yaml").write_text(base_profile + f"requeue_as: {requeue_as}\n")
    env = dict(os.environ, ORCHESTRATOR_HOME=str(tmp / "home"), ORCHESTRATOR_RUNS=str(tmp / "runs"))
    env["PYTHONPATH"] = str(soak.REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ORCHESTRATOR_RUN_DIR", None)
    train_args = [
        "--preset",
        "tiny",
        "--data",
        "synthetic",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--log-every",
        "1",
        "--max-steps",
        "100000",
        "--ckpt-every",
        "100000",
        "--keep-last",
        "2",
    ]
    res = soak.cli(
        env,
        "submit",
        "--profile",
        "slurm_test",
        "--profiles-dir",
        str(profiles),
        "--strategy",
        "full_shard",
        "--nodes",
        "2",
        "--procs-per-node",
        "1",
        "--max-requeues",
        str(reps + 1),
        "--",
        soak.TRAIN,
        *train_args,
    )
    if res.returncode != 0:
        raise RuntimeError(f"submit failed: {res.stdout}{res.stderr}")
    job_id = res.stdout.split("submitted job ")[1].split()[0]
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    log(f"requeue ({requeue_as}): job {job_id}, {run_dir}")
    poller = StatePoller()
    poller.start()
    records, error, error_logs = [], None, {}
    first_job = job_id
    try:
        for i in range(reps):
            rec = one_preemption(job_id, run_dir, poller)
            job_id = rec["successor"]
            log(
                f"requeue {i + 1}/{reps}: round trip {rec['round_trip_s']} s; "
                + ", ".join(f"{k} {v}" for k, v in rec["phases_s"].items())
            )
            records.append(rec)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        log(f"requeue: error {error}")
        error_logs = last_attempt_logs(run_dir)
    finally:
        poller.stop.set()
        poller.join(timeout=5)
        attempts = sacct_attempts(first_job) + (sacct_attempts(job_id) if job_id != first_job else [])
        # `orchestrator cancel` leaves the marker node 0 checks: a plain scancel sends SIGTERM, which
        # training handles like a preemption, and the job may be requeued once more.
        soak.cli(env, "cancel", job_id, timeout=60)
    med = {}
    for k in PHASES:
        vals = [r["phases_s"][k] for r in records if r["phases_s"].get(k) is not None]
        med[k] = round(statistics.median(vals), 2) if vals else None
    trips = [r["round_trip_s"] for r in records]
    splits = [r["startup_split_s"] for r in records if "startup_split_s" in r]
    return {
        "requeue_as": requeue_as,
        "cred_expire": os.environ.get("ORCHESTRATOR_TEST_CLUSTER_CRED_EXPIRE", "10"),
        "job": {
            "profile": "slurm_test",
            "strategy": "full_shard",
            "nodes": 2,
            "procs_per_node": 1,
            "train_args": train_args,
        },
        "reps": len(records),
        "error": error,
        "error_logs": error_logs,
        "round_trip_median_s": round(statistics.median(trips), 2) if trips else None,
        "round_trip_all_s": trips,
        "phases_median_s": med,
        "startup_split_median_s": {
            k: round(statistics.median([s[k] for s in splits if k in s]), 2) for k in splits[0]
        }
        if splits
        else None,
        "pending_reasons": sorted({x for r in records for x in r.get("pending_reasons", [])}),
        "sacct_attempts": attempts,
        "records": records,
    }
