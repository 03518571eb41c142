"""Launch cost against node count on the Slurm test cluster (issue 16, item 5).

At 2, 4, 8 and 16 nodes (those the running cluster has: ``ORCHESTRATOR_TEST_CLUSTER_NODES``), one
tiny rank per node, ``reps`` rounds, the two variants interleaved (order flipped every round and
node count), each timed from the moment its submit command starts to the first ``train`` event in
its metrics.jsonl:

* ours: ``orchestrator submit --profile slurm_test --strategy ddp --nodes N --procs-per-node 1 --
  train/train.py --preset tiny --data synthetic --max-steps 2`` (the profile's ``nodes.max`` raised
  to the cluster's size);
* baseline: ``sbatch`` of a hand-written script, ``srun`` of ``accelerate launch --config_file
  node_${SLURM_NODEID}.yaml train/train.py ...``, with the N per-node Accelerate configs written by
  hand before submission (static rendezvous on n1's address, the keys orchestrator renders for ddp,
  the profile's environment and ``ACCELERATE_USE_CPU=1``, as orchestrator's node entry gives it).

Between jobs the bench waits for an empty queue, so every job gets idle nodes n1..nN. Writes a PNG
(medians of both against node count, and their ratio) with matplotlib when it is installed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak_preemption as soak  # noqa: E402
from bench_requeue import cluster_up  # noqa: E402
from bench_startup import bench_env, events, profiles_dir, queue_empty, submit, wait_done  # noqa: E402

COUNTS = (2, 4, 8, 16)
TRAIN_ARGS = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64"]
TRAIN_ARGS += ["--max-steps", "2", "--log-every", "1"]
PNG = Path(__file__).resolve().parent / "launch_vs_nodes.png"


def counts_available() -> list[int]:
    have = int(os.environ.get("ORCHESTRATOR_TEST_CLUSTER_NODES", "0") or 0)
    return [n for n in COUNTS if n <= have]


def hand_config(nodes: int, rank: int, master: str, port: int) -> str:
    """What a user writes for node ``rank`` of ``nodes`` (the keys orchestrator renders for ddp)."""
    return (
        "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: MULTI_GPU\n"
        "downcast_bf16: 'no'\nenable_cpu_affinity: false\ngpu_ids: all\n"
        f"machine_rank: {rank}\nmain_process_ip: {master}\nmain_process_port: {port}\n"
        f"main_training_function: main\nmixed_precision: 'no'\nnum_machines: {nodes}\n"
        f"num_processes: {nodes}\nrdzv_backend: static\nsame_network: true\n"
        "tpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: false\n"
    )


class JobEnded(RuntimeError):
    """The job ended (or never ran) before its first step: Slurm failed it, it is not a timing."""


def first_step_after(run_dir_glob: tuple[Path, str], t0: float, job: str, timeout: float = 400) -> float:
    """Seconds from ``t0`` to the first train event in the (first) metrics.jsonl the glob finds."""
    root, pattern = run_dir_glob
    checked = [time.perf_counter()]

    def seen() -> float | None:
        for path in root.glob(pattern):
            if "train" in events(path.parent):
                return time.perf_counter() - t0
        if time.perf_counter() - checked[0] > 2:  # a failed job (seen once: slurmd lost its script)
            checked[0] = time.perf_counter()
            state = soak.job_state(job)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN"):
                raise JobEnded(f"job {job} {state} before its first step (under {root})")
        return None

    got = soak.wait(seen, timeout, 0.05)
    if got is None:
        soak.run("scancel", job, timeout=30)
        raise RuntimeError(f"no first step under {root} within {timeout} s")
    return float(got)


if TYPE_CHECKING:
    from typing import TypeVarTuple, Unpack  # Python >= 3.11 (requires-python is 3.10): typing only

    Ts = TypeVarTuple("Ts")


def timed_job(
    fn: Callable[[Unpack[Ts], int], float],
    log: Callable[[str], None],
    *args: Unpack[tuple[Unpack[Ts], int]],
) -> float:
    """``fn(*args)``, once more if Slurm failed the job before it trained (logged, not timed)."""
    try:
        return fn(*args)
    except JobEnded as exc:
        log(f"nodes: {exc}; once more")
        queue_empty()
        return fn(*args[:-1], args[-1] + 1000)  # a fresh folder (and port)


def ours(tmp: Path, profiles: Path, nodes: int, i: int) -> float:
    env = bench_env(tmp / f"o{i}")
    t0 = time.perf_counter()
    job, _run_dir = submit(env, profiles, nodes, list(TRAIN_ARGS))
    took = first_step_after((tmp / f"o{i}" / "runs", "*/metrics.jsonl"), t0, job)
    wait_done(job)
    return took


def baseline(tmp: Path, nodes: int, i: int) -> float:
    d = tmp / f"b{i}"
    d.mkdir(parents=True)
    names = os.environ.get("ORCHESTRATOR_TEST_CLUSTER_NODE_NAMES", "").split(",")
    addrs = os.environ.get("ORCHESTRATOR_TEST_CLUSTER_NODE_ADDRS", "").split(",")
    port = 21000 + i
    for rank in range(nodes):
        (d / f"node_{rank}.yaml").write_text(hand_config(nodes, rank, addrs[0], port))
    acc = shutil.which("accelerate") or "accelerate"
    launch = (
        f"exec {shlex.quote(acc)} launch --config_file {shlex.quote(str(d))}/node_${{SLURM_NODEID}}.yaml "
        f"{shlex.quote(soak.TRAIN)} {' '.join(TRAIN_ARGS)} --run-dir {shlex.quote(str(d / 'run'))}"
    )
    script = d / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --nodes={nodes}\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=1\n"
        f"#SBATCH --partition=debug\n#SBATCH --time=00:10:00\n#SBATCH --mem=1G\n"
        f"#SBATCH --nodelist={','.join(names[:nodes])}\n#SBATCH --output={d}/slurm-%j.out\n"
        "export OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 ACCELERATE_USE_CPU=1\n"
        f"export PYTHONPATH={shlex.quote(str(soak.REPO))}\n"
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(launch)}\n"
    )
    t0 = time.perf_counter()
    res = soak.run("sbatch", "--parsable", str(script), timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch failed: {res.stderr}")
    job = res.stdout.strip().split(";")[0]
    took = first_step_after((d, "run/metrics.jsonl"), t0, job)
    wait_done(job)
    return took


def bench_nodes(
    tmp: Path, reps: int, log: Callable[[str], None] = print, png: Path | None = PNG
) -> dict[str, Any]:
    why = cluster_up()
    if why:
        return {"skipped": f"Slurm test cluster not reachable: {why}"}
    counts = counts_available()
    if not counts:
        return {"skipped": "the test cluster has fewer than 2 nodes (ORCHESTRATOR_TEST_CLUSTER_NODES)"}
    tmp.mkdir(parents=True, exist_ok=True)
    profiles = profiles_dir(tmp, max_nodes=max(counts))
    got: dict[int, dict[str, list[float]]] = {n: {"ours": [], "baseline": []} for n in counts}
    i = 0
    queue_empty()
    # Warm-up (discarded): page cache, Slurm's first allocation of the largest count.
    for fn in (ours, lambda t, p, n, k: baseline(t, n, k)):
        i += 1
        fn(tmp, profiles, counts[-1], i)
        queue_empty()
    for r in range(reps):
        for ni, nodes in enumerate(counts):
            order = ["ours", "baseline"] if (r + ni) % 2 == 0 else ["baseline", "ours"]
            for variant in order:
                i += 1
                queue_empty()
                if variant == "ours":
                    took = timed_job(ours, log, tmp, profiles, nodes, i)
                else:
                    took = timed_job(baseline, log, tmp, nodes, i)
                got[nodes][variant].append(round(took, 3))
                log(f"nodes {nodes} {variant} rep {r + 1}/{reps}: {took:.2f} s")
    by_count = {}
    for nodes, v in got.items():
        o, b = statistics.median(v["ours"]), statistics.median(v["baseline"])
        by_count[str(nodes)] = {
            "ours_median_s": round(o, 3),
            "baseline_median_s": round(b, 3),
            "ratio": round(o / b, 3),
            "ours_all_s": v["ours"],
            "baseline_all_s": v["baseline"],
        }
    out: dict[str, Any] = {
        "counts": counts,
        "reps": reps,
        "train_args": TRAIN_ARGS,
        "strategy": "ddp",
        "procs_per_node": 1,
        "by_count": by_count,
    }
    if png is not None:
        out["png"] = plot(by_count, png)
    return out


def plot(by_count: dict[str, dict], png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not installed (the plot extra)"
    xs = sorted(int(n) for n in by_count)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (
        ("ours_median_s", "orchestrator submit"),
        ("baseline_median_s", "sbatch + srun + accelerate launch"),
    ):
        a.plot(xs, [by_count[str(n)][key] for n in xs], marker="o", label=label)
    a.set(xlabel="nodes (1 rank each)", ylabel="submit -> first step, median (s)", xscale="log", xticks=xs)
    a.set_xticklabels([str(n) for n in xs])
    a.minorticks_off()
    a.legend()
    b.plot(xs, [by_count[str(n)]["ratio"] for n in xs], marker="o", color="C2")
    b.axhline(1.15, linestyle="--", color="grey", label="goal 1.15x")
    b.set(xlabel="nodes (1 rank each)", ylabel="ours / baseline", xscale="log", xticks=xs)
    b.set_xticklabels([str(n) for n in xs])
    b.minorticks_off()
    b.legend()
    fig.suptitle("Launch cost vs node count (Slurm test cluster, 2 shared cores)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png)


def goal_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    label = "launch vs node count (submit -> first step, 1 tiny rank per node, ddp) vs sbatch + srun + accelerate launch"
    if s.get("skipped") or "by_count" not in s:
        why = s.get("skipped") or s.get("error") or "no figures"
        return [
            {
                "item": label,
                "goal": "<= 1.15x",
                "measured": f"not measured: {why}",
                "ratio": "n/a",
                "met": None,
            }
        ]
    rows = []
    for n, c in s["by_count"].items():
        rows.append(
            {
                "item": f"{label}, {n} nodes, {s['reps']} reps, Slurm test cluster (netns nodes)",
                "goal": "<= 1.15x",
                "measured": f"{c['ours_median_s']:.2f} s vs {c['baseline_median_s']:.2f} s",
                "ratio": f"{c['ratio']:.2f}x",
                "met": c["ratio"] <= 1.15,
            }
        )
    return rows
