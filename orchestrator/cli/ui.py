"""``orchestrator ui [--host 127.0.0.1] [--port 8765] [--token T] [--refresh S]``.

A local, read-only web dashboard of the registry's jobs and sweeps (``orchestrator.ui``). Any
address but 127.0.0.1 needs a token (``--token`` or ``ORCHESTRATOR_UI_TOKEN``; the variable keeps
it out of ``ps``).
"""

from __future__ import annotations

import argparse

from orchestrator.contract.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free one)")
    parser.add_argument(
        "--token", default=None, help="required by every request (needed for any --host but 127.0.0.1)"
    )
    parser.add_argument(
        "--refresh",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between a page's updates (default 5; 0.5 to 3600)",
    )


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: expected 0..65535")
    from orchestrator.ui.server import check_refresh, serve

    serve(args.host, args.port, args.token, refresh_s=check_refresh(args.refresh))
    return 0
