"""Chaos on the Slurm test cluster (issue 42, item 5): mixed faults on a busy queue, side by side.

``train/`` (tiny preset, synthetic data, 2 nodes x 1 process, DDP, a checkpoint every
``--ckpt-every`` steps) runs for ``--duration`` seconds in every configuration at once, side by side
on one cluster, each configuration on a partition of its own (3 nodes), so that all meet the same load
on the shared cores at the same time; a fault-free run (``fault_free``) beside them gives the steps
a run trains without faults under that load, and the checkpoints each configuration's final weights
are compared with (bit-equal at the step of its newest complete checkpoint?). A schedule of faults drawn with ``--seed`` (one every ~``--every`` seconds, shaped like Llama
3's interruptions, mostly hardware) hits every configuration the same way:

* ``rank_kill`` (~45 %): SIGKILL of one rank (as the OOM killer does);
* ``node_death`` (~25 %): a training node dies, its slurmd and every process on it
  (``kill_node_processes(include_daemons=True)``), never the batch host; revived
  (``revive_nodes()``) ``--revive-after`` seconds later;
* ``hang`` (~15 %): SIGSTOP of one rank;
* ``preempt`` (~15 %): USR2 to the job (``orchestrator cancel JOB --signal USR2`` for the product,
  ``scancel --signal=USR2 --full`` for the script).

A fault fires at its time in the schedule, or, when the job is not training then (it waits in the
queue or restarts), as soon as it trains again: a fault of a job that holds no node has nothing to
hit. Meanwhile a filler loop keeps ``--fillers`` one-node exclusive ``sleep`` jobs pending on the same
partition, so that a job that leaves its allocation waits for one again.

Configurations:

* ``product``: ``orchestrator submit --profile slurm_test --auto-resume --max-requeues 100`` with
  ``max_restarts: 100``, ``spare_nodes: 1``, ``hang_timeout: --hang-timeout`` (3 nodes held);
* ``restarts_off``: the same with ``max_restarts: 0``, ``spare_nodes: 0`` (the product before issue
  42: a lost node or a hang goes through the queue as a new job, a killed rank ends the job FAILED);
* ``torchrun``: plain ``sbatch`` + ``srun torchrun --nnodes=2 --nproc-per-node=1 --max-restarts=3
  --rdzv-backend=c10d`` running ``train/train.py --run-dir`` with its own resume; USR2 trap ->
  ``scontrol requeue`` as a careful user writes it;
* ``ft_launcher``: the same script with nvidia-resiliency-ext's ``ft_launcher``
  in place of torchrun, from ``--nvrx-path`` (not installed in the project's environment).

"A person" (the driver, acting at once) is needed when the job left the queue before the end, or
trained nothing for ``--person-after`` seconds while RUNNING: it then runs ``orchestrator resume``
(product) or submits the script again (the others), and counts it.

Per configuration: steps trained in the duration, wall-clock goodput (the kept steps' ``step_time_s``
in ``metrics.jsonl`` over the duration), allocation goodput (bench_goodput's accounting:
``orchestrator cost`` for ours, :mod:`orchestrator.runner.cost_model` over ``sacct`` for the others),
the time from each fault to the first step of the attempt after it, steps lost (trained again), and
the faults that needed a person. Run it through the cluster wrapper::

    NODES=15 bash tests/cluster/run_with_cluster.sh .venv/bin/python bench/bench_chaos.py \
        --duration 1800 --every 180 --nvrx-path SITE

Writes ``bench/results_chaos.json`` and prints the rows for ``bench/results.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

import yaml
from bench_goodput import REPO, TRAIN, TRAIN_ARGS, Baseline, Product, run

from orchestrator.contract.heartbeat import read_heartbeats
from orchestrator.contract.restarts import read_restarts
from orchestrator.rundir.summary import METRICS_FILE, iter_metrics
from orchestrator.runner.cost import gather
from orchestrator.runner.cost_model import account_run, bill
from orchestrator.schedulers.slurm.accounting import query_allocations

# The test cluster's own fault helpers (kill_node_processes, revive_nodes, load_cluster), imported at run
# time: tests/ is typed by its own checks, not by `mypy bench`.
CLUSTER = importlib.import_module("tests.helpers.slurm_cluster")
#: Nodes a configuration's own partition holds (2 training + 1: a spare, a filler job's or idle).
NODES_PER_CONFIG = 3
#: Llama 3's mix, coarsely: mostly hardware (a rank or a node lost), some hangs, some preemptions.
MIX = (("rank_kill", 45), ("node_death", 25), ("hang", 15), ("preempt", 15))
#: Every configuration's time limit: well past ``--duration`` (the profile's 30 minutes made the fault-free
#: run of a 30-minute bench checkpoint and requeue itself 30 s before its end).
TIME_LIMIT = "02:00:00"
#: The fault-free configuration beside the others: the steps a run trains without faults under the
#: same load, and the checkpoints the others' final weights are compared with.
REFERENCE = "fault_free"
#: squeue's answer for a job that left the queue.
GONE = "GONE"
#: Reasons a pending job waits for that are the queue's ordinary business.
ORDINARY_WAITS = ("Priority", "Resources", "BeginTime", "None", "Dependency", "Reservation")


def chaos_args(ckpt_every: int) -> list[str]:
    out = list(TRAIN_ARGS)
    out[out.index("--ckpt-every") + 1] = str(ckpt_every)
    return out


@dataclasses.dataclass
class Fault:
    at: float  # seconds after the configuration's submission, as scheduled
    kind: str
    rank: int  # the rank hit (rank_kill, hang); node_death: the node of this rank unless the batch host

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def schedule(seed: int, duration: float, every: float) -> list[Fault]:
    """Faults ~``every`` s apart (uniform 0.6-1.4x), kinds drawn from :data:`MIX`; a few more than fit,
    for configurations whose faults were delayed while they did not train."""
    rng = random.Random(seed)
    kinds, weights = [k for k, _ in MIX], [w for _, w in MIX]
    out, at = [], 0.0
    while at < duration * 1.5:
        at += every * rng.uniform(0.6, 1.4)
        out.append(Fault(round(at, 1), rng.choices(kinds, weights)[0], rng.choice([0, 1])))
    return out


def squeue_state(job_id: str) -> str:
    out = run("squeue", "-h", "-j", job_id, "-o", "%T|%r").stdout.strip()
    return out.splitlines()[0] if out else GONE


def scontrol_field(job_id: str, field: str) -> str:
    out = run("scontrol", "show", "job", job_id).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(field + "=")), "")


def hostnames(nodelist: str) -> list[str]:
    return run("scontrol", "show", "hostnames", nodelist).stdout.split() if nodelist else []


def proc_state(pid: int) -> str:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return "" if state in ("Z", "X") else state


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.decode(errors="replace").partition("=")
        if sep:
            out[key] = value
    return out


def revive_node(cluster: Any, node: str, timeout: float = 120) -> None:
    """Start ``node``'s slurmd again (as start_cluster.sh does) and resume the node once it registered.

    Not ``revive_nodes()``: it restarts every missing slurmd of the cluster, so with the configurations
    side by side one configuration's revival would bring another's dead node back early."""
    if cluster.mode != "netns":
        CLUSTER.revive_nodes(cluster, timeout=timeout)
        return
    base, conf = Path(cluster.base), Path(cluster.base) / "etc" / "slurm.conf"
    pid_file = base / "run" / f"slurmd-{node}.pid"
    old = pid_file.read_text().strip() if pid_file.exists() else ""
    if not (old.isdigit() and proc_state(int(old))):
        start_slurmd(base, conf, node, pid_file)
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = run("sinfo", "-h", "-N", "-n", node, "-o", "%t").stdout.split()
        state_now = state[0].rstrip("*~#") if state else ""
        if state_now in ("idle", "mix", "alloc", "comp"):
            return
        if state_now in ("down", "drain", "drng", "fail") and not (state and state[0].endswith("*")):
            run("scontrol", "update", f"NodeName={node}", "State=RESUME")
        time.sleep(2)
    raise AssertionError(f"{node} not usable {timeout:.0f} s after its slurmd was started again")


def start_slurmd(base: Path, conf: Path, node: str, pid_file: Path) -> None:
    inner = f"hostname {node} && exec slurmd -D -f {shlex.quote(str(conf))} -N {node}"
    # The marker tells start/stop_cluster.sh the daemon is the cluster's; setsid + & leaves it to init.
    line = (
        f"ORCH_SLURM_DAEMON_OF={shlex.quote(str(base))} setsid nsenter --net=/run/netns/slurm-{node} "
        f"unshare --uts sh -c {shlex.quote(inner)} </dev/null "
        f">>{shlex.quote(str(base / 'logs' / f'slurmd-{node}.out'))} 2>&1 & echo $!"
    )
    pid_file.write_text(run("bash", "-c", line).stdout.strip() + "\n")


class Chaotic(Protocol):
    """What the driver needs of a configuration (bench_goodput's Config and a little more)."""

    name: str
    partition: str
    run_dir: Path
    run_dirs: list[Path]
    """Every run directory, oldest first: a person who finds no checkpoint to resume submits anew."""
    jobs: list[str]

    def submit(self) -> None: ...

    def current_job(self) -> str: ...

    def rank_pids(self) -> dict[int, tuple[int, str]]:
        """``{rank: (pid, host)}`` of the ranks of the newest attempt."""
        ...

    def preempt(self) -> None: ...

    def stop(self) -> None: ...

    def person(self) -> str:
        """What a person does when the job is over before its time: returns the new job id."""
        ...

    def goodput(self) -> dict[str, Any]: ...


class ChaosProduct(Product):
    def __init__(
        self, name: str, tmp: Path, overrides: dict[str, Any], args: list[str], partition: str
    ) -> None:
        super().__init__(name, tmp, None)
        self.partition = partition
        data = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
        data.update(overrides, partition=partition, time_limit=TIME_LIMIT)
        (self.profiles / "slurm_test.yaml").write_text(yaml.safe_dump(data))
        self.overrides, self.args = overrides, args
        self.strategy = "ddp"
        self.jobs: list[str] = []
        self.run_dirs: list[Path] = []

    def submit(self) -> None:
        res = self.cli(
            *("submit", "--profile", "slurm_test", "--profiles-dir", str(self.profiles), "--auto-resume"),
            *("--strategy", self.strategy, "--nodes", "2", "--procs-per-node", "1", "--max-requeues", "100"),
            *("--", TRAIN, *self.args),
        )
        if res.returncode != 0:
            raise RuntimeError(f"{self.name}: submit failed: {res.stdout}{res.stderr}")
        self.first_job = res.stdout.split("submitted job ")[1].split()[0]
        self.run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
        self.run_dirs.append(self.run_dir)
        self.jobs.append(self.first_job)

    def current_job(self) -> str:
        job = super().current_job()
        if job not in self.jobs:
            self.jobs.append(job)
        return job

    def rank_pids(self) -> dict[int, tuple[int, str]]:
        logs = self.run_dir / "logs"
        attempts = sorted(
            (int(p.name.split("_")[1]), p) for p in logs.glob("attempt_*") if p.name.split("_")[1].isdigit()
        )
        if not attempts:
            return {}
        beats = read_heartbeats(attempts[-1][1])
        return {r: (int(b.get("pid", 0)), str(b.get("host", ""))) for r, b in beats.items()}

    def preempt(self) -> None:
        self.cli("cancel", self.current_job(), "--signal", "USR2", timeout=60)

    def stop(self) -> None:
        self.cli("cancel", self.current_job(), timeout=60)

    def person(self) -> str:
        if squeue_state(self.current_job()) != GONE:
            self.cli("cancel", self.current_job(), timeout=60)
            deadline = time.time() + 60
            while time.time() < deadline and squeue_state(self.current_job()) != GONE:
                time.sleep(1)
        res = self.cli("resume", self.current_job(), "--profiles-dir", str(self.profiles), timeout=120)
        if "no complete checkpoint" in res.stdout + res.stderr:
            self.submit()  # nothing to resume from: a person submits the job again, from step 0
            return self.first_job
        if "submitted job " not in res.stdout:
            raise RuntimeError(f"{self.name}: resume failed: {res.stdout}{res.stderr}")
        job = res.stdout.split("submitted job ")[1].split()[0]
        self.jobs.append(job)
        return job


SCRIPT = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --partition={partition}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --mem=1G
#SBATCH --time={time_limit}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={run_dir}/slurm-%j.out
export OMP_NUM_THREADS=1 ACCELERATE_USE_CPU=1 GLOO_SOCKET_IFNAME=eth0 PYTHONPATH={pythonpath}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
requeue() {{ echo "USR2: waiting for the checkpoint, then requeueing"; wait "$child"; scontrol requeue "$SLURM_JOB_ID"; exit 0; }}
trap requeue USR2
srun --kill-on-bad-exit=1 {launcher} --nnodes=2 --nproc-per-node=1 --max-restarts=3 \\
    --rdzv-backend=c10d --rdzv-endpoint="$head:29653" --rdzv-id="$SLURM_JOB_ID" \\
    {train} --run-dir {run_dir} {args} &
child=$!
wait "$child"
"""


class Launched(Baseline):
    """sbatch + srun + torchrun (or ft_launcher), train/'s own resume from its run directory."""

    def __init__(
        self, name: str, tmp: Path, args: list[str], launcher: str, pythonpath: str, partition: str
    ) -> None:
        super().__init__(name, tmp)
        self.args, self.launcher, self.pythonpath = args, launcher, pythonpath
        self.partition = partition
        self.run_dirs: list[Path] = []
        self.jobs: list[str] = []
        self.script = self.tmp / f"{name}.sbatch"

    def sbatch(self) -> str:
        res = run("sbatch", "--parsable", str(self.script), env=self.env)
        if res.returncode != 0:
            raise RuntimeError(f"{self.name}: sbatch failed: {res.stderr}")
        job = res.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def submit(self) -> None:
        self.run_dir = self.tmp / "run"
        self.run_dir.mkdir()
        self.run_dirs = [self.run_dir]
        self.script.write_text(
            SCRIPT.format(
                name=self.name,
                partition=self.partition,
                time_limit=TIME_LIMIT,
                run_dir=self.run_dir,
                pythonpath=self.pythonpath,
                launcher=self.launcher,
                train=TRAIN,
                args=shlex.join(self.args),
            )
        )
        self.first_job = self.sbatch()

    def current_job(self) -> str:
        return self.jobs[-1]

    def rank_pids(self) -> dict[int, tuple[int, str]]:
        entry = f"SLURM_JOB_ID={self.current_job()}"
        out: dict[int, tuple[int, str]] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # A worker is `python -u .../train/train.py ...`; srun and the launchers carry the script
            # further down their command line.
            if not any(c.endswith(b"train/train.py") for c in cmd[1:3]):
                continue
            env = environ(int(d.name))
            if entry.partition("=")[2] == env.get("SLURM_JOB_ID") and env.get("RANK", "").isdigit():
                out[int(env["RANK"])] = (int(d.name), env.get("SLURMD_NODENAME", ""))
        return out

    def preempt(self) -> None:
        run("scancel", "--signal=USR2", "--full", self.current_job())

    def stop(self) -> None:
        run("scancel", self.current_job())

    def person(self) -> str:
        run("scancel", self.current_job())
        deadline = time.time() + 60
        while time.time() < deadline and squeue_state(self.current_job()) != GONE:
            time.sleep(1)
        return self.sbatch()

    def goodput(self) -> dict[str, Any]:
        found = query_allocations(self.jobs, timeout_s=30) or {}
        allocations = [a for j in self.jobs for a in found.get(j, [])]
        evidence = gather(self.run_dir, allocations)
        out = bill(account_run(evidence, time.time())).to_json()
        return dict(out)


class Fillers:
    """Keeps ``count`` one-node exclusive sleep jobs pending on the partition (another user's work)."""

    def __init__(self, count: int, seconds: int, partition: str) -> None:
        self.count, self.seconds, self.partition = count, seconds, partition
        self.jobs: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def pending(self) -> int:
        if not self.jobs:
            return 0
        out = run("squeue", "-h", "-t", "PENDING", "-j", ",".join(self.jobs[-50:]), "-o", "%i").stdout
        return len(out.split())

    def loop(self) -> None:
        while not self.done.is_set():
            for _ in range(max(0, self.count - self.pending())):
                res = run(
                    *(
                        "sbatch",
                        "--parsable",
                        "--job-name=filler",
                        f"--partition={self.partition}",
                        "--nodes=1",
                    ),
                    *("--exclusive", "--output=/dev/null", "--time=00:10:00", f"--wrap=sleep {self.seconds}"),
                )
                if res.returncode == 0:
                    self.jobs.append(res.stdout.strip().split(";")[0])
            self.done.wait(3)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=30)
        for i in range(0, len(self.jobs), 50):
            run("scancel", *self.jobs[i : i + 50])


