"""Start a node's ranks by ``fork`` from the launcher's interpreter, which has already imported torch.

``accelerate launch`` hands a DDP, FSDP or DeepSpeed launch to torchrun, whose agent starts each rank as a
fresh interpreter: each node imports torch twice, one after the other (the launcher, then every rank),
and every rank imports ``torch._dynamo`` again on its first optimizer (``torch._compile``). Here the
prewarmed launcher (:mod:`orchestrator.node.launcher_shim`) has paid for those imports once; it asks
Accelerate for the environment its launch would give the ranks (``prepare_multi_gpu_env`` or
``prepare_deepspeed_cmd_env``), adds what torchrun's agent adds per worker (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ...), and forks one child per rank that runs the script with
:mod:`runpy`. Node 0's launcher hosts the rendezvous store, as torchrun's agent does
(:mod:`orchestrator.node.launch_store`); no agent and no rendezvous round trip between node and ranks.

What torchrun did and this module does too: every rank's output goes to the node log with its
``[default<L>]:`` prefix (``--tee``) and to its own file; the first rank that fails ends the
others (SIGTERM, then SIGKILL after a grace period). What it does differently: a rank leaves with
``os._exit`` once the script, its non-daemon threads, its ``atexit`` functions and the flush of
every open file are done (:mod:`orchestrator.rank.run_script`, which torchrun's ranks use too):
no interpreter teardown, where torch 2.13 + gloo aborts or hangs after a job trained to the end
(FIELD_NOTES). The node exits with the code of the failure's cause whichever death was seen first
(:func:`_weight`): a busy launcher reaps a peer that died of the cause in the cause's pass, or before.

Fork safety: the parent has imported modules only (no CUDA context, no process group, no thread
pool); each child sets up CUDA and its thread count from its own environment.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import select
import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.contract import run_alive
from orchestrator.contract.env import FORKED_RANK_ENV, LAUNCHER_ENV, RUN_DIR_ENV
from orchestrator.node.cuda_driver import driver_initialized
from orchestrator.rank.run_script import leave, run_script

#: Seconds the other ranks get to leave after one failed, before SIGKILL (torchrun: 30).
STOP_GRACE_S = 30.0
#: Seconds the ranks' output may still arrive after the last rank exited (from processes they left).
DRAIN_S = 5.0
#: Bytes of each rank's latest output kept to tell its own error from a consequence of another's.
TAIL_BYTES = 16384
#: Signals the parent (the launcher) lives through; the node entry relays them to the ranks.
PARENT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def not_direct_reason(args: Any, env: dict[str, str]) -> str | None:
    """Why this validated ``accelerate launch`` must go through torchrun, or None (fork it here)."""
    if env.get(LAUNCHER_ENV, "direct") != "direct":
        return f"profile launcher: {env.get(LAUNCHER_ENV)}"
    kinds = ("multi_gpu", "use_fsdp", "use_deepspeed")  # DeepSpeed: its standard multinode launcher's way
    if not any(getattr(args, kind, False) for kind in kinds) or getattr(args, "cpu", False):
        return "not a torchrun launch"
    if getattr(args, "module", False) or getattr(args, "no_python", False):
        return "--module / --no_python"
    if not str(args.training_script).endswith(".py"):
        return "the script is not a .py file"
    return None


def rank_environments(
    args: Any, held_port: int | None = None, restart_count: int = 0
) -> list[dict[str, str]]:
    """One environment per local rank: Accelerate's launch environment plus torchrun's worker variables.

    Runs in the launcher with ``os.environ`` already the ranks' base environment. ``held_port``: the
    rendezvous port this launcher holds itself (handed over by the node): Accelerate's check that
    the port is free must not count that one as taken. ``restart_count``: how often this launcher
    started its ranks again in place before (torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""
    import accelerate.utils.launch as accelerate_launch

    in_use = accelerate_launch.is_port_in_use
    if held_port is not None:

        def is_port_in_use(port: int | None = None) -> bool:
            return int(port or 0) != held_port and in_use(port)

        accelerate_launch.is_port_in_use = is_port_in_use
    try:
        if getattr(args, "use_deepspeed", False):  # both validate the port as accelerate launch does
            base = accelerate_launch.prepare_deepspeed_cmd_env(args)[1]
        else:
            base = accelerate_launch.prepare_multi_gpu_env(args)
    finally:
        accelerate_launch.is_port_in_use = in_use
    nnodes = int(args.num_machines or 1)
    nproc = int(args.nproc_per_node)
    node_rank = int(getattr(args, "node_rank", 0) or 0) if nnodes > 1 else 0
    world = nproc * nnodes
    addr = str(getattr(args, "master_addr", None) or args.main_process_ip or "127.0.0.1")
    port = str(getattr(args, "master_port", None) or args.main_process_port or 29500)
    if getattr(args, "standalone", False):  # single node, port taken: torchrun would pick a free one
        addr, port = "127.0.0.1", str(_free_port())
    if nproc > 1 and "OMP_NUM_THREADS" not in base:  # torchrun's default
        base["OMP_NUM_THREADS"] = "1"
    envs = []
    for local in range(nproc):
        rank = node_rank * nproc + local
        env = dict(base)
        env.update(
            {
                FORKED_RANK_ENV: "1",
                "RANK": str(rank),
                "LOCAL_RANK": str(local),
                "GROUP_RANK": str(node_rank),
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "LOCAL_WORLD_SIZE": str(nproc),
                "WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": str(nnodes),
                "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": addr,
                "MASTER_PORT": port,
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            }
        )
        envs.append(env)
    return envs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def preimport() -> str | None:
    """What every rank would import anyway, imported once before the fork (see the module docstring);
    returns why the ranks must not be forked after all, or None.

    ``torch._dynamo``: every ``torch.optim`` optimizer imports it when built (~1 s here). A process
    that has initialised CUDA must not fork ranks that use CUDA: torch's lazy init and the driver
    (orchestrator.node.cuda_driver) are asked; the launcher asks NVML whether CUDA is there."""
    import torch
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    if torch.cuda.is_initialized():
        return "CUDA was initialized in the launcher"
    if driver_initialized():
        return "the CUDA driver was initialized in the launcher"
    return None


def say(line: str) -> None:
    print(f"[orchestrator launch] {line}", flush=True)


def run_ranks(
    script: str,
    script_args: list[str],
    envs: list[dict[str, str]],
    log_dir: str | None,
    store_listener: socket.socket | None = None,
) -> int:
    """Fork the ranks, relay their output, end them all when one fails; the node's exit code.
    ``store_listener``: node 0's rendezvous store socket (:mod:`orchestrator.node.launch_store`), served
    by a process of its own for as long as these ranks live; the socket stays open here, so ranks
    started again in place (a later call) connect to it as early as these did."""
    for sig in PARENT_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _parent_signal)
    ranks: dict[int, _Rank] = {}
    sel = selectors.DefaultSelector()
    launcher = os.getpid()
    for local, env in enumerate(envs):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank; never returns
            # A rank never outlives its launcher, and holds the run's lock itself (run_alive).
            run_alive.die_with_parent(launcher)
            run_alive.forget_inherited()
            if env.get(RUN_DIR_ENV):
                run_alive.hold(env[RUN_DIR_ENV])
            os.close(read_fd)
            for other in ranks.values():
                os.close(other.fd)
            if store_listener is not None:
                store_listener.close()  # the launcher's; a rank is the store's client
            _rank_main(script, script_args, env, write_fd)
        os.close(write_fd)
        rank = _Rank(local, int(env["RANK"]), pid, read_fd, _rank_log(log_dir, env["RANK"]))
        ranks[pid] = rank
        sel.register(read_fd, selectors.EVENT_READ, rank)
    if log_dir:
        _record_pids(Path(log_dir), ranks.values())
    # After the ranks (a stop signal before them finds no child and ends the launch: SignalRelay);
    # their connects wait in the listening socket's queue meanwhile.
    store = None
    if store_listener is not None:
        from orchestrator.node import launch_store

        store = launch_store.start(store_listener, envs[0], say, [r.pid for r in ranks.values()])
        if store is None:
            return 1
    say(
        f"started {len(envs)} rank(s) by fork: pids {' '.join(str(r.pid) for r in ranks.values())} "
        f"(ranks {envs[0]['RANK']}..{envs[-1]['RANK']} of {envs[0]['WORLD_SIZE']})"
    )
    code = _supervise(ranks, sel)
    sel.close()
    if store is not None:  # served until every rank is done; a fresh one for ranks started again
        store.stop()
    return code


