"""``orchestrator render``: show exactly what would run, submitting nothing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orchestrator import api
from orchestrator.cli.plan_args import add_plan_arguments, plan_from_args
from orchestrator.config.render import accelerate_launch_command
from orchestrator.contract.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node-rank", type=int, default=None, help="render only this node's Accelerate config"
    )
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="write the files into DIR instead of printing"
    )
    add_plan_arguments(parser, script_required=False)


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    if args.node_rank is not None and not 0 <= args.node_rank < plan.nodes:
        raise UserError(
            f"--node-rank: expected 0..{plan.nodes - 1} for {plan.nodes} node(s), got {args.node_rank}"
        )
    files = api.render_files(plan, args.node_rank, sys.executable)
    if args.out:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UserError(f"--out: {out} exists and is not a directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (out / name).write_text(text)
                print(out / name)
        except OSError as exc:  # --out /proc/x, a read-only folder: one line, not a traceback
            raise UserError(
                f"--out {out}: cannot write {exc.filename or out}: {exc.strerror or exc}"
            ) from None
        return 0
    for name, text in files.items():
        print(f"==> {name} <==")
        print(text.rstrip("\n"))
        print()
    print(
        f"# plan: profile={plan.profile_name} strategy={plan.options.strategy} nodes={plan.nodes} "
        f"procs_per_node={plan.procs_per_node} world_size={plan.world_size} "
        f"command={' '.join(accelerate_launch_command('<node config>', plan.script, plan.script_args))}"
    )
    return 0