def train_events(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in iter_metrics(run_dir) if e.get("event") in ("train", "startup", "resume")]


class Driver:
    def __init__(self, cfg: Chaotic, faults: list[Fault], args: argparse.Namespace, cluster: Any) -> None:
        self.cfg, self.faults, self.args, self.cluster = cfg, faults, args, cluster
        self.log: list[str] = []
        self.applied: list[dict[str, Any]] = []
        self.persons: list[dict[str, Any]] = []
        self.stopped_pids: list[int] = []
        self.revivals: list[threading.Thread] = []
        self.started = 0.0
        self.offset, self.last_step = 0, 0.0
        self.metrics_of = Path()  # the run directory self.offset is into
        self.loads: list[tuple[float, float]] = []  # (time, 1-minute load average): the cores are shared

    def say(self, text: str) -> None:
        line = f"{self.cfg.name} +{time.time() - self.started:.0f}s: {text}"
        self.log.append(line)
        print(line, flush=True)

    def last_step_time(self) -> float:
        """The time of the newest step in metrics.jsonl, reading only what was appended since the last
        call (a whole read every second would take the 2 cores from training)."""
        if self.metrics_of != self.cfg.run_dir:
            self.metrics_of, self.offset = self.cfg.run_dir, 0
        try:
            with (self.cfg.run_dir / METRICS_FILE).open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return self.last_step
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.splitlines():
            if b'"train"' in line:
                try:
                    self.last_step = max(self.last_step, float(json.loads(line)["time"]))
                except (ValueError, KeyError, TypeError):
                    continue
        return self.last_step

    def training(self) -> dict[int, tuple[int, str]] | None:
        """The ranks, when both are alive, not stopped, and a step was logged in the last 5 s."""
        if time.time() - self.last_step_time() > 5:
            return None
        ranks = self.cfg.rank_pids()
        if sorted(ranks) != [0, 1] or any(proc_state(pid) in ("", "T") for pid, _ in ranks.values()):
            return None
        return ranks

    def fire(self, fault: Fault, ranks: dict[int, tuple[int, str]]) -> dict[str, Any]:
        job = self.cfg.current_job()
        record: dict[str, Any] = {**fault.to_json(), "job": job, "time": time.time()}
        record["offset_s"] = round(record["time"] - self.started, 1)
        pid, host = ranks[fault.rank]
        if fault.kind == "rank_kill":
            os.kill(pid, signal.SIGKILL)
            record["target"] = f"rank {fault.rank} pid {pid} on {host}"
        elif fault.kind == "hang":
            os.kill(pid, signal.SIGSTOP)
            self.stopped_pids.append(pid)
            record["target"] = f"rank {fault.rank} pid {pid} on {host} (SIGSTOP)"
        elif fault.kind == "preempt":
            self.cfg.preempt()
            record["target"] = f"job {job} (USR2)"
        else:
            batch_host = scontrol_field(job, "BatchHost")
            hosts = [h for _, h in (ranks[fault.rank], ranks[1 - fault.rank])]
            victim = next((h for h in hosts if h and h != batch_host), "")
            if not victim:
                record["target"] = f"no training node but the batch host {batch_host}: skipped"
                return record
            killed = CLUSTER.kill_node_processes(victim, include_daemons=True, cluster=self.cluster)
            record["target"] = (
                f"node {victim} ({len(killed)} processes and its slurmd; batch host {batch_host})"
            )
            thread = threading.Thread(target=self.revive, args=(victim,), daemon=True)
            thread.start()
            self.revivals.append(thread)
        return record

    def revive(self, node: str) -> None:
        time.sleep(self.args.revive_after)
        try:
            revive_node(self.cluster, node)
            self.say(f"{node} revived")
        except (AssertionError, subprocess.SubprocessError, OSError) as exc:
            self.say(f"{node}: revive failed: {exc}")

    def drive(self) -> None:
        cfg, duration = self.cfg, self.args.duration
        self.started = time.time()
        cfg.submit()
        self.say(f"job {cfg.current_job()}, run directory {cfg.run_dir}")
        fillers = Fillers(self.args.fillers, self.args.filler_seconds, cfg.partition)
        deadline = time.time() + 60
        while time.time() < deadline and not squeue_state(cfg.current_job()).startswith("RUNNING"):
            time.sleep(1)
        fillers.start()
        pending = list(self.faults)
        gone_since: float | None = None
        stuck_since: float | None = None
        running_since = time.time()
        last_state = ""
        last_fault_at = 0.0
        try:
            while time.time() - self.started < duration:
                now = time.time()
                job = cfg.current_job()
                state = squeue_state(job)
                if state.split("|")[0] != last_state.split("|")[0]:
                    self.say(f"job {job} {state}")
                    if state.startswith("RUNNING"):
                        running_since = now
                last_state = state
                # A person: the job left the queue (give auto-resume 20 s to put a successor in its
                # place), or it trained nothing for --person-after s while RUNNING.
                if state == GONE:
                    gone_since = gone_since or now
                # Or it waits for what cannot come (nodes excluded, down): not an ordinary queue wait.
                stuck = state.startswith("PENDING") and state.split("|")[-1] not in ORDINARY_WAITS
                stuck_since = (stuck_since or now) if stuck else None
                stalled = (
                    state.startswith("RUNNING")
                    and now - max(self.last_step_time(), running_since, last_fault_at)
                    > self.args.person_after
                ) or (stuck_since is not None and now - stuck_since > self.args.person_after)
                if (gone_since is not None and now - gone_since > 20) or stalled:
                    why = f"stalled ({state})" if stalled else f"job {job} ended ({self.sacct_state(job)})"
                    try:
                        new = cfg.person()
                    except Exception as exc:
                        self.say(f"a person tried ({why}) and failed: {exc!r}")
                        gone_since, running_since = None, now
                        continue
                    self.persons.append({"time": now, "offset_s": round(now - self.started, 1), "why": why})
                    self.say(f"a person: {why}; resubmitted as job {new}")
                    gone_since, running_since, stuck_since = None, now, None
                if state != GONE:
                    gone_since = None
                if pending and now - self.started >= pending[0].at:
                    ranks = self.training()
                    if ranks is not None:
                        fault = pending.pop(0)
                        try:
                            record = self.fire(fault, ranks)
                        except Exception as exc:  # a driver error must not end the configuration
                            record = {**fault.to_json(), "time": time.time(), "target": f"error: {exc!r}"}
                        self.applied.append(record)
                        last_fault_at = record["time"]
                        self.say(f"fault {fault.kind}: {record.get('target')} (scheduled +{fault.at:.0f}s)")
                if not self.loads or now - self.loads[-1][0] > 20:
                    self.loads.append((now, os.getloadavg()[0]))
                time.sleep(1)
        finally:
            try:
                cfg.stop()
            except Exception as exc:
                self.say(f"stop failed: {exc!r}")
            fillers.stop()
            for pid in self.stopped_pids:
                if proc_state(pid):
                    os.kill(pid, signal.SIGCONT)
            for thread in self.revivals:
                thread.join(timeout=200)
            for job in cfg.jobs:  # a successor the product submitted meanwhile, a person's resubmission
                if squeue_state(job) != GONE:
                    run("scancel", job)
            self.say(f"stopped; {len(fillers.jobs)} filler jobs submitted and cancelled")
            deadline = time.time() + 120
            while time.time() < deadline and any(squeue_state(j) != GONE for j in cfg.jobs):
                time.sleep(2)
            self.nodes_back()

    def nodes_back(self) -> None:
        """Every node usable again before the next configuration (a killed slurmd started again)."""
        deadline = time.time() + 150
        while time.time() < deadline:
            states = run("sinfo", "-h", "-N", "-p", self.cfg.partition, "-o", "%N %t").stdout.split("\n")
            bad = [
                line for line in states if line.strip() and line.split()[1].rstrip("*") not in ("idle", "mix")
            ]
            if not bad:
                return
            if time.time() > deadline - 120:
                self.say(f"nodes not idle: {bad}; reviving")
                try:
                    for line in bad:
                        revive_node(self.cluster, line.split()[0])
                except (AssertionError, subprocess.SubprocessError, OSError) as exc:
                    self.say(f"revive failed: {exc}")
            time.sleep(3)
        self.say("nodes still not idle after 150 s")

    @staticmethod
    def sacct_state(job: str) -> str:
        out = run("sacct", "-n", "-X", "-P", "-j", job, "-o", "State").stdout.split()
        return out[-1] if out else "?"

    def report(self) -> dict[str, Any]:
        cfg, end = self.cfg, self.started + self.args.duration
        events = sorted(
            (e for d in cfg.run_dirs for e in train_events(d) if e["time"] <= end), key=lambda e: e["time"]
        )
        steps = [e for e in events if e["event"] == "train"]
        last: dict[int, dict[str, Any]] = {}
        for e in train_events(cfg.run_dir):  # the steps kept: the final run directory's, once each
            if e["event"] == "train" and e["time"] <= end:
                last[e["step"]] = e
        productive = sum(e["step_time_s"] for e in last.values())
        recoveries: list[float | None] = []
        for f in self.applied:
            if "skipped" in str(f.get("target")):
                recoveries.append(None)
                continue
            start = next((e for e in events if e["event"] == "startup" and e["time"] > f["time"]), None)
            back = next((e for e in steps if e["time"] > start["time"]), None) if start is not None else None
            f["back_s"] = round(back["time"] - f["time"], 1) if back is not None else None
            f["back_at_step"] = back["step"] if back is not None else None
            recoveries.append(f["back_s"])
        done = [r for r in recoveries if r is not None]
        try:
            bill_json: dict[str, Any] | None = cfg.goodput()
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            bill_json, error = None, str(exc)
        else:
            error = ""
        restarts = (
            [r for d in cfg.run_dirs for r in read_restarts(d)] if isinstance(cfg, ChaosProduct) else []
        )
        found = query_allocations(cfg.jobs, timeout_s=30) or {}
        return {
            "jobs": cfg.jobs,
            "run_dir": str(cfg.run_dir),
            "run_dirs": [str(d) for d in cfg.run_dirs],
            "steps": max(last, default=0),
            "steps_logged": len(steps),
            "steps_lost": len(steps) - len(last),
            "median_step_s": round(statistics.median(e["step_time_s"] for e in steps), 4) if steps else None,
            "load_average": round(statistics.mean(v for _, v in self.loads), 2) if self.loads else None,
            "wall_goodput": round(productive / self.args.duration, 4),
            "productive_s": round(productive, 1),
            "allocation_goodput": bill_json["goodput"] if bill_json else None,
            "allocated_hours": bill_json["allocated_hours"] if bill_json else None,
            "hours": bill_json["hours"] if bill_json else None,
            "bill_error": error,
            "faults": self.applied,
            "faults_applied": len(self.applied),
            "faults_recovered": len(done),
            "back_median_s": round(statistics.median(done), 1) if done else None,
            "back_max_s": round(max(done), 1) if done else None,
            "needed_a_person": len(self.persons),
            "persons": self.persons,
            "new_jobs": len(cfg.jobs) - 1,
            "allocations": sum(len(found.get(j, [])) for j in cfg.jobs),
            "restarts_in_allocation": [
                {k: r.get(k) for k in ("job_id", "cause", "step", "time")} for r in restarts
            ],
            "log": self.log,
        }


