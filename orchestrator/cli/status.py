"""``orchestrator status [JOB...] [--watch] [--interval S] [--json]``.

Scheduler state and training progress for many jobs at once (``orchestrator.api.status``: one
batched scheduler query for all jobs, progress from the tail of each run's metrics.jsonl). When the
scheduler cannot be asked, the registry's last known state is shown with a ``(stale)`` marker
instead of failing or hanging.

:func:`render_status_table` is the table of this command's rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from orchestrator import api
from orchestrator.cli.cost import bill_line
from orchestrator.cli.table import dumps_indented
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from orchestrator.api import StatusRow

COLUMNS = ("JOB", "NAME", "STATE", "STRATEGY", "NODES", "STEP", "LOSS", "TOK/S", "ETA", "CKPT", "REQUEUES")


# ---------------------------------------------------------------------------- formatting
def format_duration(seconds: float | None) -> str:
    """``45s``, ``12m05s``, ``3h07m``, ``2d04h`` -- compact enough for a table column."""
    if seconds is None:
        return "-"
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def format_rate(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def format_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _cells(row: StatusRow) -> list[str]:
    state = row.state.value
    if row.state_detail is not None:
        state += f" ({row.state_detail})"  # e.g. RUNNING (COMPLETING): the mapping hides detail
    if row.stale:
        state += " (stale)"
    if row.continued_as is not None and row.run_state is not None:
        state += f" -> {row.continued_as} {row.run_state.value}"
    step = "-" if row.step is None else str(row.step)
    if row.step is not None and row.max_steps:
        step = f"{row.step}/{row.max_steps}"
    return [
        row.job_id,
        row.name,
        state,
        row.strategy,
        str(row.nodes),
        step,
        format_loss(row.loss),
        format_rate(row.tokens_per_s),
        format_duration(row.eta_s) if row.eta_s is not None else "-",
        str(row.checkpoint_step) if row.checkpoint_step is not None else "-",
        str(row.requeues),
    ]


def render_status_table(rows: Sequence[StatusRow]) -> str:
    """Plain-text status table (no trailing newline); ``(stale)`` marks non-live states."""
    cells = [_cells(r) for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(COLUMNS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths, strict=True)).rstrip()]
    lines.extend("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip() for c in cells)
    return "\n".join(lines)


# ---------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="job ids (default: active and recent jobs)")
    parser.add_argument(
        "--watch",
        action="store_true",
        help="refresh until every shown job has ended; exit 0 if all completed, 1 otherwise",
    )
    parser.add_argument("--interval", type=float, default=5.0, metavar="S", help="seconds between refreshes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="bound on the scheduler query (default 5)"
    )
    parser.add_argument(
        "--cost",
        action="store_true",
        help="add each job's bill (`orchestrator cost JOB --run`: goodput, allocated hours, waste by "
        "cause); one accounting query per shown run",
    )
    parser.add_argument(
        "--metric",
        default="loss",
        choices=["loss", "val_loss", "tokens_per_s"],
        help="status SWEEP: the metric its best task is chosen by (default loss, lowest)",
    )


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise UserError(f"--interval must be positive, not {args.interval}")
    if args.timeout <= 0:
        raise UserError(f"--timeout must be positive, not {args.timeout}")
    with api.open_registry() as registry:
        for line in api.reconcile(registry):  # a submit killed mid-way: adopt or clean up
            print(line, file=sys.stderr)
        sweep = api.find_sweep(args.jobs[0], registry=registry) if len(args.jobs) == 1 else None
        if sweep is not None and not args.watch:
            from orchestrator.cli.sweep_view import print_sweep_status

            print_sweep_status(api.sweep_status(registry, args.jobs[0], args.metric, args.timeout), args.json)
            return 0
        if sweep is not None:  # --watch SWEEP: its tasks' rows until every one has ended
            args.jobs = sweep.job_ids
        while True:
            report = api.status(args.jobs, timeout_s=args.timeout, registry=registry)
            for line in registry.bad_rows:  # the other jobs are shown; the bad row is named
                print(f"warning: {line}", file=sys.stderr)
            registry.bad_rows.clear()
            if not args.jobs and not args.json and not args.watch:
                _note_login_hosts()
            if report is None:
                if args.json:
                    print(json.dumps({"source": "registry", "stale": False, "errors": [], "jobs": []}))
                else:
                    print("no active or recent jobs (see `orchestrator list`)")
                return 0
            bills = _bills(report.rows, args.timeout) if args.cost else {}
            if args.json:
                data = report.to_json()
                for job in data["jobs"]:
                    if job["job_id"] in bills:
                        job["cost"] = bills[job["job_id"]]
                print(json.dumps(data) if args.watch else dumps_indented(data), flush=True)
            else:
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")
                if args.watch:
                    print(time.strftime("%Y-%m-%d %H:%M:%S"))
                print(render_status_table(report.rows))
                for job_id, bill in bills.items():
                    print(bill_line(job_id, bill))
                for line in report.failure_lines():
                    print(line)
                for line in report.liveness_lines():
                    print(line)
                note = report.stale_note()
                if note:
                    print(note, file=sys.stderr)
                sys.stdout.flush()
            if not args.watch:
                # The process ends now: its objects need no collection on the way out (the final
                # collection at interpreter exit walked all of them, ~2% of a 1,000-job call).
                gc.freeze()
                return 0
            if report.all_ended():
                # --watch ends with the outcome, like `wait`: 0 only if every shown run completed.
                return 0 if report.all_completed() else 1
            time.sleep(args.interval)


def _note_login_hosts() -> None:
    """Jobs this laptop submitted through a login host are not in its registry: say where they are."""
    from orchestrator.remote.book import elsewhere_note

    note = elsewhere_note("status")
    if note:
        print(note, file=sys.stderr)


def _bills(rows: Sequence[StatusRow], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Each shown job's run bill (``cost JOB --run --json``), or ``{"error": why}`` where there is
    none (no accounting, no step yet): ``status`` still shows every row."""
    bills: dict[str, dict[str, Any]] = {}
    for row in rows:
        try:
            bills[row.job_id] = api.cost(row.job_id, whole_run=True, timeout_s=timeout_s).to_json()
        except UserError as exc:
            bills[row.job_id] = {"error": str(exc)}
    return bills
