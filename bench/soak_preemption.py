"""Soak: randomly timed preemptions and hard kills on the real Slurm test cluster (tests/cluster).

Two runs go on side by side (2 nodes x 1 process each, ``full_shard`` and ``ddp``, checkpoints every
5 steps). Each gets a shuffled series of events at random moments while it trains:

* ``usr2``: ``scancel --signal=USR2`` (preemption notice): the job checkpoints, exits 75, node 0
  requeues it;
* ``requeue``: ``scontrol requeue`` (SIGTERM, then Slurm requeues);
* ``kill``: SIGKILL of the training processes of one node at a random moment, and ``kill_in_save``:
  the same while a checkpoint is being written (a ``.tmp-step_*`` folder exists): the job FAILS, and
  ``orchestrator resume`` starts a new attempt.

After each event, once the next attempt has logged its ``resume`` event, the bench checks against
the checkpoint folders and their COMPLETE.json markers:

* the checkpoint resumed from verifies (marker present, every file its recorded size), never a
  ``.tmp-*`` folder or a marker-less one (torn);
* it is the newest checkpoint that was complete when the attempt started (marker time before the
  resume event): no completed checkpoint was skipped or lost;
* every checkpoint complete before the event still verifies, unless ``--keep-last`` pruned it
  after newer ones were saved;
* steps recomputed (logged before the event, beyond the resumed step): 0 for usr2/requeue (training
  saves where it stops), at most the checkpoint interval for kills;
* a step computed twice has the same loss both times (the resume is exact).

Measured: round trip (event -> first step of the resumed attempt), failure detection (kill ->
FAILED), steps recomputed, torn checkpoints met. Usage (cluster running)::

    set -a; . /tmp/orchestrator-slurm/cluster.env; set +a
    python bench/soak_preemption.py [--events 12] [--seed 1] [--budget 450]

Writes ``bench/results_soak.json``; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
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

from orchestrator.contract.run_dir import verify_checkpoint  # noqa: E402
from orchestrator.rundir.summary import iter_metrics  # noqa: E402

TRAIN = str(REPO / "train" / "train.py")
CKPT_EVERY = 5
KEEP_LAST = 3
MAX_STEPS = 200
TINY = [
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
    str(MAX_STEPS),
    "--ckpt-every",
    str(CKPT_EVERY),
    "--keep-last",
    str(KEEP_LAST),
]
ACTIONS = ("usr2", "requeue", "kill", "kill_in_save")
LOCK = threading.Lock()


def log(line: str) -> None:
    with LOCK:
        print(f"[soak {time.strftime('%H:%M:%S')}] {line}", flush=True)


def run(
    *argv: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env, check=False)


def cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, "-m", "orchestrator", *args, timeout=timeout, env=env)


# ------------------------------------------------------------------------------------ run directory
def checkpoint_listing(run_dir: Path) -> dict[str, Any]:
    """Complete checkpoints {step: marker time} and torn ones (tmp folders, marker-less/short files)."""
    complete: dict[int, float] = {}
    torn: list[str] = []
    root = run_dir / "checkpoints"
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return {"complete": complete, "torn": torn}
    for entry in entries:
        if entry.name.startswith(".tmp"):
            torn.append(entry.name)
            continue
        if not entry.name.startswith("step_"):
            continue
        info = verify_checkpoint(entry)
        if info is None:
            torn.append(entry.name)
            continue
        try:
            marker = json.loads((entry / "COMPLETE.json").read_text())
        except (OSError, ValueError):
            torn.append(entry.name)
            continue
        complete[info.step] = float(marker.get("time", 0.0))
    return {"complete": complete, "torn": torn}


def training_pids(node: str, job_id: str) -> list[int]:
    """Training workers of one job on one node: processes in the node's network namespace whose
    environment says SLURM_JOB_ID=<job> and whose command line runs train.py."""
    out = run("ip", "netns", "pids", f"slurm-{node}", timeout=15).stdout
    pids = []
    for pid in map(int, out.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            f"SLURM_JOB_ID={job_id}".encode() in environ
            and any(c.endswith(b"train.py") for c in cmd)
            and b"-c" not in cmd
        ):
            pids.append(pid)
    return pids


def job_state(job_id: str) -> str:
    out = run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", timeout=15).stdout.split()
    if out:
        return out[0]
    rows = run("sacct", "-nXP", "-j", job_id, "-o", "State", timeout=15).stdout.split()
    return rows[-1] if rows else "UNKNOWN"


def job_nodes(job_id: str) -> list[str]:
    nodelist = run("squeue", "-h", "-j", job_id, "-o", "%N", timeout=15).stdout.strip()
    return run("scontrol", "show", "hostnames", nodelist, timeout=15).stdout.split() if nodelist else []


def wait(condition: Any, timeout: float, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    return None


# ------------------------------------------------------------------------------------ one run
class Soak(threading.Thread):
    def __init__(
        self,
        index: int,
        strategy: str,
        actions: list[str],
        rng: random.Random,
        env: dict[str, str],
        stop_events_at: float,
        deadline: float,
    ) -> None:
        super().__init__(name=f"soak-{index}", daemon=True)
        self.index, self.strategy, self.actions, self.rng, self.env = index, strategy, actions, rng, env
        self.stop_events_at, self.deadline = stop_events_at, deadline
        self.records: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {"strategy": strategy}
        self.job_ids: list[str] = []
        self.run_dir: Path | None = None
        self.error: str | None = None

    # -- helpers over this run's metrics
    def _resumes(self) -> list[dict[str, Any]]:
        assert self.run_dir is not None
        return [e for e in iter_metrics(self.run_dir) if e.get("event") == "resume"]

    def _steps_since_last_resume(self) -> list[dict[str, Any]]:
        assert self.run_dir is not None
        out: list[dict[str, Any]] = []
        for e in iter_metrics(self.run_dir):
            if e.get("event") == "resume":
                out = []
            elif e.get("event") == "train":
                out.append(e)
        return out

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # report, never hang the bench
            self.error = f"{type(exc).__name__}: {exc}"
            log(f"run {self.index}: error {self.error}")
        finally:
            for job_id in self.job_ids:
                if job_state(job_id) in ("RUNNING", "PENDING", "REQUEUED", "CONFIGURING"):
                    run("scancel", job_id, timeout=30)

    def _run(self) -> None:
        res = cli(
            self.env,
            "submit",
            "--profile",
            "slurm_test",
            "--strategy",
            self.strategy,
            "--nodes",
            "2",
            "--procs-per-node",
            "1",
            "--",
            TRAIN,
            *TINY,
        )
        if res.returncode != 0:
            raise RuntimeError(f"submit failed: {res.stdout}{res.stderr}")
        job_id = res.stdout.split("submitted job ")[1].split()[0]
        self.run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
        self.job_ids.append(job_id)
        self.summary["run_dir"] = str(self.run_dir)
        log(f"run {self.index} ({self.strategy}): job {job_id}, {self.run_dir.name}")
        for n, action in enumerate(self.actions):
            if time.monotonic() > self.stop_events_at:
                log(f"run {self.index}: time budget reached, {len(self.actions) - n} event(s) not done")
                break
            record = self._event(job_id, action)
            self.records.append(record)
            log(
                f"run {self.index} event {n} {action}: "
                + ", ".join(
                    f"{k}={record[k]}"
                    for k in ("round_trip_s", "detection_s", "resume_step", "recomputed", "ok")
                    if k in record
                )
            )
            if record.get("new_job_id"):
                job_id = record["new_job_id"]
                self.job_ids.append(job_id)
            if record.get("fatal"):
                return
        self._finish(job_id)

    def _event(self, job_id: str, action: str) -> dict[str, Any]:
        assert self.run_dir is not None
        rec: dict[str, Any] = {
            "run": self.index,
            "strategy": self.strategy,
            "action": action,
            "job_id": job_id,
        }
        # 1. The current attempt is training (>= 2 steps logged since its start/resume), steps remain.
        running = wait(
            lambda: self._steps_since_last_resume()[1:] and self._steps_since_last_resume(),
            timeout=max(30.0, self.deadline - time.monotonic()),
        )
        if not running:
            rec.update(ok=False, fatal=True, problem="the attempt never started training")
            return rec
        if running[-1]["step"] > MAX_STEPS - 30:
            rec.update(ok=True, fatal=True, skipped="too close to max steps for another event")
            return rec
        if action.startswith("kill") and not wait(lambda: checkpoint_listing(self.run_dir)["complete"], 90):
            rec.update(ok=False, fatal=True, problem="no complete checkpoint to resume from after a kill")
            return rec
        # 2. A random moment: a random number of steps into the attempt plus a sub-step jitter (counted in
        # steps, not seconds, so that a fast machine does not run out of steps before the events do);
        # kill_in_save then waits until a checkpoint is being written.
        target = self.rng.randint(2, 12)
        wait(lambda: len(self._steps_since_last_resume()) >= target, timeout=120, interval=0.05)
        delay = self.rng.uniform(0.0, 0.4)
        rec.update(steps_into_attempt=len(self._steps_since_last_resume()), jitter_s=round(delay, 2))
        time.sleep(delay)  # the random timing itself, not a synchronisation
        if job_state(job_id) != "RUNNING":
            rec.update(ok=True, fatal=True, skipped=f"job {job_state(job_id)} at the moment of the event")
            return rec
        victim, pids = "", []
        if action.startswith("kill"):  # found beforehand: the kill itself must be immediate
            nodes = job_nodes(job_id)
            victim = self.rng.choice(nodes) if nodes else "n1"
            pids = training_pids(victim, job_id)
        before = checkpoint_listing(self.run_dir)
        resumes_before = len(self._resumes())
        if action == "kill_in_save":
            root = self.run_dir / "checkpoints"
            caught = wait(
                lambda: any(p.name.startswith(".tmp-step_") for p in root.glob(".tmp-*")), 20, interval=0.01
            )
            rec["caught_in_save"] = bool(caught)
        t_event = time.time()
        # 3. Act.
        if action == "usr2":
            run("scancel", "--signal=USR2", job_id, timeout=30)
        elif action == "requeue":
            run("scontrol", "requeue", job_id, timeout=30)
        else:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            rec.update(victim=victim, killed_pids=len(pids))
            t0 = time.monotonic()
            state = wait(
                lambda: (s := job_state(job_id)) in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT") and s, 120
            )
            rec["detection_s"] = round(time.monotonic() - t0, 1)
            rec["state_after_kill"] = state
            if state != "FAILED":
                rec.update(ok=False, fatal=True, problem=f"job state {state} after the kill, expected FAILED")
                return rec
            res = cli(self.env, "resume", job_id)
            if res.returncode != 0:
                rec.update(ok=False, fatal=True, problem=f"resume failed: {res.stdout}{res.stderr}")
                return rec
            rec["new_job_id"] = res.stdout.split("submitted job ")[1].split()[0]
        # 4. The next attempt resumed: check it against the markers.
        resumed = wait(lambda: self._resumes()[resumes_before:], timeout=240)
        if not resumed:
            rec.update(ok=False, fatal=True, problem="no resume event within 240 s")
            return rec
        resume = resumed[0]
        # The previous attempt's last logged step: train events between the previous resume and this one.
        last_step_before = 0
        for e in iter_metrics(self.run_dir):
            if e.get("event") == "resume" and e.get("time") == resume["time"]:
                break
            if e.get("event") == "train":
                last_step_before = max(last_step_before, int(e["step"]))
        after = checkpoint_listing(self.run_dir)
        first_step = wait(lambda: self._steps_since_last_resume(), timeout=90, interval=0.1)
        if first_step:
            rec["round_trip_s"] = round(first_step[0]["time"] - t_event, 1)
        path = Path(resume["checkpoint"])
        info = verify_checkpoint(path)
        complete_then = {**before["complete"], **after["complete"]}
        eligible = [s for s, t in complete_then.items() if t < resume["time"]]
        newest = max(eligible, default=None)
        lost = [
            s
            for s in before["complete"]
            if s not in after["complete"] and sum(1 for x in after["complete"] if x > s) < KEEP_LAST
        ]
        recomputed = max(0, last_step_before - int(resume["step"]))
        rec.update(
            resume_step=int(resume["step"]),
            resume_checkpoint=path.name,
            newest_complete_at_resume=newest,
            last_step_before=last_step_before,
            recomputed=recomputed,
            torn_before=before["torn"],
            torn_at_resume=after["torn"],
            lost_complete=lost,
        )
        problems = []
        if info is None or path.name.startswith(".tmp") or info.step != int(resume["step"]):
            problems.append("resumed from a checkpoint that does not verify (torn)")
        if newest is not None and int(resume["step"]) != newest:
            problems.append(f"resumed from step {resume['step']}, newest complete was {newest}")
        if lost:
            problems.append(f"complete checkpoints lost: {lost}")
        limit = 0 if action in ("usr2", "requeue") else CKPT_EVERY + 1
        if recomputed > limit:
            problems.append(f"{recomputed} steps recomputed (limit {limit})")
        rec["ok"] = not problems
        if problems:
            rec["problems"] = problems
        return rec

    def _finish(self, job_id: str) -> None:
        assert self.run_dir is not None
        left = self.deadline - time.monotonic()
        done = wait(lambda: (self.run_dir / "final.json").exists(), timeout=max(5.0, left), interval=1.0)
        state = wait(
            lambda: (s := job_state(job_id)) not in ("RUNNING", "COMPLETING", "PENDING") and s, 60
        ) or job_state(job_id)
        self.summary.update(completed=bool(done), final_state=state)
        if not done:
            log(f"run {self.index}: not finished within the budget ({state}); cancelled")
            run("scancel", job_id, timeout=30)
        # Determinism of resume: a step computed in two attempts had the same loss both times.
        seen: dict[int, float] = {}
        mismatches = []
        repeated = 0
        for e in iter_metrics(self.run_dir):
            if e.get("event") != "train":
                continue
            step, loss = int(e["step"]), float(e["loss"])
            if step in seen:
                repeated += 1
                if abs(seen[step] - loss) > 1e-6 * max(1.0, abs(loss)):
                    mismatches.append({"step": step, "first": seen[step], "again": loss})
            seen[step] = loss
        final = {}
        try:
            final = json.loads((self.run_dir / "final.json").read_text())
        except (OSError, ValueError):
            pass
        self.summary.update(
            steps_recomputed_total=repeated,
            recomputed_loss_mismatches=mismatches,
            final_step=final.get("step"),
            attempts=len(list((self.run_dir / "logs").glob("attempt_*"))),
            job_ids=self.job_ids,
        )


# ------------------------------------------------------------------------------------ main
def describe(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "n": len(values),
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=12, help="events in all, split over the runs")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole soak")
    parser.add_argument("--out", default=str(REPO / "bench" / "results_soak.json"))
    args = parser.parse_args()
    if run("scontrol", "ping", timeout=20).returncode != 0:
        print(
            "the Slurm test cluster does not answer (start it: bash tests/cluster/start_cluster.sh)",
            file=sys.stderr,
        )
        return 2
    rng = random.Random(args.seed)
    started = time.monotonic()
    deadline = started + args.budget
    stop_events_at = deadline - 100.0
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    env = dict(os.environ, ORCHESTRATOR_HOME=str(work / "home"), ORCHESTRATOR_RUNS=str(work / "runs"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    counts = [args.events // args.runs + (1 if r < args.events % args.runs else 0) for r in range(args.runs)]
    cli(env, "list")  # create the registry before the runs submit side by side
    per_run = [[ACTIONS[(k + r) % len(ACTIONS)] for k in range(counts[r])] for r in range(args.runs)]
    strategies = ["full_shard", "ddp"]
    soaks = []
    for r, actions in enumerate(per_run):
        rng.shuffle(actions)
        soaks.append(
            Soak(
                r,
                strategies[r % len(strategies)],
                actions,
                random.Random(rng.random()),
                env,
                stop_events_at,
                deadline,
            )
        )
    log(
        f"{args.events} events over {args.runs} runs: "
        + "; ".join(f"run {s.index}: {s.actions}" for s in soaks)
    )
    for s in soaks:
        s.start()
    for s in soaks:
        s.join(timeout=max(1.0, deadline + 60 - time.monotonic()))
    records = [r for s in soaks for r in s.records]
    skipped = [r for r in records if "skipped" in r]
    records = [r for r in records if "skipped" not in r]
    done = [r for r in records if "resume_step" in r]
    by_action = {a: [r for r in records if r["action"] == a] for a in ACTIONS}
    summary = {
        "events": len(records),
        "events_checked": len(done),
        "events_skipped": len(skipped),
        "by_action": {a: len(v) for a, v in by_action.items()},
        "kills_caught_during_save": sum(1 for r in records if r.get("caught_in_save")),
        "round_trip_s": {
            a: describe([r["round_trip_s"] for r in v if "round_trip_s" in r]) for a, v in by_action.items()
        },
        "failure_detection_s": describe([r["detection_s"] for r in records if "detection_s" in r]),
        "steps_recomputed": {
            a: describe([float(r["recomputed"]) for r in v if "recomputed" in r])
            for a, v in by_action.items()
        },
        "torn_checkpoints_seen_at_resume": sum(len(r.get("torn_at_resume", [])) for r in records),
        "resumed_from_torn": sum(1 for r in records if any("torn" in p for p in r.get("problems", []))),
        "complete_checkpoints_lost": sum(len(r.get("lost_complete", [])) for r in records),
        "not_resumed_from_newest_complete": sum(
            1 for r in records if any("newest complete" in p for p in r.get("problems", []))
        ),
        "recomputed_loss_mismatches": sum(
            len(s.summary.get("recomputed_loss_mismatches", [])) for s in soaks
        ),
        "runs_completed": sum(1 for s in soaks if s.summary.get("completed")),
        "failed_events": [r for r in records if not r.get("ok")],
        "thread_errors": [s.error for s in soaks if s.error],
        "wall_s": round(time.monotonic() - started, 1),
    }
    # A run that did not reach max steps within the budget is cancelled, not a failure: the events are
    # what is measured (completion after interruptions is tests/cluster/test_fault_tolerance.py's job).
    ok = (
        not summary["failed_events"]
        and not summary["thread_errors"]
        and summary["recomputed_loss_mismatches"] == 0
        and len(done) >= min(10, args.events)
    )
    result = {
        "benchmark": "soak_preemption",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "config": {
            "events": args.events,
            "runs": args.runs,
            "seed": args.seed,
            "budget_s": args.budget,
            "max_steps": MAX_STEPS,
            "ckpt_every": CKPT_EVERY,
            "keep_last": KEEP_LAST,
            "nodes": 2,
            "procs_per_node": 1,
            "profile": "slurm_test",
            "train_args": TINY,
        },
        "ok": ok,
        "summary": summary,
        "runs": [s.summary for s in soaks],
        "events": records,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    log(f"{'OK' if ok else 'FAILED'}: {len(done)}/{len(records)} events checked; results in {args.out}")
    log(json.dumps({k: summary[k] for k in ("round_trip_s", "failure_detection_s", "steps_recomputed")}))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