def _record_pids(log_dir: Path, ranks: Any) -> None:
    """For ``orchestrator stacks`` and the hang watchdog (see ``run_dir.rank_pids_file``)."""
    from orchestrator.contract.run_dir import rank_pids_file, write_json_atomic

    record = {"launcher": os.getpid(), "ranks": {str(r.rank): r.pid for r in ranks}}
    write_json_atomic(rank_pids_file(log_dir), record)


class _Rank:
    def __init__(self, local: int, rank: int, pid: int, fd: int, log: io.BufferedWriter | None) -> None:
        self.local, self.rank, self.pid, self.fd, self.log = local, rank, pid, fd, log
        self.prefix = f"[default{local}]:".encode()
        self.partial = b""
        self.code: int | None = None
        self.open = True
        self.tail, self.seen = b"", 0  # its latest output; the pass that reaped it (a tie-break)
        self.pidfd: int | None = None  # readable once it exited: its death wakes the supervisor

    def relay(self, data: bytes, out: Any) -> None:
        """Best effort: a write a full disk refuses is lost, never the launcher's supervision."""
        self.tail = (self.tail + data)[-TAIL_BYTES:]
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        with contextlib.suppress(OSError):
            if self.log is not None:
                self.log.write(data)
                self.log.flush()
        with contextlib.suppress(OSError):
            out.write(b"".join(self.prefix + line + b"\n" for line in lines))
            out.flush()

    def close(self, out: Any, sel: selectors.BaseSelector) -> None:
        sel.unregister(self.fd)
        os.close(self.fd)
        with contextlib.suppress(OSError):
            out.write(self.prefix + self.partial + b"\n" if self.partial else b"")
            out.flush()
        with contextlib.suppress(OSError):
            if self.log is not None:
                self.log.close()
        self.partial, self.open = b"", False


