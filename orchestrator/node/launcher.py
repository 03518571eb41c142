"""The launcher on a node: ``accelerate launch`` started early, and a relay of signals to its workers.

torchrun forwards only INT/TERM/HUP/QUIT to its workers, so a pre-timeout USR2 would otherwise
never reach training; and its workers live in sessions of their own, so signalling the launcher's
process group would miss them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import IO, Any

#: Signals relayed to every training process.
FORWARDED_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: ``python -m`` this to run ``accelerate`` so that it survives USR1/USR2.
SHIM_MODULE = "orchestrator.node.launcher_shim"


class PrewarmedLauncher:
    """The launcher's interpreter, started early (see :mod:`orchestrator.node.launcher_shim`) and handed its
    command later. Measured on 2 busy cores: the node entry spent ~0.5 s importing the plan and
    rendering before it could even start the launcher, whose own imports then took ~2 s more."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: socket.socket | None = None
        self.kept: Generation | None = None
        """The launcher handed off with ``keep`` whose last start of the ranks failed and that waits
        for the next (a restart in place); None once it ended or was never kept."""
        self.rendezvous: tuple[str, int] | None = None
        """The kept launcher's rendezvous address and port: its store's socket stays bound to it."""
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            return  # the plain ``accelerate`` command is used then (launcher_argv)
        from orchestrator.node.launcher_shim import CHANNEL_ENV, PARENT_ENV, PREWARMED_ARG, TITLE_ROOM

        # A channel for the rendezvous socket the node may hand over later (hand_off's ``listener``).
        self.channel, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", SHIM_MODULE, PREWARMED_ARG, " " * TITLE_ROOM],
                stdin=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(theirs.fileno(),),
                env={**os.environ, PARENT_ENV: str(os.getpid()), CHANNEL_ENV: str(theirs.fileno())},
            )
        finally:
            theirs.close()

    def hand_off(
        self,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        node_log_bin: IO[bytes],
        listener: socket.socket | None = None,
        keep: bool = False,
    ) -> Any:
        """Run ``argv`` (``accelerate launch ...``) in the prewarmed interpreter, or start it now.

        ``listener``: the rendezvous port's socket, bound by the node since it chose the port; the
        prewarmed launcher gets the socket itself (over its channel), so the port is never free
        between the choice and the store. Closed here in every case. ``keep``: the launcher outlives
        a failed start of its ranks (a :class:`Generation` is returned, waited on like the process)
        and takes the next request of a restart in place; a launcher already kept gets this one."""
        from orchestrator.node.launcher_shim import PARENT_ENV

        if self.kept is not None:
            kept, self.kept = self.kept, None
            if listener is not None:
                listener.close()
            return kept.next(argv, env, log_path)
        proc, self.proc = self.proc, None
        channel, self.channel = self.channel, None
        fresh_env = {**env, PARENT_ENV: str(os.getpid())}
        try:
            if proc is None or argv[:1] != ["accelerate"] or proc.poll() is not None:
                if proc is not None:
                    _discard(proc)
                return _start(argv, fresh_env, node_log_bin, listener)
            assert proc.stdin is not None
            keep = keep and channel is not None
            request = json.dumps(
                {
                    "argv": argv[1:],
                    "env": env,
                    "log": str(log_path),
                    "listener": listener is not None,
                    "keep": keep,
                }
            )
            try:
                if listener is not None:
                    assert channel is not None
                    socket.send_fds(channel, [b"L"], [listener.fileno()])
                proc.stdin.write(request.encode() + b"\n")
                if not keep:
                    proc.stdin.close()
                else:
                    proc.stdin.flush()
            except (BrokenPipeError, ConnectionError):  # it died while importing: the ordinary way
                _discard(proc)
                return _start(argv, fresh_env, node_log_bin, listener)
            if keep:
                assert channel is not None
                kept_channel = channel
                channel = None  # kept open for the launcher's reports
                return Generation(proc, kept_channel)
            return proc
        finally:
            if listener is not None:
                listener.close()
            if channel is not None:
                channel.close()

    def keep(self, generation: Generation) -> None:
        """After ``generation`` ended: keep its launcher for the next request when it reported a failed
        start (it waits for one); not when the launcher itself ended (nothing to keep)."""
        if generation.reported:
            self.kept = generation

    def release(self) -> None:
        """At the node task's end: a kept launcher is told there is no next request (EOF) and ends."""
        kept, self.kept = self.kept, None
        if kept is not None:
            kept.end()
        self.discard()

    def discard(self) -> None:
        """Not launching after all: stop the prewarmed interpreter."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _discard(proc)
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()


class Generation:
    """One start of the ranks in a launcher kept for restarts in place, waited on as the launcher's
    ``Popen`` is (``pid``, ``wait``, ``kill``, ``returncode``): it ends when the launcher
    reports the start's exit code on its channel, or when the launcher itself exits."""

    #: How long ``wait()`` without a timeout waits for a killed start's report before ending the launcher.
    REPORT_WAIT_S = 60.0

    def __init__(self, proc: subprocess.Popen[bytes], channel: socket.socket) -> None:
        self.proc, self.channel = proc, channel
        self.pid = proc.pid
        self.returncode: int | None = None
        self.reported = False
        self.forked = False
        """Children of this start were seen (each :meth:`wait` looks until they are): its ranks ran."""
        self._buffer = b""

    def next(self, argv: list[str], env: dict[str, str], log_path: Path) -> Generation:
        """Hand the kept launcher its next request; the new start's handle."""
        assert self.proc.stdin is not None
        request = json.dumps({"argv": argv[1:], "env": env, "log": str(log_path)})
        try:
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ConnectionError, ValueError):
            pass  # it ended: the new handle reads its exit
        return Generation(self.proc, self.channel)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        self.forked = self.forked or self._has_children()
        bounded = timeout if timeout is not None else self.REPORT_WAIT_S
        deadline = time.monotonic() + bounded
        while True:
            ready, data = self._read(max(0.0, min(0.1, deadline - time.monotonic())))
            if b"\n" in self._buffer:
                self.returncode, self.reported = int(self._buffer.split(b"\n", 1)[0] or 1), True
                return self.returncode
            if (ready and not data) or self.proc.poll() is not None:  # the launcher itself ended
                self.returncode = self.proc.wait()
                return self.returncode
            if time.monotonic() >= deadline:
                if timeout is None:  # a killed start never reported: the launcher goes too
                    self.proc.kill()
                    self.returncode = self.proc.wait()
                    return self.returncode
                raise subprocess.TimeoutExpired(["launcher"], bounded)

    def kill(self) -> None:
        """End this start's ranks (and its store); the launcher lives on and reports their end.

        A start whose ranks are not forked yet (the launcher still reads the request or runs the
        script's imports) would fork them after a kill of what is there now, and they would train on
        unseen. So the launcher is frozen (SIGSTOP) while its children are read. With children (the
        ranks, their store, or ranks dead and not yet reaped) they are killed and it goes on; with
        none, none ever seen by :meth:`wait` (torchrun's agent reaps its dead workers a while before it
        reports) and no report of an ended start on the channel, the start has not forked: the launcher
        itself is killed, which ends the start (a later start gets a fresh launcher:
        :meth:`PrewarmedLauncher.keep` keeps none that did not report)."""
        import psutil

        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGSTOP)
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        unforked = not children and not self.forked and not self._report_came()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        with contextlib.suppress(OSError):
            if unforked:
                self.proc.kill()
            else:  # before the wait: a frozen launcher cannot reap its killed ranks (10 s lost in CI)
                os.kill(self.pid, signal.SIGCONT)
        psutil.wait_procs(children, timeout=10)

    def _has_children(self) -> bool:
        import psutil

        try:
            return any(not _is_store(p) for p in psutil.Process(self.pid).children())
        except psutil.NoSuchProcess:
            return False

    def _report_came(self) -> bool:
        """Whether the launcher reported this start's end (kept for :meth:`wait`), or closed its end."""
        ready, data = self._read(0.0)
        return (ready and not data) or b"\n" in self._buffer

    def _read(self, timeout: float) -> tuple[bool, bytes]:
        """What the channel has within ``timeout`` (added to the buffer): (readable, the bytes); b"" from
        a readable channel means the launcher ended (a reset: killed before its ranks were forked)."""
        import select

        ready = bool(select.select([self.channel], [], [], timeout)[0])
        try:
            data = self.channel.recv(64) if ready else b""
        except OSError:
            data = b""
        self._buffer += data
        return ready, data

    def end(self) -> None:
        """No next request: the launcher exits with the last start's code."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.channel.close()


def _start(
    argv: list[str], env: dict[str, str], node_log_bin: IO[bytes], listener: socket.socket | None
) -> subprocess.Popen[bytes]:
    """The launcher started now. Its rendezvous is bound by whoever hosts the store there (rank 0, or
    torchrun's agent), so a port held by the node is let go just before."""
    if listener is not None:
        listener.close()
    return subprocess.Popen(
        launcher_argv(argv),
        env=env,
        stdout=node_log_bin,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _discard(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()


class SignalRelay:
    """Sends the signals this process receives to every process under the launcher.

    The workers are torchrun's children in sessions of their own; signalling the
    launcher's process group would miss them, so walk the tree each time. Installed
    before the launcher exists: a signal that arrives then is only recorded (the node
    then does not launch at all), never handled by submitit's own handlers (its USR2
    handler would fail or requeue the job behind our back).
    """

    def __init__(
        self, launcher: subprocess.Popen[bytes] | None, log: Any, stop_signals: tuple[int, ...] = ()
    ) -> None:
        self.launcher = launcher
        self.log = log
        self.stop_signals = stop_signals
        """Signals that end the attempt: one that arrives before any worker exists stops the launcher
        (a worker started later would never hear of it and train on until the hard kill)."""
        self.received: list[int] = []
        self.terminated_at: float | None = None
        """When the first SIGTERM arrived (monotonic): the grace before the kill starts then."""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in FORWARDED_SIGNALS:
            # A signal this node was started ignoring stays ignored (local jobs ignore the terminal's
            # SIGINT: see LocalScheduler.schedule); relaying it would stop the training it spares.
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _say(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S") + f".{int(time.time() * 1000) % 1000:03d}"
        print(f"[orchestrator node] {stamp} {line}", file=self.log, flush=True)

    def send(self, signum: int) -> None:
        """This node's own stop (``--budget``): the ranks get ``signum`` as if the scheduler had sent it."""
        self._handle(signum, None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        import psutil

        self.received.append(signum)
        if signum == signal.SIGTERM and self.terminated_at is None:
            self.terminated_at = time.monotonic()
        name = signal.Signals(signum).name
        if self.launcher is None or self.launcher.returncode is not None:
            self._say(f"received {name} while no training runs")
            return
        try:
            launcher = psutil.Process(self.launcher.pid)
            children = [p for p in launcher.children(recursive=True) if not _is_store(p)]
        except psutil.NoSuchProcess:
            return
        if not children and signum in self.stop_signals:
            # Training has not started: nothing to checkpoint, and a worker spawned after this
            # moment would never get the signal. End the launch; the node reports a requeue.
            with contextlib.suppress(psutil.NoSuchProcess):
                launcher.kill()
            self._say(f"received {name} before training started: launcher stopped")
            return
        # Workers get the signal itself (their handlers checkpoint); the launcher is
        # left alone so it does not SIGKILL them 30 s later (torchrun on TERM).
        targets = children or [launcher]
        for proc in targets:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signum)
        self._say(f"relayed {name} to {len(targets)} process(es)")


def _is_store(proc: Any) -> bool:
    """Node 0's rendezvous store process (orchestrator.node.launch_store): a child of the launcher,
    but no rank: a signal is not relayed to it, nor counted."""
    import psutil

    from orchestrator.node.launch_store import STORE_PROCESS_NAME

    try:
        return bool(proc.name() == STORE_PROCESS_NAME)
    except psutil.Error:
        return False


def stop_signal(signal_name: str) -> int:
    """The profile's pre-timeout signal (USR2 by default) as a number."""
    name = signal_name.upper()
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}", signal.SIGUSR2))


def launcher_argv(argv: list[str]) -> list[str]:
    """``accelerate launch ...`` run through :mod:`orchestrator.node.launcher_shim` with this interpreter, so the
    launcher survives USR1/USR2 (falls back to the plain command where accelerate is not importable)."""
    import importlib.util

    if not argv or argv[0] != "accelerate" or importlib.util.find_spec("accelerate") is None:
        return argv
    return [sys.executable, "-m", SHIM_MODULE, *argv[1:]]


def kill_tree(pid: int) -> None:
    """Leave no worker behind (torchrun's workers live in their own sessions)."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
