"""Goodput under preemption on the Slurm test cluster: the product against what users do today.

Three runs of ``train/`` (2 nodes x 1 process, DDP, tiny model, checkpoints every 1000 steps and on
the stop signal), one after another (``--together``: at the same time), each for ``--duration``
seconds; each attempt is preempted (USR2) ``--every`` seconds after its first step:

* ``default``: ``orchestrator submit --profile slurm_test`` as shipped (``requeue_as: auto``: the
  same job where ``cred_expire`` is short, a new job at Slurm's default);
  the preemption is ``orchestrator cancel JOB --signal USR2``;
* ``new_job``: the same with ``requeue_as: new_job`` (a successor job instead of Slurm's requeue);
* ``baseline``: a plain sbatch script with ``--requeue``: one ``srun`` task per node runs
  ``train/train.py`` with the distributed variables set from ``SLURM_*``; on USR2
  (``scancel --signal=USR2 --full``) training checkpoints and exits, and the batch script's trap
  runs ``scontrol requeue``; the next start resumes from the run's own last checkpoint (the
  Lightning/submitit way).

Goodput = productive / allocated CPU-hours, by the same accounting for all three
(:mod:`orchestrator.runner.cost_model` over ``sacct -D`` and each run's ``metrics.jsonl``; the
product's through ``orchestrator cost RUN --json``). Run it at Slurm's default ``cred_expire``::

    NODES=7 CRED_EXPIRE=default bash tests/cluster/run_with_cluster.sh \\
        python bench/bench_goodput.py --duration 600 --every 120

Writes ``bench/results_goodput.json`` and prints the rows for ``bench/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.rundir.summary import iter_metrics  # noqa: E402
from orchestrator.runner.cost import gather  # noqa: E402
from orchestrator.runner.cost_model import account_run, bill  # noqa: E402
from orchestrator.schedulers.slurm.accounting import query_allocations  # noqa: E402

TRAIN = str(REPO / "train" / "train.py")
TRAIN_ARGS = [
    *("--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64"),
    *("--log-every", "10", "--max-steps", "10000000", "--ckpt-every", "1000", "--eval-every", "0"),
]


def run(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env, check=False)


def trains(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in iter_metrics(run_dir) if e.get("event") == "train"]


def job_state(job_id: str) -> str:
    out = run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()
    return out.splitlines()[0] if out else "GONE"


class Config:
    """One run: how it is submitted, preempted and stopped."""

    def __init__(self, name: str, tmp: Path) -> None:
        self.name, self.tmp = name, tmp / name
        self.tmp.mkdir(parents=True)
        self.env = dict(
            os.environ, ORCHESTRATOR_HOME=str(self.tmp / "home"), ORCHESTRATOR_RUNS=str(self.tmp / "runs")
        )
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.first_job = ""
        self.run_dir = Path()
        self.preemptions: list[float] = []

    def current_job(self) -> str:
        return self.first_job

    def submit(self) -> None:
        raise NotImplementedError

    def preempt(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def goodput(self) -> dict[str, Any]:
        raise NotImplementedError


class Product(Config):
    def __init__(self, name: str, tmp: Path, requeue_as: str | None, train: str = TRAIN) -> None:
        super().__init__(name, tmp)
        self.train = train
        self.profiles = self.tmp / "profiles"
        self.profiles.mkdir()
        text = (REPO / "cluster_profiles" / "slurm_test.yaml").read_text()
        (self.profiles / "slurm_test.yaml").write_text(
            text + (f"requeue_as: {requeue_as}\n" if requeue_as else "")
        )

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run(sys.executable, "-m", "orchestrator", *args, env=self.env, timeout=timeout)

    def submit(self) -> None:
        res = self.cli(
            *("submit", "--profile", "slurm_test", "--profiles-dir", str(self.profiles)),
            *("--strategy", "ddp", "--nodes", "2", "--max-requeues", "100", "--", self.train, *TRAIN_ARGS),
        )
        if res.returncode != 0:
            raise RuntimeError(f"{self.name}: submit failed: {res.stdout}{res.stderr}")
        self.first_job = res.stdout.split("submitted job ")[1].split()[0]
        self.run_dir = Path(res.stdout.split("run directory ")[1].split()[0])

    def current_job(self) -> str:
        return (self.run_dir / "job_id").read_text().strip()

    def preempt(self) -> None:
        self.cli("cancel", self.current_job(), "--signal", "USR2", timeout=60)

    def stop(self) -> None:
        self.cli("cancel", self.current_job(), timeout=60)

    def goodput(self) -> dict[str, Any]:
        res = self.cli("cost", self.first_job, "--run", "--json", timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{self.name}: cost failed: {res.stderr}")
        return dict(json.loads(res.stdout))


BASELINE = """#!/bin/bash
#SBATCH --job-name=baseline
#SBATCH --partition={partition}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --mem=1G
#SBATCH --time=00:30:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={run_dir}/slurm-%j.out
export OMP_NUM_THREADS=1 ACCELERATE_USE_CPU=1 GLOO_SOCKET_IFNAME=eth0 PYTHONPATH={repo}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) MASTER_PORT=29650
requeue() {{ echo "USR2: waiting for the checkpoint, then requeueing"; wait "$child"; scontrol requeue "$SLURM_JOB_ID"; exit 0; }}
trap requeue USR2
srun --kill-on-bad-exit=1 bash -c 'RANK=$SLURM_PROCID LOCAL_RANK=0 WORLD_SIZE=$SLURM_NTASKS exec {python} {train} --run-dir {run_dir} {args}' &
child=$!
wait "$child"
"""


class Baseline(Config):
    def submit(self) -> None:
        self.run_dir = self.tmp / "run"
        self.run_dir.mkdir()
        script = self.tmp / "baseline.sbatch"
        script.write_text(
            BASELINE.format(
                partition=os.environ.get("ORCHESTRATOR_TEST_CLUSTER_PARTITION", "debug"),
                run_dir=self.run_dir,
                repo=REPO,
                python=sys.executable,
                train=TRAIN,
                args=shlex.join(TRAIN_ARGS),
            )
        )
        res = run("sbatch", "--parsable", str(script), env=self.env)
        if res.returncode != 0:
            raise RuntimeError(f"baseline: sbatch failed: {res.stderr}")
        self.first_job = res.stdout.strip().split(";")[0]

    def preempt(self) -> None:
        run("scancel", "--signal=USR2", "--full", self.first_job)

    def stop(self) -> None:
        run("scancel", self.first_job)

    def goodput(self) -> dict[str, Any]:
        found = query_allocations([self.first_job], timeout_s=30) or {}
        evidence = gather(self.run_dir, found.get(self.first_job, []))
        return bill(account_run(evidence, time.time())).to_json()


def drive(cfg: Config, duration: float, every: float, log: list[str]) -> None:
    """Preempt each attempt ``every`` s after its first step, until ``duration`` s after submission."""
    started = time.time()
    cfg.submit()
    log.append(f"{cfg.name}: job {cfg.first_job}, {cfg.run_dir}")
    attempt_first: float | None = None
    seen = 0
    while time.time() - started < duration:
        steps = trains(cfg.run_dir)
        if len(steps) > seen and attempt_first is None:
            attempt_first = time.time()
        seen = len(steps)
        if attempt_first is not None and time.time() - attempt_first >= every:
            cfg.preempt()
            cfg.preemptions.append(time.time() - started)
            log.append(f"{cfg.name}: preempted at {time.time() - started:.0f} s")
            attempt_first = None
            # The next attempt's first step is a step logged after this moment.
            time.sleep(3)
            seen = len(trains(cfg.run_dir))
        time.sleep(1)
    cfg.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--every", type=float, default=120)
    parser.add_argument("--only", nargs="*", default=["default", "new_job", "baseline"])
    parser.add_argument(
        "--together",
        action="store_true",
        help="run the configurations at the same time (they then share the cluster's cores: on the "
        "2-core test machine that triples every attempt's CPU-bound start-up); default: one after another",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results_goodput.json")
    parser.add_argument(
        "--train-ref",
        default=None,
        help="also run the defaults with train/ as of this git ref (name: default@REF), to show what a "
        "change to train/ did",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    configs: list[Config] = []
    for name in args.only:
        if name == "baseline":
            configs.append(Baseline(name, tmp))
        else:
            configs.append(Product(name, tmp, None if name == "default" else "new_job"))
    if args.train_ref:
        from bench_step_boundary import baseline_tree

        old = baseline_tree(args.train_ref, tmp / "train_ref")
        configs.append(Product(f"default@{args.train_ref}", tmp, None, str(old)))
    log: list[str] = []
    groups = [configs] if args.together else [[c] for c in configs]
    for group in groups:
        threads = [threading.Thread(target=drive, args=(c, args.duration, args.every, log)) for c in group]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Let the last allocations end (and reach accounting) before the next run starts.
        deadline = time.time() + 180
        while time.time() < deadline and any(job_state(c.current_job()) != "GONE" for c in group):
            time.sleep(2)
    time.sleep(5)
    results: dict[str, Any] = {
        "duration_s": args.duration,
        "every_s": args.every,
        "together": args.together,
        "cred_expire": os.environ.get("ORCHESTRATOR_TEST_CLUSTER_CRED_EXPIRE", "?"),
        "log": log,
        "runs": {},
    }
    for cfg in configs:
        try:
            bill_json = cfg.goodput()
        except (RuntimeError, OSError, ValueError) as exc:
            results["runs"][cfg.name] = {"error": str(exc)}
            continue
        steps = trains(cfg.run_dir)
        ids = sorted({a["job_id"] for a in bill_json["attempts"]})
        found = query_allocations(ids, timeout_s=30) or {}
        productive_s = sum(a["seconds"]["productive"] for a in bill_json["attempts"])
        results["runs"][cfg.name] = {
            "allocations": [a.to_json() for j in ids for a in found.get(j, [])],
            "productive_share_of_wall": round(productive_s / args.duration, 4),
            "job": cfg.first_job,
            "preemptions": len(cfg.preemptions),
            "attempts": len(bill_json["attempts"]),
            "goodput": bill_json["goodput"],
            "allocated_hours": bill_json["allocated_hours"],
            "hours": bill_json["hours"],
            "unbilled_s": bill_json["unbilled_s"],
            "last_step": max((e["step"] for e in steps), default=0),
        }
    out = args.out
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    for name, r in results["runs"].items():
        if "error" in r:
            print(f"| {name} | error: {r['error']} |")
            continue
        h = r["hours"]
        total = r["allocated_hours"] or 1.0
        share = {k: f"{100 * v / total:.1f} %" for k, v in h.items()}
        print(
            f"| {name} | {r['preemptions']} | {r['attempts']} | {100 * (r['goodput'] or 0):.1f} % | "
            f"{share['startup']} | {share['shutdown']} | {share['lost_work']} | {share['checkpoint']} | "
            f"{share['step_overhead']} | "
            f"{r['unbilled_s']['requeue_gap']:.0f} s | {100 * r['productive_share_of_wall']:.1f} % | {r['last_step']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
