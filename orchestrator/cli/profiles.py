"""``orchestrator profiles list|show|validate``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from orchestrator.cli.table import format_table
from orchestrator.config.profile.load import available_profiles, display_path, load_profile, parse_profile
from orchestrator.contract.errors import EXIT_USAGE, OrchestratorError, UserError

if TYPE_CHECKING:
    from orchestrator.config.profile.load import ClusterProfile


PROFILES_DIR_HELP = "folder of your own profiles; overrides built-ins by name (also $ORCHESTRATOR_PROFILES, ./cluster_profiles)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profiles-dir", default=None, help=PROFILES_DIR_HELP)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    lst = sub.add_parser("list", help="profiles found, user folders first")
    lst.add_argument("--json", action="store_true")
    show = sub.add_parser("show", help="a profile with every default filled in")
    show.add_argument("name")
    show.add_argument("--json", action="store_true")
    validate = sub.add_parser(
        "validate",
        help="check profile files as `render` would (keys, values, their defaults' strategy combination); "
        "exit 2 on the first bad one",
    )
    validate.add_argument("targets", nargs="*", help="names or YAML paths (default: all found)")
    init = sub.add_parser(
        "init",
        help="write NAME.yaml from what the Slurm cluster says (partitions, nodes, GPUs, accounts, QOS, "
        "cred_expire, containers, fabric); asks only what it cannot learn",
    )
    init.add_argument("name", help="the new profile's name (its file: NAME.yaml)")
    init.add_argument(
        "--partition", default=None, help="the partition to use (default: the cluster's default)"
    )
    init.add_argument("--account", default=None, help="the account to charge (default: your default account)")
    init.add_argument("--qos", default=None, help="the QOS (default: your association's default QOS)")
    init.add_argument(
        "--gpu-type",
        default=None,
        metavar="TYPE",
        help="the GPU type to draft where the partition has several (default: the one on most of its "
        "nodes; the types found are said on stderr and in the file)",
    )
    init.add_argument(
        "--setup",
        action="append",
        default=None,
        metavar="LINE",
        help="a shell line that makes the nodes' Python (repeat; asked on a terminal when not given)",
    )
    init.add_argument(
        "--python", default=None, help="the nodes' interpreter (a path or a name on PATH after setup)"
    )
    init.add_argument(
        "--no-node-probe",
        action="store_true",
        help="do not run the one-node step that finds container runtimes and the fabric interface",
    )
    init.add_argument("--print", action="store_true", help="print the profile instead of writing it")
    init.add_argument("--force", action="store_true", help="replace an existing NAME.yaml")
    for action in (lst, show, validate, init):
        # Accepted after the action too (`profiles list --profiles-dir X`); SUPPRESS keeps the value
        # given before the action when it is not repeated.
        action.add_argument("--profiles-dir", default=argparse.SUPPRESS, help=PROFILES_DIR_HELP)


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        rows = []
        for name, path in sorted(available_profiles(args.profiles_dir).items()):
            try:
                _, _, profile = load_profile(str(path), args.profiles_dir)
                rows.append(
                    {
                        "name": name,
                        "scheduler": profile.scheduler,
                        "partition": profile.partition or "-",
                        "nodes": f"{profile.nodes.default}..{profile.nodes.max}",
                        "gpus": f"{profile.gpus_per_node}x{profile.gpu_type or 'gpu'}"
                        if profile.gpus_per_node
                        else "cpu",
                        "path": display_path(path),
                        "description": profile.description,
                    }
                )
            except OrchestratorError as exc:
                rows.append(
                    {
                        "name": name,
                        "scheduler": "INVALID",
                        "path": display_path(path),
                        "description": str(exc),
                    }
                )
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print(
                format_table(rows, ["name", "scheduler", "partition", "nodes", "gpus", "path", "description"])
            )
        return 0
    if args.action == "show":
        name, path, profile = load_profile(args.name, args.profiles_dir)
        data = profile.model_dump(mode="json")
        if args.json:
            print(json.dumps({"name": name, "path": str(path), "profile": data}, indent=2))
        else:
            print(f"# {name}: {display_path(path)}")
            print(yaml.safe_dump(data, sort_keys=False).rstrip())
        return 0
    if args.action == "init":
        return init_profile(args)
    targets = args.targets or [str(p) for p in available_profiles(args.profiles_dir).values()]
    if not targets:
        raise UserError("no profiles found to validate")
    bad = 0
    for target in targets:  # every file, not up to the first bad one: each bad one is a line
        try:
            name, path, profile = load_profile(target, args.profiles_dir)
            check_like_render(name, path, profile)
        except OrchestratorError as exc:
            bad += 1
            print(f"orchestrator profiles: error: {exc}", file=sys.stderr)
            continue
        print(f"ok  {display_path(path)}")
    return EXIT_USAGE if bad else 0


def init_profile(args: argparse.Namespace) -> int:
    """``profiles init NAME``: ask the cluster, ask the user what it cannot say (on a terminal), write."""
    from orchestrator import api

    setup = list(args.setup or [])
    if args.setup is None and args.python is None and sys.stdin.isatty():
        print(
            "Shell lines that make the nodes' Python (module load ..., source .../bin/activate), one per line;"
        )
        print("an empty line ends (none: the nodes run this interpreter, as on a shared filesystem):")
        while line := input("  setup> ").strip():
            setup.append(line)
    text, path = api.init_profile(
        args.name,
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        setup=setup,
        python=args.python,
        profiles_dir=args.profiles_dir,
        probe_node=not args.no_node_probe,
        print_only=args.print,
        force=args.force,
        gpu_type=args.gpu_type,
        out=sys.stderr,
    )
    print(text, end="")
    if path is not None:
        print(f"wrote {path}; check it with `orchestrator profiles validate {path}`")
    return 0


def check_like_render(name: str, path: Path, profile: ClusterProfile) -> None:
    """The checks ``render --profile NAME`` runs with no flags: the plan its defaults make (strategy
    combination, bf16 on pre-Ampere GPUs, fp16 without GPUs, node and process counts). A profile that
    parses but that every ``render`` would refuse is not valid."""
    from orchestrator import api

    api.check_profile(name, path, profile)


__all__ = ["add_arguments", "run", "parse_profile"]
