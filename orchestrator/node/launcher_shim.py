"""``python -m orchestrator.node.launcher_shim``: ``accelerate <args>`` that survives USR1/USR2, started early.

Slurm delivers ``scancel --signal`` and the pre-timeout ``--signal`` to every process of the step,
and torchrun has no handler for USR1/USR2: their default action would kill it mid-checkpoint. So
the launcher gets no-op Python handlers for them. A caught signal is reset to its default at exec,
so the workers torchrun starts keep their ordinary disposition (SIG_IGN would be inherited and
silence them too).

Prewarmed (:class:`orchestrator.node.launcher.PrewarmedLauncher`): started before the node knows its
command, it imports ``accelerate launch``'s module (and with it torch, the longest serial step of
a launch)
while the node entry point renders the node's config; then it reads one JSON line on stdin
``{"argv", "env", "log"}``, takes that environment, sends its output to the node log and runs
``accelerate <argv>``. An empty line or EOF (the node decided not to launch) exits 0 at once.
A DDP or FSDP launch does not go to torchrun: its ranks are forked here, from this interpreter's
imports (:mod:`orchestrator.node.direct_launch`; profile ``launcher: torchrun`` turns that off).
Its arguments are then ``--prewarmed`` and room for a rank's process title. Given other arguments
instead (``python -m orchestrator.node.launcher_shim launch ...``), it runs them at once.

Kept (``"keep": true`` in the request: a step the batch step may restart in place,
:mod:`orchestrator.node.restart_in_place`): after a failed start of the ranks it writes the exit
code on its channel and reads the next request line, the same launch as a new attempt, whose ranks
it forks from the same imports (through torchrun: a new agent in this interpreter, whose ranks
import for themselves); EOF ends it with the last code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

from orchestrator.contract import run_alive
from orchestrator.contract.env import ATTEMPT_ENV, RUN_DIR_ENV


def _ignore(signum: int, frame: object) -> None:
    """A handler, not SIG_IGN: handlers are reset at exec, SIG_IGN would be inherited."""


#: First argument of the prewarmed launcher; the second is TITLE_ROOM blanks, the argv area a rank
#: forked from it rewrites to show its own command (orchestrator.node.direct_launch._set_title).
PREWARMED_ARG = "--prewarmed"
TITLE_ROOM = 2048
#: Makes torch ask NVML, not the CUDA driver, whether CUDA is there: ranks forked from this process
#: cannot use a driver initialized in it (orchestrator.node.direct_launch). Never passed on to the ranks.
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
#: The node entry's pid: this launcher dies with it (and its ranks with this launcher). Not passed on.
PARENT_ENV = "ORCHESTRATOR_LAUNCHER_PARENT"
#: The prewarmed launcher's end of a socket pair on which the node hands over the rendezvous socket.
CHANNEL_ENV = "ORCHESTRATOR_LAUNCHER_CHANNEL"


def main() -> int:
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, _ignore)
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        run_alive.die_with_parent(int(parent))
    channel_fd = os.environ.pop(CHANNEL_ENV, "")
    from orchestrator.node.direct_launch import prepare_titles

    prepare_titles()
    with _cuda_checks_through_nvml():
        # accelerate launch's own module only: the whole CLI (accelerate_cli) also imports `estimate`
        # and with it transformers, 0.7 s more before any rank can start (python -X importtime).
        import accelerate.commands.launch  # noqa: F401

    if len(sys.argv) > 1 and sys.argv[1] != PREWARMED_ARG:
        _accelerate(sys.argv[1:])
        return 0
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    request = json.loads(line)
    channel = socket.socket(fileno=int(channel_fd)) if channel_fd.isdigit() else None
    listener = None
    if request.get("listener") and channel is not None:
        _, fds, _, _ = socket.recv_fds(channel, 1, 1)
        if fds:
            listener = socket.socket(fileno=fds[0])
    if request["env"].get(RUN_DIR_ENV):
        run_alive.hold(request["env"][RUN_DIR_ENV])
    requests = None
    if request.get("keep") and channel is not None:
        # The node's next requests come on the same pipe, once this launch has reported its end;
        # nothing beyond the first line is buffered in sys.stdin (the node waits for the report).
        requests = open(os.dup(0), encoding="utf-8")  # noqa: SIM115 (the launcher's lifetime)
    elif channel is not None:
        channel.close()
        channel = None
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    _take(request)
    ask = _next_request(channel, requests) if channel is not None and requests is not None else None
    code = _direct_launch(request["argv"], listener, ask)
    if code is not None:
        return code
    if ask is None:
        _accelerate(request["argv"])  # its error ends this process: a traceback, exit 1
        return 0
    return _torchrun_kept(request["argv"], ask)


def _take(request: dict[str, Any]) -> None:
    """This launch's node log as stdout and stderr, its environment as this process's."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])