def print_rows(results: dict[str, Any]) -> None:
    """The rows for bench/results.md."""
    ref = results["runs"].get(REFERENCE, {})
    for name, r in results["runs"].items():
        if "error" in r:
            print(f"| {name} | error: {r['error']} |")
            continue
        kinds = ", ".join(f["kind"] for f in r["faults"]) or "none"
        weights = r.get("weights") or {}
        if weights.get("compared"):
            equal = f"{'yes' if weights['bit_equal'] else '**no**'} (step {weights['step']} of {weights['final_checkpoint_step']})"
        else:
            equal = "-" if name == REFERENCE else f"not compared: {weights.get('why', '?')}"
        of_ref = (
            f" ({100 * r['steps'] / ref['steps']:.0f} %)" if ref.get("steps") and name != REFERENCE else ""
        )
        print(
            f"| {name} | {r['faults_applied']} ({kinds}) | {r['steps']}{of_ref} | {100 * r['wall_goodput']:.1f} % | "
            f"{100 * (r['allocation_goodput'] or 0):.1f} % | {r['back_median_s']} s / {r['back_max_s']} s "
            f"({r['faults_recovered']}/{r['faults_applied']} back) | {r['steps_lost']} | {r['needed_a_person']} | "
            f"{r['new_jobs']} | {r.get('allocations', '?')} | {r['median_step_s']} s | {equal} |"
        )


