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
    for action in (lst, show, validate):
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


def check_like_render(name: str, path: Path, profile: ClusterProfile) -> None:
    """The checks ``render --profile NAME`` runs with no flags: the plan its defaults make (strategy
    combination, bf16 on pre-Ampere GPUs, fp16 without GPUs, node and process counts). A profile that
    parses but that every ``render`` would refuse is not valid."""
    from orchestrator import api

    api.check_profile(name, path, profile)


__all__ = ["add_arguments", "run", "parse_profile"]