def _rank_log(log_dir: str | None, rank: str) -> io.BufferedWriter | None:
    if not log_dir:
        return None
    folder = Path(log_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return open(folder / f"rank_{rank}.log", "ab")  # noqa: SIM115 (closed by _Rank.close)


def _supervise(ranks: dict[int, _Rank], sel: selectors.BaseSelector) -> int:
    out = sys.stdout.buffer
    cause: _Rank | None = None
    killed = False
    kill_at: float | None = None
    drain_until: float | None = None
    passes = 0
    for rank in ranks.values():
        with contextlib.suppress(OSError, AttributeError):  # no pidfd: the 0.1 s poll still reaps it
            rank.pidfd = os.pidfd_open(rank.pid)
            sel.register(rank.pidfd, selectors.EVENT_READ, (rank,))
    while any(r.code is None for r in ranks.values()) or any(r.open for r in ranks.values()):
        passes += 1
        for key, _ in sel.select(timeout=0.1):
            if isinstance(key.data, tuple):  # a rank exited: reaped below, in this pass
                _close_pidfd(key.data[0], sel)
            else:
                _read(key.data, out, sel)
        fresh = []
        for rank in ranks.values():
            if rank.code is None:
                rank.code = _poll_exit(rank.pid)
                if rank.code is not None:
                    rank.seen = passes
                    _close_pidfd(rank, sel)
                    if rank.code != 0:
                        fresh.append(rank)
        if fresh:
            for rank in fresh:  # its last words (the error) before it is weighed; bounded
                for _ in range(64):
                    if not (rank.open and select.select([rank.fd], [], [], 0)[0] and _read(rank, out, sel)):
                        break
            best = min(fresh, key=lambda r: _weight(r, killed))
            if cause is None:
                cause = best
                alive = [r for r in ranks.values() if r.code is None]
                say(
                    f"rank {best.rank} (local {best.local}) exited with code {best.code}"
                    + (f": sending SIGTERM to {len(alive)} other rank(s)" if alive else "")
                )
                for other in alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other.pid, signal.SIGTERM)
                kill_at = time.monotonic() + STOP_GRACE_S
            elif _weight(best, killed) < _weight(cause, killed):
                say(f"rank {best.rank} (local {best.local}) exited with code {best.code}: the cause, "
                    f"not rank {cause.rank} (code {cause.code}), whose death was seen first")  # fmt: skip
                cause = best
        if drain_until is None and all(r.code is not None for r in ranks.values()):
            drain_until = time.monotonic() + DRAIN_S
        if drain_until is not None and time.monotonic() > drain_until:
            for rank in ranks.values():  # a process the rank left behind holds its pipe
                if rank.open:
                    rank.close(out, sel)
        if kill_at is not None and time.monotonic() > kill_at:
            killed = True
            for other in ranks.values():
                if other.code is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other.pid, signal.SIGKILL)
            kill_at = None
    return cause.code if cause is not None and cause.code is not None else 0


