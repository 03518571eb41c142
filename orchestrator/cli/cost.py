"""``orchestrator cost JOB|RUN_DIR|SWEEP [--run] [--json]``: where the allocated hours went.

The bill (:func:`orchestrator.api.cost`): allocated GPU-hours (CPU-hours on a cluster without GPUs)
split into productive time and waste by cause, goodput, and money where the profile has a price.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from orchestrator import api


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="JOB|RUN_DIR|SWEEP", help="a job id, a run directory or a sweep id")
    parser.add_argument("--run", action="store_true", help="a job id stands for every job of its run")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds for the scheduler's accounting")


def render(data: dict[str, Any]) -> str:
    """The bill as a table: hours, share of the allocation and money per category."""
    unit = data["unit"].upper() if data["unit"] in ("gpu", "cpu") else data["unit"]
    total = data["allocated_hours"]
    price = data["price_per_hour"]
    lines = [f"{data['kind']} {data['target']}: {total:.4f} {unit}-hours allocated"]
    if data["goodput"] is not None:
        lines[0] += f", goodput {100 * data['goodput']:.1f} %"
    for key, label in data["labels"].items():
        hours = data["hours"][key]
        if hours == 0 and key not in ("productive",):
            continue
        share = f"{100 * hours / total:5.1f} %" if total else "    -"
        money = f"  {hours * price:10.2f}" if price is not None else ""
        lines.append(f"  {label:<31} {hours:10.4f} h {share}{money}")
    waited = data["unbilled_s"]
    lines.append(
        f"  not billed: queue wait {waited['queue_wait']:.0f} s, requeue/continue gaps {waited['requeue_gap']:.0f} s"
    )
    for a in data["attempts"]:
        secs = {k: v for k, v in a["seconds"].items() if v}
        parts = ", ".join(f"{k} {v:.1f}" for k, v in secs.items())
        lines.append(
            f"  job {a['job_id']} attempt {a['attempt'] if a['attempt'] is not None else '?'}: "
            f"{a['allocated_s']:.1f} s x {a['resources']} {a['unit']} ({parts})"
        )
    for task in data.get("tasks", []):
        good = task["goodput"]
        lines.append(
            f"  task {task['task']} ({task['job_id']}): {task['allocated_hours']:.4f} h"
            + (f", goodput {100 * good:.1f} %" if good is not None else "")
        )
    best = data.get("best")
    if best:
        lines.append(
            f"  best loss {best['loss']:.4f}: task {best['task']} ({best['job_id']}) at step {best['step']}, "
            f"reached after {best['hours_to_reach']:.4f} {unit}-hours of the sweep"
        )
    lines.extend(f"  note: {n}" for n in data["notes"])
    return "\n".join(lines)


def bill_line(job_id: str, data: dict[str, Any]) -> str:
    """One line of a run's bill under ``status --cost``: goodput, hours, money, the largest waste."""
    if "error" in data:
        return f"job {job_id}: no bill: {data['error']}"
    if not data["attempts"]:
        return f"job {job_id}: no bill: {data['notes'][0] if data['notes'] else 'no allocation recorded'}"
    unit = data["unit"].upper() if data["unit"] in ("gpu", "cpu") else data["unit"]
    total = data["allocated_hours"]
    line = f"job {job_id}: {total:.4f} {unit}-hours allocated"
    if data["goodput"] is not None:
        line += f", goodput {100 * data['goodput']:.1f} %"
    if data["money"] is not None:
        line += f", {data['money']['allocated']:.2f} at {data['price_per_hour']:g}/hour"
    waste = {k: v for k, v in data["hours"].items() if k != "productive" and v > 0}
    if waste and total:
        worst = max(waste, key=lambda k: waste[k])
        line += f"; most waste: {data['labels'][worst]} {100 * waste[worst] / total:.1f} %"
    return line


def run(args: argparse.Namespace) -> int:
    report = api.cost(args.target, whole_run=args.run, timeout_s=args.timeout)
    data = report.to_json()
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0
