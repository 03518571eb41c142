"""``orchestrator render``: show exactly what would run, submitting nothing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orchestrator.cli.plan_args import add_plan_arguments, plan_from_args
from orchestrator.config.plan import LaunchPlan
from orchestrator.config.render import (
    accelerate_launch_command,
    needs_deepspeed_config_file,
    render_accelerate_config,
    render_deepspeed_config,
    sample_runtime,
)
from orchestrator.contract.errors import UserError
from orchestrator.contract.run_dir import node_config_file, node_deepspeed_config_file
from orchestrator.schedulers import get_scheduler

SAMPLE_RUN_DIR = "/SAMPLE/run_dir"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node-rank", type=int, default=None, help="render only this node's Accelerate config"
    )
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="write the files into DIR instead of printing"
    )
    add_plan_arguments(parser, script_required=False)


def render_files(plan: LaunchPlan, node_rank: int | None, python: str) -> dict[str, str]:
    """File name -> text, in the order a reader wants them."""
    files: dict[str, str] = {}
    scheduler = get_scheduler(plan.profile.scheduler)
    if scheduler.writes_batch_script:
        request = scheduler.dryrun(plan, Path(SAMPLE_RUN_DIR), 0, python)
        shebang, _, body = request.materialize().partition("\n")
        files[request.file_name] = f"{shebang}\n# SAMPLE run directory: each job gets its own.\n{body}"
    ranks = range(plan.nodes) if node_rank is None else [node_rank]
    for rank in ranks:
        files[node_config_file(Path(), rank).name] = render_accelerate_config(
            plan, sample_runtime(plan, rank)
        )
        if needs_deepspeed_config_file(plan):
            files[node_deepspeed_config_file(Path(), rank).name] = render_deepspeed_config(plan)
    return files


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    if args.node_rank is not None and not 0 <= args.node_rank < plan.nodes:
        raise UserError(
            f"--node-rank: expected 0..{plan.nodes - 1} for {plan.nodes} node(s), got {args.node_rank}"
        )
    files = render_files(plan, args.node_rank, sys.executable)
    if args.out:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UserError(f"--out: {out} exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out / name).write_text(text)
            print(out / name)
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