def _weight(rank: _Rank, killed: bool) -> tuple[int, int, int]:
    """How surely this failed rank is the cause of its node's failure; lower is surer. First a rank
    killed by a signal the job did not send (SIGKILL from outside, SIGSEGV, SIGABRT); then one that
    exited non-zero with an error of its own; then one whose errors are all consequences of another's
    death (gloo's "connection closed by peer"; the failure report's rule, ``scan_errors``); last one
    that died of a stop's SIGTERM (this launcher's, or the job's relayed) or of our SIGKILL after the
    grace. Ties: the death seen first, then the lowest local rank."""
    code = rank.code or 0
    sig = code - 128 if 128 < code < 160 else None
    if sig == signal.SIGTERM or (sig == signal.SIGKILL and killed):
        weight = 3
    elif sig is not None:
        weight = 0
    else:
        from orchestrator.supervise.failure_report import scan_errors

        lines = rank.tail.decode("utf-8", "replace").splitlines()
        found = [e for e in scan_errors(lines).values() if e.lines]
        weight = 2 if found and all(e.consequence_only for e in found) else 1
    return (weight, rank.seen, rank.local)


def _read(rank: _Rank, out: Any, sel: selectors.BaseSelector) -> bool:
    """Relay what the rank wrote; at its end of output close its pipe. Whether there was more."""
    try:
        data = os.read(rank.fd, 65536)
    except OSError:
        data = b""
    if data:
        rank.relay(data, out)
    else:
        rank.close(out, sel)
    return bool(data)


def _close_pidfd(rank: _Rank, sel: selectors.BaseSelector) -> None:
    if rank.pidfd is not None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(rank.pidfd)
        os.close(rank.pidfd)
        rank.pidfd = None


def _poll_exit(pid: int) -> int | None:
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return 1
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _parent_signal(signum: int, frame: Any) -> None:
    """The launcher outlives the signals of a stop (the node entry relays them to the ranks; Slurm
    sends them to every process of the step): the ranks' output must still reach the node log."""


# --------------------------------------------------------------------------------------------- rank


def _rank_main(script: str, script_args: list[str], env: dict[str, str], out_fd: int) -> None:
    """In the forked child: become a fresh rank as far as the script can tell, run it, leave."""
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True, write_through=True
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
            write_through=True,
        )
        _reset_signals()
        _become(script, script_args, env)
        _set_title(script, script_args)
        code = run_script(script)
    except BaseException:  # noqa: BLE001 (anything before the script: report it, never return)
        import traceback

        traceback.print_exc()
    leave(code)


def _reset_signals() -> None:
    """What exec would leave: default dispositions (Python's own for SIGINT), SIG_IGN kept."""
    for sig in PARENT_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _become(script: str, script_args: list[str], env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *script_args]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in extra]
    sys.path[:] = [str(Path(script).resolve().parent), *extra, *rest]
    import torch  # imported already

    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the OpenMP runtime read it when the parent loaded it
        torch.set_num_threads(int(threads))
    # A fresh interpreter seeds torch's and numpy's global generators from the OS; forked, every rank
    # would share the launcher's (Python's random reseeds itself after a fork).
    torch.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    if env.get("PYTHONFAULTHANDLER"):  # a fresh interpreter reads it at start-up
        faulthandler.enable()
    _node_site(extra)


def prepare_titles() -> None:
    """Called by the launcher before it changes its environment. ``setproctitle`` is told to rewrite
    only the argv area (``SPT_NOENV``): otherwise it spills into the environment area, and
    ``/proc/<pid>/environ`` (``SLURM_JOB_ID`` and the rest, which tools read) becomes the title. The
    prewarmed launcher's argv has room for a title (``launcher_shim.TITLE_ROOM``)."""
    try:
        from setproctitle import getproctitle
    except ImportError:
        return
    had = os.environ.get("SPT_NOENV")
    os.environ["SPT_NOENV"] = "1"
    try:
        getproctitle()
    finally:
        if had is None:
            os.environ.pop("SPT_NOENV", None)


def _set_title(script: str, script_args: list[str]) -> None:
    """What ``ps`` shows (and ``pkill -f train.py`` matches): the rank's own command, not the
    launcher's. ``setproctitle`` rewrites the process's argv area (it ships with the ``train`` extra)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(" ".join([sys.executable, "-u", script, *script_args]))


def _node_site(pythonpath: list[str]) -> None:
    """The ranks' ``sitecustomize`` (script hooks), which a fresh interpreter would have run."""
    from orchestrator.node.site_path import NODE_SITE_DIR

    if NODE_SITE_DIR not in pythonpath:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_orchestrator_node_site", str(Path(NODE_SITE_DIR) / "sitecustomize.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.apply(chain=False)
