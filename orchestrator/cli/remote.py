"""``orchestrator remote install PROFILE [--wheels DIR]`` and ``orchestrator remote check PROFILE``:
the login host's side of a profile with ``login:`` (:mod:`orchestrator.remote`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.contract.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["install", "check"], help="install/update it there, or check it")
    parser.add_argument("profile", metavar="PROFILE", help="a profile with login.host")
    parser.add_argument("--wheels", metavar="DIR", help="install these wheels too (pip --no-index)")
    parser.add_argument("--profiles-dir", metavar="DIR", help="read PROFILE from this folder first")


def run(args: argparse.Namespace) -> int:
    from orchestrator.remote.routing import load_login
    from orchestrator.remote.routing import target as login_target

    target = login_target(args.profile, args.profiles_dir)
    profile = load_login(target)  # a profile that does not load says why (its file and key)
    if args.action == "install":
        from orchestrator.remote.install import install

        for line in install(profile, args.profile, Path(args.wheels) if args.wheels else None):
            print(line)
        return 0
    from orchestrator.remote.client import run_captured

    rc, out, err = run_captured(target, ["--version"])
    if rc != 0:
        raise UserError(err.strip() or f"the login host's orchestrator exited {rc}")
    print(f"{profile.login.host}: {out.strip()}, same as this laptop")
    return 0
