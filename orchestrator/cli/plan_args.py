"""Options shared by ``render``, ``submit`` and ``resume``: they all build a LaunchPlan."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from orchestrator import api
from orchestrator.config.options import add_option_arguments, given_options
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number of seconds > 0 (``--poll``): checked by argparse, before anything is submitted."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser, script_required: bool = True) -> None:
    parser.add_argument(
        "--profile",
        default=os.environ.get("ORCHESTRATOR_PROFILE", "local"),
        help="cluster profile name or YAML path (default: local, or $ORCHESTRATOR_PROFILE)",
    )
    parser.add_argument(
        "--profiles-dir",
        default=None,
        help="folder of your own profiles; overrides built-ins by name (also $ORCHESTRATOR_PROFILES, ./cluster_profiles)",
    )
    parser.add_argument(
        "--nodes", type=positive_int, default=None, help="default: the profile's nodes.default"
    )
    parser.add_argument(
        "--procs-per-node",
        type=positive_int,
        default=None,
        help="processes per node (default: the profile's procs_per_node, else its gpus_per_node, else 1; local: 2)",
    )
    add_option_arguments(parser)
    parser.add_argument("--name", default=None, help="job name (default: <strategy>-<nodes>n)")
    parser.add_argument("--time", default=None, help="time limit, Slurm format (default: the profile's)")
    parser.add_argument(
        "--max-requeues",
        type=int,
        default=None,
        metavar="N",
        help="requeues after preemption/time limit, and auto-resumes (default: the profile's max_requeues)",
    )
    parser.add_argument(
        "--auto-resume",
        action="store_true",
        help="after a node failure, submit a new attempt without the lost node from the last checkpoint (Slurm)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help="end the job when no rank progresses for this long, saving every rank's stacks "
        "(default: the profile's hang_timeout, else derived from step times)",
    )
    parser.add_argument(
        "--container-image",
        default=None,
        metavar="IMAGE",
        help="run the nodes' tasks in this image instead of the profile's container.image",
    )
    parser.add_argument(
        "--exclude",
        default=None,
        metavar="NODES",
        help="nodes not to run on (Slurm host list, comma-separated)",
    )
    parser.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="JOB[:ok|any]",
        help="start only after JOB (a job or sweep id) COMPLETED (:ok, the default) or ended at all (:any); repeatable",
    )
    parser.add_argument(
        "script_and_args",
        nargs=argparse.REMAINDER,
        metavar="-- SCRIPT [ARGS...]",
        help="training script and its arguments, after --",
    )
    parser.set_defaults(script_required=script_required)


def parse_after(text: str) -> str:
    return api.parse_after(text)


def split_script(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    rest = list(args.script_and_args or [])
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        if args.script_required:
            raise UserError("no training script: add `-- SCRIPT [ARGS...]` at the end")
        return None, []
    return rest[0], rest[1:]


def plan_from_args(args: argparse.Namespace, default_script: str = "train/train.py") -> LaunchPlan:
    """The plan of the parsed flags (:func:`orchestrator.api.make_plan`: one planning path)."""
    script, script_args = split_script(args)
    return api.make_plan(
        script=script or default_script,
        args=script_args,
        profile=args.profile,
        profiles_dir=args.profiles_dir,
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        name=args.name,
        time=args.time,
        max_requeues=args.max_requeues,
        auto_resume=args.auto_resume,
        exclude=args.exclude,
        after=getattr(args, "after", None) or (),
        hang_timeout=getattr(args, "hang_timeout", None),
        container_image=getattr(args, "container_image", None),
        options=given_options(args),
    )