def make_configs(args: argparse.Namespace, tmp: Path, nodes: int) -> list[Chaotic]:
    """The configurations, each on a partition of its own (:data:`NODES_PER_CONFIG` nodes, created
    here), side by side on one cluster of ``NODES_PER_CONFIG x len(--only)`` nodes."""
    names = list(args.only) + ([REFERENCE] if args.reference else [])
    if len(names) * NODES_PER_CONFIG > nodes:
        raise SystemExit(
            f"bench_chaos: {len(names)} configurations side by side need {len(names) * NODES_PER_CONFIG} "
            f"nodes, the cluster has {nodes}: run it with NODES={len(names) * NODES_PER_CONFIG} "
            "bash tests/cluster/run_with_cluster.sh ..."
        )
    train_args = chaos_args(args.ckpt_every)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    configs: list[Chaotic] = []
    for i, name in enumerate(names):
        first = i * NODES_PER_CONFIG + 1
        partition = f"chaos_{name}"
        run(
            *("scontrol", "create", f"PartitionName={partition}"),
            *(f"Nodes=n[{first}-{first + NODES_PER_CONFIG - 1}]", "MaxTime=INFINITE", "State=UP"),
        )
        if name == "product":
            over = {"max_restarts": 100, "spare_nodes": 1, "hang_timeout": args.hang_timeout}
            configs.append(ChaosProduct(name, tmp, over, train_args, partition))
        elif name == "restarts_off":
            over = {"max_restarts": 0, "spare_nodes": 0, "hang_timeout": args.hang_timeout}
            configs.append(ChaosProduct(name, tmp, over, train_args, partition))
        elif name == REFERENCE:  # no faults; keeps every checkpoint for the comparison of weights
            over = {"max_restarts": 0, "spare_nodes": 0, "hang_timeout": args.hang_timeout}
            configs.append(ChaosProduct(name, tmp, over, [*train_args, "--keep-last", "100000"], partition))
        elif name == "torchrun":
            configs.append(Launched(name, tmp, train_args, torchrun, str(REPO), partition))
        elif name == "ft_launcher":
            launcher = f"{sys.executable} -m nvidia_resiliency_ext.fault_tolerance.launcher --ignore-missing-fault-tol-cfg"
            configs.append(Launched(name, tmp, train_args, launcher, f"{args.nvrx_path}:{REPO}", partition))
        else:
            raise SystemExit(f"bench_chaos: unknown configuration {name}")
    return configs