def _next_request(channel: socket.socket, requests: IO[str]) -> Callable[[int], dict[str, Any] | None]:
    """A launcher kept for restarts in place: report a failed launch's exit code to the node, then
    wait for its next request (the ranks again, as a new attempt) or the end (EOF, an empty line)."""

    def ask(code: int) -> dict[str, Any] | None:
        try:
            channel.sendall(f"{code}\n".encode())
        except OSError:
            return None
        line = requests.readline()
        if not line.strip():
            return None
        request: dict[str, Any] = json.loads(line)
        _take(request)
        return request

    return ask


def _accelerate(argv: list[str]) -> None:
    """``accelerate <argv>``: ``launch`` straight through its own module, anything else via the CLI."""
    sys.argv = ["accelerate", *argv]
    if argv[:1] == ["launch"]:
        from accelerate.commands.launch import launch_command, launch_command_parser

        launch_command(launch_command_parser().parse_args(argv[1:]))
        return
    from accelerate.commands.accelerate_cli import main as accelerate_main

    accelerate_main()


@contextlib.contextmanager
def _cuda_checks_through_nvml() -> Iterator[bool]:
    """:data:`NVML_CHECK` set while inside (unless already set); yields whether it was added."""
    added = NVML_CHECK not in os.environ
    os.environ.setdefault(NVML_CHECK, "1")
    try:
        yield added
    finally:
        if added:
            os.environ.pop(NVML_CHECK, None)


def _direct_launch(
    argv: list[str],
    held: socket.socket | None = None,
    ask: Callable[[int], dict[str, Any] | None] | None = None,
) -> int | None:
    """``accelerate launch`` of DDP/FSDP with its ranks forked here (orchestrator.node.direct_launch); None
    where the launch must go through torchrun (then nothing was started). ``held``: the rendezvous
    port's socket, bound by the node entry since it chose the port (closed here where torchrun's agent
    binds the port itself). ``ask``: a launcher kept for restarts in place reports a failed start of
    the ranks and gets the next (the same launch as a new attempt), forked from the same imports
    and served by a fresh store on the same socket."""
    if argv[:1] != ["launch"]:
        if held is not None:
            held.close()
        return None
    from orchestrator.node import direct_launch, launch_store

    held_port = int(held.getsockname()[1]) if held is not None else None
    args, envs, reason = _rank_plan(argv, held_port)
    if reason and held is not None:
        held.close()
    listener = None if reason else launch_store.listen_early(envs, held)  # before the ~1 s of preimport
    if not reason and args.use_deepspeed:
        # On every start of the ranks, a DeepSpeed rank's Accelerator() imports deepspeed and
        # transformers.integrations (0.84 s of its process group's start here), and its engine's
        # optimizer check the Muon optimizer, whose module compiles (torch._inductor: 1.2 s of the
        # engine's build). None starts a thread; preimport then asks whether CUDA was touched.
        import deepspeed  # noqa: F401
        import transformers.integrations  # noqa: F401

        with contextlib.suppress(ImportError):  # DeepSpeed 0.19's path
            import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    reason = reason or direct_launch.preimport()
    if reason is not None:
        if listener is not None:
            listener.close()  # torchrun's agent binds the port itself
        direct_launch.say(f"ranks started by torchrun ({reason})")
        return None
    code = direct_launch.run_ranks(
        args.training_script, list(args.training_script_args), envs, args.log_dir, listener
    )
    agent_store = envs[0].get(launch_store.USE_AGENT_STORE, "False")
    restarts = 0
    while code != 0 and ask is not None:
        request = ask(code)
        if request is None:
            break
        restarts += 1
        port = int(listener.getsockname()[1]) if listener is not None else None
        args, envs, reason = _rank_plan(request["argv"], port, restarts)
        if reason:
            direct_launch.say(f"not started again in place: {reason}")
            return 1
        for env in envs:
            env[launch_store.USE_AGENT_STORE] = agent_store
        direct_launch.say(
            f"starting the ranks again in place (restart {restarts}, attempt {os.environ.get(ATTEMPT_ENV)})"
        )
        code = direct_launch.run_ranks(
            args.training_script, list(args.training_script_args), envs, args.log_dir, listener
        )
    return code


