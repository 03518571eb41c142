"""``python -m orchestrator.launcher_shim``: ``accelerate <args>`` that survives USR1/USR2, started early.

Slurm delivers ``scancel --signal`` and the pre-timeout ``--signal`` to every process of the step,
and torchrun has no handler for USR1/USR2: their default action would kill it mid-checkpoint. So
the launcher gets no-op Python handlers for them. A caught signal is reset to its default at exec,
so the workers torchrun starts keep their ordinary disposition (SIG_IGN would be inherited and
silence them too).

Prewarmed (:class:`orchestrator.launcher.PrewarmedLauncher`): started before the node knows its
command, it imports accelerate (and with it torch, the longest serial step of a local launch)
while the node entry point renders the node's config; then it reads one JSON line on stdin
``{"argv", "env", "log"}``, takes that environment, sends its output to the node log and runs
``accelerate <argv>``. An empty line or EOF (the node decided not to launch) exits 0 at once.
A DDP or FSDP launch does not go to torchrun: its ranks are forked here, from this interpreter's
imports (:mod:`orchestrator.direct_launch`; profile ``launcher: torchrun`` turns that off).
Given arguments instead (``python -m orchestrator.launcher_shim launch ...``), it runs them at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _ignore(signum: int, frame: object) -> None:
    """A handler, not SIG_IGN: handlers are reset at exec, SIG_IGN would be inherited."""


def main() -> int:
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, _ignore)
    from accelerate.commands.accelerate_cli import main as accelerate_main

    if len(sys.argv) > 1:
        sys.argv = ["accelerate", *sys.argv[1:]]
        accelerate_main()
        return 0
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    request = json.loads(line)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    code = _direct_launch(request["argv"])
    if code is not None:
        return code
    sys.argv = ["accelerate", *request["argv"]]
    accelerate_main()
    return 0


def _direct_launch(argv: list[str]) -> int | None:
    """``accelerate launch`` of DDP/FSDP with its ranks forked here (orchestrator.direct_launch); None
    where the launch must go through torchrun (then nothing was started)."""
    if argv[:1] != ["launch"]:
        return None
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from orchestrator import direct_launch

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv[1:]))
    reason = direct_launch.not_direct_reason(args, dict(os.environ))
    if reason is not None:
        direct_launch.say(f"ranks started by torchrun ({reason})")
        return None
    direct_launch.preimport()
    envs = direct_launch.rank_environments(args)
    return direct_launch.run_ranks(args.training_script, list(args.training_script_args), envs, args.log_dir)


if __name__ == "__main__":
    sys.exit(main())
