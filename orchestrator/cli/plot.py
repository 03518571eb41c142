"""``orchestrator plot JOB [-o FILE.png]``: loss and throughput of a run to a PNG."""

from __future__ import annotations

import argparse

from orchestrator import api


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("-o", "--output", metavar="FILE.png", help="output file (default <run_dir>/plot.png)")


def run(args: argparse.Namespace) -> int:
    print(api.plot(args.job, args.output))
    return 0
