"""``orchestrator list [--state S] [--since T] [--json]``: jobs in the registry.

Reads only the registry (no scheduler query), so it is instant even with thousands of jobs; the
state shown is the last one recorded (``status`` refreshes it). The module is ``list_jobs`` rather
than ``list`` so it does not shadow the builtin inside the package.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING

from orchestrator import api
from orchestrator.cli.table import dumps_indented
from orchestrator.contract.errors import UserError
from orchestrator.contract.job_states import parse_state

if TYPE_CHECKING:
    from orchestrator.api import JobRecord

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
COLUMNS = ("JOB", "NAME", "STATE", "SCHEDULER", "PROFILE", "STRATEGY", "NODES", "SUBMITTED", "RUN_DIR")


def parse_since(text: str, now: float | None = None) -> float:
    """``30m``, ``2h``, ``3d``, ``1w`` ago, or an ISO date/datetime (local time if no zone) -> unix time."""
    now = time.time() if now is None else now
    m = _RELATIVE.match(text)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UserError(
            f"--since {text!r}: expected a duration like 30m, 2h, 3d, 1w or an ISO date like 2025-01-31"
        ) from None
    return when.timestamp()


def format_time(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def render_list_table(jobs: list[JobRecord]) -> str:
    cells = [
        [
            j.job_id,
            j.name,
            j.last_state.value,
            j.scheduler,
            j.profile,
            j.strategy,
            str(j.nodes),
            format_time(j.submitted_at),
            str(j.run_dir),
        ]
        for j in jobs
    ]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(COLUMNS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths, strict=True)).rstrip()]
    lines.extend("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip() for c in cells)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state", metavar="S", help="only jobs whose last recorded state is S (e.g. RUNNING)"
    )
    parser.add_argument(
        "--since", metavar="T", help="only jobs submitted since T (30m, 2h, 3d, 1w or ISO date)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--sweeps", action="store_true", help="list sweeps instead of jobs")


def run(args: argparse.Namespace) -> int:
    if args.sweeps and (args.state or args.since):
        # They filter jobs; a sweep has no one state (its tasks do), and ignoring them listed every sweep.
        flag = "--state" if args.state else "--since"
        raise UserError(
            f"{flag}: filters jobs, not sweeps; drop it, or list the jobs (without --sweeps), "
            "or see one sweep's tasks with `orchestrator status SWEEP`"
        )
    state = None
    if args.state:
        try:
            state = parse_state(args.state)
        except ValueError as exc:
            raise UserError(f"--state: {exc}") from None
    since = parse_since(args.since) if args.since else None
    with api.open_registry() as registry:
        for line in api.reconcile(registry):  # a submit killed mid-way: adopt or clean up
            print(line, file=sys.stderr)
        if args.sweeps:
            from orchestrator.cli.sweep_view import render_sweep_list, sweep_list_json

            sweeps = api.list_sweeps(registry)
            print(
                sweep_list_json(sweeps) if args.json else render_sweep_list(sweeps) if sweeps else "no sweeps"
            )
            return 0
        jobs = api.list_jobs(state, since, registry)
        for line in registry.bad_rows:  # the other jobs are listed; the bad row is named
            print(f"warning: {line}", file=sys.stderr)
    if args.json:
        print(dumps_indented([j.to_json() for j in jobs]))
        return 0
    from orchestrator.remote.book import elsewhere_note

    note = elsewhere_note("list")
    if note:
        print(note, file=sys.stderr)
    if jobs:
        print(render_list_table(jobs))
    else:
        print("no jobs match" if (state or since) else "no jobs in the registry yet")
    return 0
