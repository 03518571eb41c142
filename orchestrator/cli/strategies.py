"""``orchestrator strategies``: the strategy table."""

from __future__ import annotations

import argparse
import json

from orchestrator.cli.table import format_table
from orchestrator.config.strategies import strategy_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    rows = strategy_table()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows, ["strategy", "shards", "zero", "fsdp1", "fsdp2", "min_nodes"]))
    return 0
