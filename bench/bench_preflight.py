"""Preflight cost on the Slurm test cluster (goal, issue 13: <= 10 s).

For 2 and 3 nodes, ``--reps`` jobs are submitted through the CLI with the preflight on. Candidate:
the preflight's own seconds (``preflight/attempt_0/preflight.json``, measured by the batch step
around its srun step: start-up of every node's Python and torch, the rendezvous, the local checks and
the transfers). Baseline, in the same job just before it (a ``setup:`` line of the profile): a bare
srun step of ``python -c pass`` over the same nodes, the floor of any step of this kind. Each job is
cancelled once its preflight is over (training is not what is measured). Medians and the ratio go
to bench/results_preflight.json.

    set -a; . /tmp/orchestrator-slurm/cluster.env; set +a
    python bench/bench_preflight.py [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from orchestrator.contract.run_dir import preflight_dir, read_json  # noqa: E402

FLOOR_RE = re.compile(r"bench_srun_floor ([0-9.]+) ([0-9.]+)")


def profile_dir(tmp: Path) -> Path:
    data = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
    data["preflight"] = {"enabled": True}
    floor = (
        "__s=$(date +%s.%N); srun --ntasks-per-node=1 --quiet "
        f"{shlex.quote(sys.executable)} -c pass; "
        'echo "bench_srun_floor $__s $(date +%s.%N)" >&2'
    )
    data["setup"] = [floor]
    folder = tmp / "profiles"
    folder.mkdir()
    (folder / "slurm_test.yaml").write_text(yaml.safe_dump(data))
    return folder


def one_job(env: dict[str, str], script: Path, nodes: int) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, "-m", "orchestrator", "submit", "--profile", "slurm_test", "--nodes", str(nodes)]
        + ["--procs-per-node", "1", "--", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    job_id = res.stdout.split("submitted job ")[1].split()[0]
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    try:
        deadline = time.monotonic() + 180
        report = None
        while time.monotonic() < deadline and report is None:
            report = read_json(preflight_dir(run_dir, 0) / "preflight.json")
            time.sleep(0.3)
        if report is None:
            raise RuntimeError(f"job {job_id}: no preflight.json within 180 s")
        log = "".join(
            p.read_text(errors="replace") for p in (run_dir / "submitit").glob(f"{job_id}_0_log.err")
        )
        floor = FLOOR_RE.search(log)
        return {
            "job": job_id,
            "nodes": nodes,
            "preflight_s": report["seconds"],
            "srun_floor_s": round(float(floor.group(2)) - float(floor.group(1)), 2) if floor else None,
            "failed": report["failed"],
            "links": report["links"],
        }
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results_preflight.json")))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "noop.py"
        script.write_text("print('ok')\n")
        env = dict(os.environ)
        env.update(
            ORCHESTRATOR_HOME=str(tmp / "home"),
            ORCHESTRATOR_RUNS=str(tmp / "runs"),
            ORCHESTRATOR_PROFILES=str(profile_dir(tmp)),
            PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        for _ in range(args.reps):
            for nodes in (2, 3):
                row = one_job(env, script, nodes)
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = {}
    for nodes in (2, 3):
        mine = [r for r in rows if r["nodes"] == nodes]
        pre = statistics.median(r["preflight_s"] for r in mine)
        floors = [r["srun_floor_s"] for r in mine if r["srun_floor_s"] is not None]
        floor = statistics.median(floors) if floors else None
        summary[f"{nodes}_nodes"] = {
            "preflight_median_s": pre,
            "srun_floor_median_s": floor,
            "ratio": round(pre / floor, 2) if floor else None,
            "goal_s": 10,
            "met": pre <= 10,
        }
    out = {"time": time.time(), "load_avg": os.getloadavg(), "summary": summary, "runs": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
