"""``orchestrator`` command line: a thin, lazy dispatcher.

Each subcommand lives in ``orchestrator.cli.<name>`` with ``add_arguments``
and ``run``. Only the chosen one is imported, and nothing here imports torch or
accelerate, so commands that do not train start in well under a second.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import importlib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from orchestrator.contract.errors import EXIT_USAGE, OrchestratorError
from orchestrator.version import __version__

#: name -> one-line help. Order is the order shown in --help.
COMMANDS: dict[str, str] = {
    "submit": "submit a training job (Slurm or local) and print its id and run directory",
    "sweep": "submit a grid of runs as one job array (--grid lr=1e-3,3e-4 -- script.py --lr {lr})",
    "render": "print or write the sbatch script and each node's Accelerate config, submitting nothing",
    "status": "scheduler state and training progress of jobs (one batched scheduler query)",
    "list": "jobs in the registry",
    "wait": "follow a job to its end; exit code = outcome (0 COMPLETED, 1 otherwise)",
    "logs": "show or follow a job's logs",
    "cancel": "cancel a job or send it a signal",
    "stacks": "dump every rank's Python stack of a running job (py-spy, on its nodes)",
    "resume": "submit a new attempt of a job from its last complete checkpoint",
    "plot": "plot loss and throughput of a job to a PNG",
    "ui": "a local, read-only web dashboard of jobs, runs and sweeps (the [ui] extra)",
    "export": "write a run's checkpoint as safetensors, a from_pretrained folder or a torch file",
    "cost": "where the allocated GPU/CPU-hours of a job, run or sweep went (goodput, waste by cause)",
    "profiles": "list, show or validate cluster profiles",
    "doctor": "check a profile's nodes with a short job (interpreter, packages, GPUs, shared run root, "
    "limits, clocks, all-reduce); the fix for each failure",
    "strategies": "table of parallelism strategies",
    "remote": "install orchestrator on a profile's login host over SSH, or check its version",
}

MODULES = {"list": "list_jobs"}

_INVALID_CHOICE = re.compile(r"^(argument [^:]+): invalid choice: '?(.*?)'? \(choose from (.*)\)$")


class GuidingParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line with a did-you-mean, not the whole usage text.

    ``--strategy fulshard`` used to print 13 lines of usage and the list of choices; now it says
    ``did you mean 'full_shard'?`` and where the full help is."""

    def error(self, message: str) -> NoReturn:
        m = _INVALID_CHOICE.match(message)
        if m:
            where, value, listed = m.groups()
            choices = [c.strip().strip("'") for c in listed.split(",")]
            guess = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
            hint = f" (did you mean '{guess[0]}'?)" if guess else ""
            message = f"{where}: invalid choice '{value}'{hint}; choose from {', '.join(choices)}"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = GuidingParser(
        prog="orchestrator",
        description="Take an Accelerate training script from one machine to many Slurm nodes.",
        epilog="Exit codes: 0 ok, 1 job or run-time failure, 2 usage or configuration error.",
    )
    parser.add_argument("--version", action="version", version=f"orchestrator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:  # import only the module that will run
            _module(name).add_arguments(sub_parser)
    return parser


def _module(name: str) -> Any:
    return importlib.import_module(f"orchestrator.cli.{MODULES.get(name, name)}")


def main(argv: Sequence[str] | None = None) -> int:
    # `status` over 1,000 jobs allocates tens of thousands of small objects and almost no cycles;
    # at the default gen-0 threshold (700) the collector ran dozens of times per call (~3% of it).
    # Cycles are still collected, in larger batches, so long `--watch`/`-f` loops stay bounded.
    gc.set_threshold(50_000, 20, 100)
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    if command not in COMMANDS:
        command = None
    parser = build_parser(command)
    if not args_list:
        parser.print_help()
        return EXIT_USAGE
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        from orchestrator.remote.routing import route  # a profile with login: runs it over SSH

        login = route(args_list[args_list.index(args.command) :])
        if login is not None:
            from orchestrator.remote.client import forward

            return forward(login, args_list[args_list.index(args.command) :])
        return int(_module(args.command).run(args) or 0)
    except OrchestratorError as exc:
        print(f"orchestrator {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:
        # The last net under the promise "one line, never a traceback": a file the command could not
        # read or write that no check above named (the checks name their flag; this names the file).
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"orchestrator {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
