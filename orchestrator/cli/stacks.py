"""``orchestrator stacks JOB``: every rank's Python stack now, on demand.

For a job that looks stuck (``status`` shows a long time without output), including scripts that
send no heartbeats. On a cluster the dumps run on the job's own nodes, as one extra step beside the
training (py-spy on each node); local jobs are dumped in place. The stacks are saved under
``<run_dir>/hang/attempt_<A>/stacks_<time>/`` and summarised here (:func:`orchestrator.api.stacks`).
"""

from __future__ import annotations

import argparse
import sys

from orchestrator import api
from orchestrator.contract.errors import EXIT_OK, EXIT_RUN_FAILURE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("--json", action="store_true", help="one JSON object: every rank's record")


def run(args: argparse.Namespace) -> int:
    import json

    dump = api.stacks(args.job)
    records = dump.records
    if args.json:
        print(json.dumps(dump.to_json()))
        return EXIT_OK if records else EXIT_RUN_FAILURE
    if not records:
        print(
            f"job {dump.job_id}: no training process of attempt {dump.attempt} found {dump.problem}".rstrip(),
            file=sys.stderr,
        )
        return EXIT_RUN_FAILURE
    for r in records:
        where = "inside a collective" if r["in_collective"] else "not in a collective"
        frames = "; ".join(r["stack_tail"]) or "(no Python frames)"
        print(f"rank {r['rank']} node {r['host']} pid {r['pid']} {r['state']}, {where}: {frames}")
    if dump.culprit is not None:
        print(f"rank {dump.culprit[0]} on {dump.culprit[1]} differs: {dump.culprit[2]}")
    if dump.problem:
        print(f"note: {dump.problem}", file=sys.stderr)
    print(f"stacks of {len(records)} rank(s) in {dump.folder}")
    return EXIT_OK
