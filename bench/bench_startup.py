"""Start-up of a job on its nodes, split per phase, against a floor on the same nodes (issue 16, item 4).

On the Slurm test cluster, ``reps`` pairs of 2-node jobs, one task per node, interleaved (order
flipped every pair), each pair once with a warm page cache and once with a cold one:

* ours: ``orchestrator submit --profile slurm_test --strategy ddp --nodes 2 --procs-per-node 1 --
  train/train.py --preset tiny ... --resume <checkpoint>`` (the checkpoint is written once, by a
  first job, so that every measured job loads one);
* floor: ``sbatch`` of a script whose one ``srun`` step runs, on every node, ``import torch,
  accelerate`` and one gloo ``init_process_group`` over the same nodes; then it builds one
  ``torch.optim.AdamW``, whose first construction imports ``torch._dynamo`` in any script
  (reported beside the floor, not part of it).

Both start the clock at the first line of their batch script (``date +%s.%N``; for ours a ``setup:``
line of the profile). Stamps of node 0 / rank 0, phase by phase:

======================  ===========================================================================
phase                   ours (floor: the first three only, named alike)
======================  ===========================================================================
to_launcher             batch script -> ``accelerate launch`` handed off (mtime of
                        ``logs/attempt_0/node_0.pid``): batch step, ``srun``, submitit's node entry,
                        plan + config rendering (floor: batch script -> the worker's interpreter
                        starts, i.e. ``srun`` alone)
launcher_to_rank        -> rank 0's process starts (``/proc`` start time): the launcher's imports
                        (prewarmed) and the fork (``launcher: direct``; with torchrun: its agent,
                        rendezvous and the spawn of a fresh interpreter)
rank_imports            -> ``torch`` / ``accelerate`` / train's modules imported (``startup`` event)
process_group           -> ``Accelerator()`` returned (gloo process group up)
model                   -> model built and prepared (DDP wrap), self-check
to_load                 -> load begins (metrics, tensorboard tracker, checkpoint lookup)
load                    ``loaded.json`` ``load_s``
first_step              ``resume`` event -> first ``train`` event
======================  ===========================================================================

Cold cache: ``sync; echo 3 > /proc/sys/vm/drop_caches`` just before a job is submitted. All nodes of
the test cluster share one disk, so a cold page cache is the proxy for a venv on a shared filesystem
(every node reads the interpreter's files from storage), a warm one for a venv on node-local disk
whose files are already in memory: this is a proxy, not a shared filesystem.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak_preemption as soak  # noqa: E402
import yaml  # noqa: E402
from bench_requeue import c10d_stamps, cluster_up  # noqa: E402

from orchestrator.rundir.summary import iter_metrics  # noqa: E402

NODES = 2
STAMP = "bench_job_start"
STAMP_RE = re.compile(STAMP + r" ([0-9.]+)")
FLOOR_RE = re.compile(r"bench_floor (\{.*\})")
TINY = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"]
PHASES = (
    "to_launcher",
    "launcher_to_rank",
    "rank_imports",
    "process_group",
    "model",
    "to_load",
    "load",
    "first_step",
)
FLOOR_PHASES = ("to_launcher", "rank_imports", "process_group")

# One interpreter per node: import torch and accelerate, then one gloo process group over the job's
# nodes (rank 0 hosts the store). Its own start time comes from /proc, as train/metrics.py does it.
FLOOR_SCRIPT = """\
import json, os, sys, time
from pathlib import Path
ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
start = time.time() - float(Path("/proc/uptime").read_text().split()[0]) + ticks / os.sysconf("SC_CLK_TCK")
import torch, accelerate
imports = time.time()
import torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method=f"tcp://{sys.argv[1]}:{sys.argv[2]}", rank=rank, world_size=world)
pg = time.time()
torch.optim.AdamW(torch.nn.Linear(8, 8).parameters())  # every torch.optim optimizer imports torch._dynamo
optimizer = time.time()
if rank == 0:
    stamps = {"process": start, "imports": imports, "process_group": pg, "optimizer": optimizer}
    print("bench_floor " + json.dumps(stamps), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def profiles_dir(tmp: Path, max_nodes: int | None = None) -> Path:
    """The test profile plus a ``setup:`` line stamping the batch script's start (and more nodes)."""
    data = yaml.safe_load((soak.REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
    data["setup"] = [f'echo "{STAMP} $(date +%s.%N)" >&2']
    if max_nodes:
        data["nodes"] = {"default": 2, "max": max_nodes}
    folder = tmp / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slurm_test.yaml").write_text(yaml.safe_dump(data))
    return folder


def bench_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, ORCHESTRATOR_HOME=str(tmp / "home"), ORCHESTRATOR_RUNS=str(tmp / "runs"))
    env["PYTHONPATH"] = str(soak.REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ORCHESTRATOR_RUN_DIR", None)
    return env


def drop_caches() -> bool:
    """Empty the page cache (root only); False where the kernel refuses."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def queue_empty(timeout: float = 180) -> None:
    """Wait until no job is left on the cluster (the next job gets idle nodes n1, n2, ...)."""
    if not soak.wait(
        lambda: not soak.run("squeue", "-h", "-o", "%i", timeout=15).stdout.strip(), timeout, 0.2
    ):
        raise RuntimeError(f"jobs still queued after {timeout} s")


def submit(env: dict[str, str], profiles: Path, nodes: int, train_args: list[str]) -> tuple[str, Path]:
    res = soak.cli(
        env,
        "submit",
        "--profile",
        "slurm_test",
        "--profiles-dir",
        str(profiles),
        "--strategy",
        "ddp",
        "--nodes",
        str(nodes),
        "--procs-per-node",
        "1",
        "--",
        soak.TRAIN,
        *train_args,
    )
    if res.returncode != 0:
        raise RuntimeError(f"submit failed: {res.stdout}{res.stderr}")
    return res.stdout.split("submitted job ")[1].split()[0], Path(
        res.stdout.split("run directory ")[1].split()[0]
    )


def events(run_dir: Path) -> dict[str, dict]:
    """The first event of each kind in metrics.jsonl."""
    out: dict[str, dict] = {}
    for e in iter_metrics(run_dir):
        out.setdefault(str(e.get("event")), e)
    return out


def wait_done(job_id: str, timeout: float = 300) -> str:
    done = soak.wait(
        lambda: (
            (s := soak.job_state(job_id)) not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") and s
        ),
        timeout,
        0.3,
    )
    if not done:
        soak.run("scancel", job_id, timeout=30)
        raise RuntimeError(f"job {job_id} still running after {timeout} s")
    return str(done)


def ours(env: dict[str, str], profiles: Path, checkpoint: Path) -> dict[str, Any]:
    job_id, run_dir = submit(env, profiles, NODES, [*TINY, "--max-steps", "3", "--resume", str(checkpoint)])
    state = wait_done(job_id)
    ev = events(run_dir)
    if "train" not in ev or "startup" not in ev:
        raise RuntimeError(f"job {job_id} ({state}) logged no startup/train event in {run_dir}")
    err = (run_dir / "submitit" / f"{job_id}_0_log.err").read_text(errors="replace")
    start = float(STAMP_RE.findall(err)[-1])
    pid_file = run_dir / "logs" / "attempt_0" / "node_0.pid"
    launcher = pid_file.stat().st_mtime
    st, resume, first = ev["startup"], ev.get("resume"), ev["train"]
    load_s = json.loads((run_dir / "loaded.json").read_text())["load_s"] if resume else 0.0
    resumed = float(resume["time"]) if resume else float(st["time"])
    ph = {
        "to_launcher": launcher - start,
        "launcher_to_rank": (st["process"] - launcher) if st.get("process") else None,
        "rank_imports": (st["imports"] - st["process"]) if st.get("process") else None,
        "process_group": st["process_group"] - st["imports"],
        "model": st["model"] - st["process_group"],
        "to_load": resumed - load_s - st["model"],
        "load": load_s,
        "first_step": float(first["time"]) - resumed,
    }
    rec: dict[str, Any] = {
        "job": job_id,
        "state": state,
        "total_s": round(float(first["time"]) - start, 3),
        "to_process_group_s": round(st["process_group"] - start, 3),
        "phases_s": {k: (round(v, 3) if v is not None else None) for k, v in ph.items()},
    }
    stamps = c10d_stamps(pid_file.parent / "node_0.log")
    if "launcher_store" in stamps:
        rec["launcher_store_after_launcher_s"] = round(stamps["launcher_store"] - launcher, 3)
    return rec


def floor(tmp: Path, n: int) -> dict[str, Any]:
    out = tmp / f"floor_{n}.out"
    script = tmp / f"floor_{n}.sh"
    py = shlex.quote(sys.executable)
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --nodes={NODES}\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=1\n"
        f"#SBATCH --partition=debug\n#SBATCH --time=00:10:00\n#SBATCH --mem=1G\n#SBATCH --output={out}\n"
        f'echo "{STAMP} $(date +%s.%N)"\n'
        "export OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0\n"
        'master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        f'srun --kill-on-bad-exit=1 {py} {shlex.quote(str(tmp / "floor.py"))} "$master" {20000 + n}\n'
    )
    res = soak.run("sbatch", "--parsable", str(script), timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch failed: {res.stderr}")
    job_id = res.stdout.strip().split(";")[0]
    state = wait_done(job_id)
    text = out.read_text(errors="replace")
    m = FLOOR_RE.search(text)
    if state != "COMPLETED" or m is None:
        raise RuntimeError(f"floor job {job_id} {state}: {text[-1500:]}")
    st, start = json.loads(m.group(1)), float(STAMP_RE.findall(text)[-1])
    ph = {
        "to_launcher": st["process"] - start,
        "rank_imports": st["imports"] - st["process"],
        "process_group": st["process_group"] - st["imports"],
    }
    return {
        "job": job_id,
        "total_s": round(st["process_group"] - start, 3),
        "with_optimizer_s": round(st["optimizer"] - start, 3),
        "phases_s": {k: round(v, 3) for k, v in ph.items()},
    }


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summarize(recs: list[dict], phases: tuple[str, ...]) -> dict[str, Any]:
    return {
        "reps": len(recs),
        "total_median_s": _median([r["total_s"] for r in recs]),
        "total_all_s": [r["total_s"] for r in recs],
        "phases_median_s": {
            k: _median([r["phases_s"][k] for r in recs if r["phases_s"].get(k) is not None]) for k in phases
        },
    }


def bench_startup(tmp: Path, reps: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    why = cluster_up()
    if why:
        return {"skipped": f"Slurm test cluster not reachable: {why}"}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "floor.py").write_text(FLOOR_SCRIPT)
    profiles, env = profiles_dir(tmp), bench_env(tmp)
    queue_empty()
    # The checkpoint every measured job loads (and the warm-up: caches, Slurm's first job).
    job_id, run_dir = submit(env, profiles, NODES, [*TINY, "--max-steps", "1", "--ckpt-every", "1"])
    state = wait_done(job_id)
    checkpoint = run_dir / "checkpoints" / "step_00000001"
    if not (checkpoint / "COMPLETE.json").exists():
        raise RuntimeError(f"warm-up job {job_id} ({state}) wrote no checkpoint in {run_dir}")
    can_drop = drop_caches()
    recs: dict[str, dict[str, list[dict]]] = {c: {"ours": [], "floor": []} for c in ("warm", "cold")}
    n = 0
    for r in range(reps):
        for ci, cache in enumerate(("warm", "cold") if can_drop else ("warm",)):
            order = ["floor", "ours"] if (r + ci) % 2 == 0 else ["ours", "floor"]
            for variant in order:
                queue_empty()
                if cache == "cold":
                    drop_caches()
                n += 1
                rec = floor(tmp, n) if variant == "floor" else ours(env, profiles, checkpoint)
                recs[cache][variant].append(rec)
                log(f"startup {cache} {variant} rep {r + 1}/{reps}: {rec['total_s']} s {rec['phases_s']}")
    out: dict[str, Any] = {
        "nodes": NODES,
        "procs_per_node": 1,
        "strategy": "ddp",
        "train_args": [*TINY, "--max-steps", "3", "--resume", "<checkpoint of step 1>"],
        "cold_cache": "measured" if can_drop else "not measured: /proc/sys/vm/drop_caches refused",
    }
    for cache, by in recs.items():
        if not by["ours"]:
            continue
        o, f = summarize(by["ours"], PHASES), summarize(by["floor"], FLOOR_PHASES)
        o["to_process_group_median_s"] = _median([r["to_process_group_s"] for r in by["ours"]])
        # launcher_to_rank split: the launcher's own start-up (imports, agent) until its TCPStore is up.
        o["launcher_store_after_launcher_median_s"] = _median(
            [
                r["launcher_store_after_launcher_s"]
                for r in by["ours"]
                if "launcher_store_after_launcher_s" in r
            ]
        )
        out[cache] = {
            "ours": o,
            "floor": f,
            "ratio": round(o["total_median_s"] / f["total_median_s"], 2),
            "ratio_to_process_group": round(o["to_process_group_median_s"] / f["total_median_s"], 2),
            "floor_with_optimizer_median_s": _median([r["with_optimizer_s"] for r in by["floor"]]),
            # Ours over floor + optimizer within each repetition (the two ran back to back).
            "pair_ratios_with_optimizer": [
                round(a["total_s"] / b["with_optimizer_s"], 3)
                for a, b in zip(by["ours"], by["floor"], strict=False)
            ],
            "records": by,
        }
    return out


def goal_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    label = (
        "start-up on the nodes (batch script -> first step, 2 nodes x 1, ddp, tiny, with a checkpoint load)"
    )
    if s.get("skipped") or "warm" not in s:
        why = s.get("skipped") or s.get("error") or "no figures"
        return [
            {
                "item": label,
                "goal": "<= 1.2x floor",
                "measured": f"not measured: {why}",
                "ratio": "n/a",
                "met": None,
            }
        ]
    rows = []
    for cache, what in (
        ("warm", "warm page cache (proxy: venv on node-local disk)"),
        ("cold", "cold page cache (proxy: venv on a shared filesystem)"),
    ):
        c = s.get(cache)
        if not c:
            continue
        o, f = c["ours"], c["floor"]
        split = ", ".join(
            f"{k.replace('_', ' ')} {v:.2f}" for k, v in o["phases_median_s"].items() if v is not None
        )
        fsplit = ", ".join(
            f"{k.replace('_', ' ')} {v:.2f}" for k, v in f["phases_median_s"].items() if v is not None
        )
        pairs = c.get("pair_ratios_with_optimizer") or []
        with_opt = c.get("floor_with_optimizer_median_s")
        ratio = statistics.median(pairs) if pairs else None
        rows.append(
            {
                "item": f"{label}, {what}, {o['reps']} reps, Slurm test cluster (netns nodes, one shared disk)",
                "goal": "<= 1.2x floor: import torch, accelerate + one gloo process group + one torch.optim "
                "optimizer built (its torch._dynamo import, which any script with an optimizer pays; the "
                "issue's floor leaves it out), srun, same nodes",
                "measured": f"{o['total_median_s']:.2f} s ({split}) vs floor + AdamW "
                + (f"{with_opt:.2f} s" if with_opt else "n/a")
                + f" (pair ratios {_span(pairs)}); the issue's floor {f['total_median_s']:.2f} s ({fsplit}): "
                f"{c['ratio']:.2f}x, ours to process group {o['to_process_group_median_s']:.2f} s = "
                f"{c['ratio_to_process_group']:.2f}x",
                "ratio": f"{ratio:.2f}x (median of pair ratios)" if ratio is not None else "n/a",
                "met": ratio is not None and ratio <= 1.2,
            }
        )
    return rows


def _span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "n/a"
