"""``orchestrator stacks JOB``: every rank's Python stack now, on demand.

For a job that looks stuck (``status`` shows a long time without output), including scripts that
send no heartbeats. On a cluster the dumps run on the job's own nodes, as one extra step beside the
training (``srun --jobid JOB --overlap``, py-spy on each node); local jobs are dumped in place.
The stacks are saved under ``<run_dir>/hang/attempt_<A>/stacks_<time>/`` and summarised here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.contract.errors import EXIT_OK, EXIT_RUN_FAILURE, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("--json", action="store_true", help="one JSON object: every rank's record")


def job_nodes(job_id: str) -> list[str]:
    """The running job's nodes (squeue), expanded."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        if not out:
            return []
        return subprocess.run(
            ["scontrol", "show", "hostnames", out], capture_output=True, text=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return []


def run(args: argparse.Namespace) -> int:
    import json

    from orchestrator.contract.run_dir import attempt_dirs, hang_dir
    from orchestrator.registry.store import Registry
    from orchestrator.schedulers import get_scheduler
    from orchestrator.supervise.stacks import collect, collect_here, find_culprit
    from orchestrator.supervise.watchdog import srun_on_every_node

    with Registry.open() as registry:
        job = registry.get(args.job)
    run_dir = Path(job.run_dir)
    attempts = attempt_dirs(run_dir)
    if not attempts:
        raise UserError(f"job {job.job_id}: no attempt has started in {run_dir} yet")
    attempt = attempts[-1][0]
    out_dir = hang_dir(run_dir, attempt) / time.strftime("stacks_%Y%m%d-%H%M%S")
    problem = ""
    if get_scheduler(job.scheduler).can_lose_nodes:  # nodes of their own: dump on each, inside the job
        nodes = job_nodes(job.job_id)
        if not nodes:
            raise UserError(f"job {job.job_id} is not running (squeue lists no nodes for it)")
        records, problem = collect(srun_on_every_node(nodes, job.job_id), run_dir, attempt, out_dir)
    else:
        records = collect_here(str(run_dir), attempt, out_dir)
    if args.json:
        print(
            json.dumps({"job_id": job.job_id, "attempt": attempt, "folder": str(out_dir), "ranks": records})
        )
        return EXIT_OK if records else EXIT_RUN_FAILURE
    if not records:
        print(
            f"job {job.job_id}: no training process of attempt {attempt} found {problem}".rstrip(),
            file=sys.stderr,
        )
        return EXIT_RUN_FAILURE
    for r in records:
        where = "inside a collective" if r["in_collective"] else "not in a collective"
        frames = "; ".join(r["stack_tail"]) or "(no Python frames)"
        print(f"rank {r['rank']} node {r['host']} pid {r['pid']} {r['state']}, {where}: {frames}")
    culprit = find_culprit(records, {})
    if culprit is not None:
        print(f"rank {culprit[0]} on {culprit[1]} differs: {culprit[2]}")
    if problem:
        print(f"note: {problem}", file=sys.stderr)
    print(f"stacks of {len(records)} rank(s) in {out_dir}")
    return EXIT_OK
