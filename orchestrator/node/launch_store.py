"""The job's rendezvous store, hosted by node 0's launcher, listening before any rank exists.

With ``init_process_group``'s ``env://`` and no agent, rank 0 creates the TCPStore server when it
reaches its process group, and every other rank connects to it. Ranks on other nodes often get
there first (the nodes start together; rank 0 is not special): their connect is refused, and c10d's
client waits a randomised back-off (0.5-0.7 s measured on this machine) before it tries again. That
made the ``process_group`` phase of a 2-node start-up 0.02 s in some runs and 0.3-0.7 s in others
(bench/README.md, item ``startup``).

torchrun avoids it by having its agent host the store (``TORCHELASTIC_USE_AGENT_STORE``). The direct
launcher does the same: node 0's launcher binds and listens on ``MASTER_PORT`` as soon as it knows
the launch (:func:`listen_early`), ~1-2 s before its ranks are forked, so an early client's connect
is queued by the kernel instead of refused. Once the ranks are forked, a child of the launcher
serves the store on that socket (:func:`start`, :func:`serve`) for as long as the ranks live: the
server's threads never live in the launcher, which forks the ranks (again, for a restart in place:
each start gets a fresh store, and the socket, kept open by the launcher, queues the new ranks'
connects meanwhile). Every rank, rank 0 included, is a client.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.contract import run_alive
from orchestrator.contract.errors import RunFailure
from orchestrator.rank.run_script import leave

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.schedulers.base import NodeEnvironment

#: torchrun's switch: set, ``env://`` makes every rank a client of the store at MASTER_ADDR:PORT.
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def listen_early(envs: list[dict[str, str]], held: socket.socket | None = None) -> socket.socket | None:
    """Node 0: the store's listening socket (bound now), and the ranks told to be clients. Other
    nodes: ranks told to be clients (of node 0's launcher or, if it could not bind, of rank 0: the
    client side is the same). None where nothing was bound (not node 0, or the port is taken: then
    rank 0 hosts the store as before, and meets the same error it always would). ``held``: the port's
    socket, bound and listening since the node chose the port (a local job's node 0): used as it is."""
    if not envs:
        if held is not None:
            held.close()
        return None
    for env in envs:
        env[USE_AGENT_STORE] = "True"
    if envs[0].get("GROUP_RANK", "0") != "0":
        if held is not None:
            held.close()
        return None
    if held is not None:
        return held
    try:
        return bind_listener(int(envs[0]["MASTER_PORT"]))
    except OSError:
        for env in envs:
            env[USE_AGENT_STORE] = "False"
        return None


def bind_listener(port: int) -> socket.socket:
    """A socket listening on ``port`` on every address (OSError where the port is taken)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(
            ("", port), family=socket.AF_INET6, backlog=socket.SOMAXCONN, dualstack_ipv6=True
        )
    return socket.create_server(("", port), backlog=socket.SOMAXCONN)


def hold_free_port(first: int, start: int, end: int) -> socket.socket:
    """A listening socket on the first port of ``[start, end]`` that nobody holds, trying from
    ``first`` on. The caller keeps it until the store owns it (:func:`listen_early`'s ``held``): a
    port that is only checked and let go can be taken by another job before the store binds it."""
    span = end - start + 1
    for i in range(span):
        port = start + (first - start + i) % span
        try:
            return bind_listener(port)
        except OSError:
            continue
    raise OSError(f"no free port in {start}-{end}")


def serve(listener: socket.socket, env: dict[str, str]) -> Any:
    """The TCPStore server on ``listener`` (which it then owns); keep the result referenced for as
    long as the ranks run."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    fd = listener.detach()
    try:
        return TCPStore(
            host_name=env["MASTER_ADDR"],
            port=int(env["MASTER_PORT"]),
            world_size=None,
            is_master=True,
            timeout=timedelta(minutes=30),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            socket.socket(fileno=fd).close()
        raise


#: The store's process name (``ps -o comm``): the node's signal relay leaves it out (it is no rank).
STORE_PROCESS_NAME = "rdzv-store"


class StoreProcess:
    """The rendezvous store served by a child of the launcher: the store's threads never live in the
    launcher, which stays a process that may fork ranks again (a restart in place), and each start
    of the ranks gets a store without the keys of the last (c10d's rendezvous keys are not per start:
    torchrun's agent makes a new store for every restart too)."""

    def __init__(self, pid: int, ready_fd: int) -> None:
        self.pid, self.ready_fd = pid, ready_fd

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.ready_fd)


def start(
    listener: socket.socket, env: dict[str, str], say: Callable[[str], None], clients: list[int]
) -> StoreProcess | None:
    """Fork the store's process and wait until it serves (milliseconds: torch is imported). If it
    cannot, its ``clients`` (the ranks' pids) would wait for it until their timeout: they are ended
    now, and the error says why."""
    read_fd, write_fd = os.pipe()
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:  # the store's process; never returns
        code = 1
        try:
            os.close(read_fd)
            run_alive.die_with_parent(launcher)
            _name_this_process(STORE_PROCESS_NAME)
            store = serve(socket.socket(fileno=os.dup(listener.fileno())), env)
            os.write(write_fd, b"1")
            while store is not None:
                signal.pause()  # the launcher's own no-op handlers came with the fork
        except BaseException as exc:  # noqa: BLE001 (said in the node log; the launcher sees the end)
            os.write(write_fd, f"0{exc!r}".encode())
        leave(code)
    os.close(write_fd)
    answer = os.read(read_fd, 4096)
    if answer[:1] == b"1":
        return StoreProcess(pid, read_fd)
    say(
        f"cannot serve the rendezvous store on port {env.get('MASTER_PORT')}: {answer[1:].decode() or 'it died'}"
    )
    StoreProcess(pid, read_fd).stop()
    for client in clients:
        with contextlib.suppress(ProcessLookupError):
            os.kill(client, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(client, 0)
    return None


#: In the attempt's folder: the port node 0 of a job on a shared host chose (:func:`rendezvous_port`).
RENDEZVOUS_PORT_FILE = "rendezvous_port"
#: How long the other nodes wait for node 0 to choose it.
RENDEZVOUS_PORT_WAIT_S = 60.0


def rendezvous_port(plan: LaunchPlan, node: NodeEnvironment, path: Path) -> tuple[int, Any]:
    """The rendezvous port, and on node 0 of a job on a shared host the socket that holds it.

    A node that is a whole machine of the job's own uses the port derived from the job id. Simulated
    nodes share one machine with other jobs, whose ids come from other registries (every
    ``ORCHESTRATOR_HOME`` numbers from ``local-1``): there node 0 takes a port nobody holds, keeps it
    bound and listening until its launcher's store owns it (the socket is handed over), and writes it
    where the other nodes read it. Measured before: two registries' ``local-1`` both chose port 29614
    and the second failed at once."""
    from orchestrator.config.render import port_for_job
    from orchestrator.contract.run_dir import write_json_atomic

    start, end = plan.profile.port_range.start, plan.profile.port_range.end
    derived = port_for_job(node.job_id, start, end)
    if not node.shares_host:
        return derived, None
    record = path / RENDEZVOUS_PORT_FILE
    if node.is_first_node:
        try:
            listener = hold_free_port(derived, start, end)
        except OSError as exc:
            raise RunFailure(f"rendezvous: {exc}") from None
        port = int(listener.getsockname()[1])
        write_json_atomic(record, {"port": port})
        return port, listener
    deadline = time.monotonic() + RENDEZVOUS_PORT_WAIT_S
    while True:
        from orchestrator.contract.run_dir import read_json

        data = read_json(record) or {}
        if isinstance(data.get("port"), int):
            return int(data["port"]), None
        if time.monotonic() > deadline:
            raise RunFailure(
                f"node 0 chose no rendezvous port within {RENDEZVOUS_PORT_WAIT_S:.0f} s ({record})"
            )
        time.sleep(0.1)


def _name_this_process(name: str) -> None:
    """``prctl(PR_SET_NAME)``: what ``ps`` and psutil's ``name()`` show (Linux; elsewhere nothing)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(15, name.encode(), 0, 0, 0)
