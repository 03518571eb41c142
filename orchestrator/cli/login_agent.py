"""The login host's side of a remote call: ``python -m orchestrator.cli.login_agent VERSION COMMAND ...``.

The laptop's orchestrator runs this module through SSH (:mod:`.client`). It first compares its
version with the laptop's (the run directories, registry and snapshot format are one version's), then:

- ``fetch JOB``: the run files a plot is drawn from (the laptop draws it);
- ``manifest DIR``: the content hash of every file of the mirror DIR (the laptop sends only what
  differs);
- ``run [--home H] [--runs R] [--skip N] [--sync DIR [--freeze]] -- ARGS``: receive a tar of changed
  files into the mirror DIR (``--sync``; deletions listed in its first member; ``--freeze``: then
  run from a copy of it), then run
  ``orchestrator ARGS`` there as the login host's own command would, dropping the first N bytes of
  its output (``--skip``: a one-shot ``logs`` that reconnects continues where it was cut; ``logs -f``
  resumes per file instead, from ``--framed`` records: ``core.logs.Resume``).

A thin entry with plain imports: what the laptop's side shares with it (the mirror's manifest and
the tar it receives) is :mod:`orchestrator.remote.sync`. It never asks which scheduler runs the jobs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from orchestrator import api
from orchestrator.cli import main as cli_main
from orchestrator.remote.routing import ON_LOGIN_HOST, version
from orchestrator.remote.sync import PLOT_FILES, manifest, receive

#: Exit status of a version mismatch (a usage error: the fix is a command the user runs).
EXIT_MISMATCH = 2


class _Skipping(io.RawIOBase):
    """stdout without its first ``skip`` bytes: the part a reconnecting reader already has."""

    def __init__(self, target: BinaryIO, skip: int) -> None:
        self.target, self.skip = target, skip

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        n = len(data)
        view = memoryview(data)
        if self.skip:
            cut = min(self.skip, n)
            view, self.skip = view[cut:], self.skip - cut
        if len(view):
            self.target.write(view)
            self.target.flush()
        return n


def _interrupt_at_end_of_stdin() -> None:
    """Ctrl-C for the command once the laptop's call ends (its stdin closes, or the connection drops)."""
    while sys.stdin.buffer.read(65536):
        pass
    os.kill(os.getpid(), signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    __version__ = version()

    parser = argparse.ArgumentParser(prog="orchestrator.cli.login_agent")
    parser.add_argument("version")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("manifest").add_argument("folder")
    fetch = sub.add_parser("fetch")
    fetch.add_argument("--home")
    fetch.add_argument("job")
    run = sub.add_parser("run")
    run.add_argument("--home")
    run.add_argument("--runs")
    run.add_argument("--skip", type=int, default=0)
    run.add_argument("--sync", metavar="DIR")
    run.add_argument("--freeze", action="store_true", help="run from a copy of the synced DIR")
    run.add_argument(
        "--hold",
        action="store_true",
        help="stdin's first line is the dashboard's token; the command is interrupted when stdin ends",
    )
    run.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.version != __version__:
        print(
            f"orchestrator on this login host is {__version__}, the laptop's is {args.version}: "
            "run `orchestrator remote install PROFILE` on the laptop to install its version here",
            file=sys.stderr,
        )
        return EXIT_MISMATCH
    if args.command == "manifest":
        print(json.dumps(manifest(Path(os.path.expanduser(args.folder)))))
        return 0
    os.environ[ON_LOGIN_HOST] = "1"
    if args.command == "fetch":  # what a laptop draws a run's plot from
        if args.home:
            os.environ["ORCHESTRATOR_HOME"] = os.path.expanduser(args.home)
        run_dir = api.get_job(args.job).run_dir
        texts = {n: (run_dir / n).read_text(errors="replace") for n in PLOT_FILES if (run_dir / n).is_file()}
        print(json.dumps({"run_dir": str(run_dir), "files": texts}))
        return 0
    for name, value in (("ORCHESTRATOR_HOME", args.home), ("ORCHESTRATOR_RUNS", args.runs)):
        if value:
            os.environ[name] = os.path.expanduser(value)
    if args.sync:
        folder = Path(os.path.expanduser(args.sync))
        receive(folder, sys.stdin.buffer)
        if args.freeze:  # the command keeps its own copy: the next sync never changes it
            frozen = folder.parent / f"{folder.name}.{time.time_ns()}"
            shutil.copytree(folder, frozen, symlinks=True)
            folder = frozen
        os.chdir(folder)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.hold:  # the laptop's forwarded `ui`: its token, and its end when the laptop's call ends
        token = sys.stdin.readline().strip()
        if token:
            os.environ["ORCHESTRATOR_UI_TOKEN"] = token
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even where sshd's shell ignored it
        threading.Thread(target=_interrupt_at_end_of_stdin, daemon=True).start()
    if args.skip:
        sys.stdout.flush()
        sys.stdout = io.TextIOWrapper(
            io.BufferedWriter(_Skipping(sys.stdout.buffer, args.skip), 1), line_buffering=True
        )
    try:
        return int(cli_main.main(rest))
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
