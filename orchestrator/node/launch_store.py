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
is queued by the kernel instead of refused. Once its ranks are forked (never before: the server's
thread must not be in the parent at ``fork``), it serves the store on that socket (:func:`serve`),
for as long as the launcher lives, which is as long as the ranks do. Every rank, rank 0 included, is
a client.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

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
