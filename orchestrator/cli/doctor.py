"""``orchestrator doctor PROFILE [--nodes N] [--json]``: a short job on N nodes that checks what a
job relies on and prints each check with the fix for each failure. Exit 0 when a job would run, 1
otherwise, 2 for bad input (an unknown profile, a node count the profile does not allow)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from orchestrator.cli.profiles import PROFILES_DIR_HELP
from orchestrator.cli.table import format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="the profile to check (a name or a YAML path)")
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="how many nodes to check together (default: the profile's nodes.default)",
    )
    parser.add_argument("--json", action="store_true", help="every check as JSON")
    parser.add_argument("--profiles-dir", default=None, help=PROFILES_DIR_HELP)


def table_rows(rows: Sequence[Any]) -> list[dict[str, str]]:
    """The diagnosis' rows (``check``, ``node``, ``ok``, ``value``) as the table shows them: one line
    per check that passed on every node (its values, when they differ), one per node where it failed:
    32 nodes stay a short table (``--json`` keeps every row)."""
    out: list[dict[str, str]] = []
    for check in dict.fromkeys(r.check for r in rows):
        mine = [r for r in rows if r.check == check]
        if all(r.ok for r in mine) and len(mine) > 1:
            values = list(dict.fromkeys(r.value for r in mine))
            shown = " | ".join(values[:3]) + (" | ..." if len(values) > 3 else "")
            out.append({"check": check, "node": f"all {len(mine)}", "result": "ok", "value": shown})
            continue
        for r in mine:
            out.append(
                {"check": r.check, "node": r.node, "result": "ok" if r.ok else "FAIL", "value": r.value}
            )
    return out


def run(args: argparse.Namespace) -> int:
    from orchestrator import api

    result = api.doctor(args.profile, nodes=args.nodes, profiles_dir=args.profiles_dir)
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
        return 0 if result.ok else 1
    print(format_table(table_rows(result.diagnosis.rows), ["check", "node", "result", "value"]))
    failed = result.diagnosis.failed
    if failed:
        print(f"\n{len(failed)} check(s) failed; the fixes:")
        for r in failed:
            print(f"  {r.check} on {r.node}: {r.fix}")
        if result.folder is not None:
            print(f"(the nodes' files are kept in {result.folder})")
    verdict = "a job would run" if not failed else "a job would fail"
    print(f"\n{result.profile}: {result.nodes} node(s) checked in {result.seconds:.1f} s: {verdict}")
    return 0 if result.ok else 1