def complete_steps(run_dir: Path) -> dict[int, Path]:
    """train/'s complete checkpoints (folders with their marker), by step."""
    return {
        int(d.name.split("_")[1]): d
        for d in (run_dir / "checkpoints").glob("step_*")
        if (d / "COMPLETE.json").is_file()
    }


def same_weights(run_dir: Path, reference: Path) -> dict[str, Any]:
    """The run's newest complete checkpoint that the fault-free run also has (the grid of
    ``--ckpt-every``: the run's own last one, written at the stop, falls between) against the
    fault-free run's at that step: every tensor of the model and of the optimizer's state bit-equal?"""
    import torch
    from safetensors.torch import load_file

    mine, theirs = complete_steps(run_dir), complete_steps(reference)
    common = sorted(mine.keys() & theirs.keys())
    if not common:
        return {"compared": False, "why": f"no common checkpoint (run: {sorted(mine)[-3:]})"}
    step = common[-1]
    folder, ref = mine[step], theirs[step]
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    opt_a = torch.load(folder / "optimizer.bin", map_location="cpu", weights_only=True)["state"]
    opt_b = torch.load(ref / "optimizer.bin", map_location="cpu", weights_only=True)["state"]
    opt_equal = opt_a.keys() == opt_b.keys() and all(
        torch.equal(x, opt_b[k][name]) if isinstance(x, torch.Tensor) else x == opt_b[k][name]
        for k, state in opt_a.items()
        for name, x in state.items()
    )
    return {
        "compared": True,
        "step": step,
        "final_checkpoint_step": max(mine),
        "tensors": len(a),
        "bit_equal": not differ and opt_equal,
        "model_tensors_differ": differ[:10],
        "optimizer_equal": opt_equal,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=1800)
    parser.add_argument("--every", type=float, default=180)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--ckpt-every", type=int, default=500, help="steps (tiny model: ~25 ms a step)")
    parser.add_argument("--hang-timeout", type=int, default=30)
    parser.add_argument("--revive-after", type=float, default=45, help="seconds from a node's death")
    parser.add_argument("--person-after", type=float, default=150, help="seconds RUNNING without a step")
    parser.add_argument("--fillers", type=int, default=2, help="filler jobs kept pending")
    parser.add_argument("--filler-seconds", type=int, default=120)
    parser.add_argument("--only", nargs="*", default=["product", "restarts_off", "torchrun", "ft_launcher"])
    parser.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help=f"no fault-free run ({REFERENCE}) beside them: no comparison of the final weights",
    )
    parser.add_argument(
        "--nvrx-path", default="", help="PYTHONPATH holding nvidia_resiliency_ext (ft_launcher)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results_chaos.json")
    parser.add_argument("--rows", type=Path, default=None, help="only print the rows of this results file")
    args = parser.parse_args()
    if args.rows is not None:
        print_rows(json.loads(args.rows.read_text()))
        return 0
    cluster = CLUSTER.load_cluster()
    tmp = Path(tempfile.mkdtemp(prefix="bench_chaos_"))
    faults = schedule(args.seed, args.duration, args.every)
    configs = make_configs(args, tmp, cluster.nodes)
    results: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "side_by_side": True,
        "duration_s": args.duration,
        "every_s": args.every,
        "seed": args.seed,
        "ckpt_every": args.ckpt_every,
        "person_after_s": args.person_after,
        "cred_expire": os.environ.get("ORCHESTRATOR_TEST_CLUSTER_CRED_EXPIRE", "?"),
        "nodes": cluster.nodes,
        "schedule": [f.to_json() for f in faults if f.at < args.duration],
        "runs": {},
    }
    drivers = [Driver(cfg, [] if cfg.name == REFERENCE else faults, args, cluster) for cfg in configs]

    def drive(driver: Driver) -> None:
        try:
            driver.drive()
            results["runs"][driver.cfg.name] = driver.report()
        except Exception as exc:
            results["runs"][driver.cfg.name] = {
                "error": repr(exc),
                "traceback": traceback.format_exc(),
                "log": driver.log,
                "jobs": driver.cfg.jobs,
            }

    # Side by side: every configuration meets the same load on the shared cores, at the same time.
    threads = [threading.Thread(target=drive, args=(d,), name=d.cfg.name) for d in drivers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reference = next((c for c in configs if c.name == REFERENCE), None)
    if reference is not None:
        for cfg in configs:
            run_result = results["runs"].get(cfg.name, {})
            if cfg is reference or "error" in run_result:
                continue
            try:
                run_result["weights"] = same_weights(cfg.run_dir, reference.run_dir)
            except Exception as exc:
                run_result["weights"] = {"compared": False, "why": repr(exc)}
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))
    print_rows(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
