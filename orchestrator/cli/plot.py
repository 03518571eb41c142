"""``orchestrator plot JOB [-o FILE.png]``: loss and throughput of a run to a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.contract.errors import UserError
from orchestrator.core.plotting import plot_run
from orchestrator.registry.store import Registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("-o", "--output", metavar="FILE.png", help="output file (default <run_dir>/plot.png)")


def run(args: argparse.Namespace) -> int:
    with Registry.open() as registry:
        job = registry.get(args.job)
    out = Path(args.output) if args.output else job.run_dir / "plot.png"
    if out.suffix.lower() != ".png":
        raise UserError(f"-o {out}: only PNG output is supported (name it *.png)")
    if not job.run_dir.is_dir():
        raise UserError(f"run directory {job.run_dir} of job {job.job_id} does not exist")
    if not out.parent.is_dir():
        # Never created here: a mistyped -o path should fail, not grow a tree of folders.
        raise UserError(f"-o {out}: folder {out.parent} does not exist")
    written = plot_run(job.run_dir, out, job_id=job.job_id)
    print(written)
    return 0