def _torchrun_kept(argv: list[str], ask: Callable[[int], dict[str, Any] | None]) -> int:
    """``accelerate launch`` through torchrun (``launcher: torchrun``, a launcher that touched CUDA) in
    a launcher kept for restarts in place: torchrun's agent runs in this interpreter, so a failed
    start of the ranks is reported like a forked one's and the next request runs a new agent here,
    without the node task, this interpreter and its imports starting again (the ranks torchrun
    starts import for themselves, as they always do). The ended agent's store must have let go of
    the rendezvous port before the next agent binds it (accelerate refuses a port in use on node 0):
    reference counting frees it (measured), and a collection first also frees what a cycle through
    the failure's traceback would hold."""
    import gc
    import traceback

    from orchestrator.node import direct_launch

    restarts = 0
    while True:
        try:
            _accelerate(argv)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # torchrun's ChildFailedError, a stop signal's SignalException
            traceback.print_exc()
            code = 1
        if code == 0:
            return 0
        request = ask(code)
        if request is None:
            return code
        restarts += 1
        argv = request["argv"]
        gc.collect()
        direct_launch.say(
            f"starting torchrun again in place (restart {restarts}, attempt {os.environ.get(ATTEMPT_ENV)})"
        )


def _rank_plan(
    argv: list[str], held_port: int | None, restarts: int = 0
) -> tuple[Any, list[dict[str, str]], str | None]:
    """The validated ``accelerate launch`` arguments, the ranks' environments, and why they cannot be
    forked here (None: they can)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from orchestrator.node import direct_launch

    with _cuda_checks_through_nvml() as added:
        args, defaults, mp_from_config = _validate_launch_command(
            launch_command_parser().parse_args(argv[1:])
        )
        # As accelerate's launch_command does before its DeepSpeed launcher.
        if args.use_deepspeed and not args.cpu:
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(
                [*fields, "mixed_precision"] if mp_from_config else fields
            )
        reason = direct_launch.not_direct_reason(args, dict(os.environ))
        # before torch._dynamo sets variables
        envs = [] if reason else direct_launch.rank_environments(args, held_port, restarts)
    if added:  # the ranks' environment is the node's, without it
        for env in envs:
            env.pop(NVML_CHECK, None)
    return args, envs, reason


def leave(code: int) -> None:
    """Exit without the interpreter's teardown: with torch and accelerate imported it costs ~1 s
    (0.05 s this way; median of 5 on the 2-core machine), paid between a rank's death and the
    node's exit, so between a fault and its restart. Nothing of the launcher's needs the teardown:
    the ranks are gone, the store's sockets close with the process, the log is flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
