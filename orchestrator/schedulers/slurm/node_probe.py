"""Which nodes of the allocation can still run a step: a tiny step of their own on each
(``srun --overlap -w NODE true``, bounded), answered by slurmd's port first where Slurm says which it
is. Used after a failed step (:mod:`orchestrator.schedulers.slurm.auto_resume`) and by the batch step
when srun hangs on a lost node."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from orchestrator.schedulers.slurm.environment import nodes_in_service, this_node

#: Bound on one node probe. A live node runs ``true`` in well under a second; a dead one makes
#: srun wait for slurmd's answer (``MessageTimeout``, 10 s by default) and retry.
PROBE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class ProbeResult:
    node: str
    alive: bool
    detail: str


def probe_node(node: str, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Can ``node`` still run a step of this job? ``--overlap``: the failed step may still hold
    resources on live nodes while it is being cleaned up."""
    argv = [
        "srun",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=1",
        "--quiet",
        "true",
    ]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(node, False, f"no answer within {timeout_s:.0f} s")
    except OSError as exc:
        return ProbeResult(node, False, f"srun could not run: {exc}")
    if proc.returncode == 0:
        return ProbeResult(node, True, "ok")
    return ProbeResult(node, False, (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1])


def slurmd_addresses(nodes: list[str]) -> dict[str, tuple[str, int]]:
    """``node -> (address, port)`` of each node's slurmd, where Slurm says it unambiguously (one
    ``scontrol show node`` and ``show config``); {} when it cannot be told (several slurmd on one
    address without their ports: multiple-slurmd set-ups)."""
    try:
        shown = subprocess.run(
            ["scontrol", "show", "node", "-o", ",".join(nodes)], capture_output=True, text=True, timeout=10
        ).stdout
        config = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    import re

    default = re.search(r"^SlurmdPort\s*=\s*(\d+)", config, re.M)
    out: dict[str, tuple[str, int]] = {}
    for line in shown.splitlines():
        name, addr, port = (re.search(rf"\b{k}=(\S+)", line) for k in ("NodeName", "NodeAddr", "Port"))
        if name and addr and (port or default):
            out[name.group(1)] = (addr.group(1), int((port or default).group(1)))  # type: ignore[union-attr]
    if len({a for a, _ in out.values()}) < len(out) and not all(
        "Port=" in line for line in shown.splitlines()
    ):
        return {}
    return out


def slurmd_refuses(address: tuple[str, int], timeout_s: float = 2.0) -> bool:
    """True when the node answers but nothing listens on its slurmd port: its slurmd is gone, and the
    node can run no step (the srun probe would wait ``MessageTimeout``, 10 s by default, to say so).
    A timeout proves nothing (a firewall, a busy node): the srun probe decides then."""
    import socket

    try:
        with socket.create_connection(address, timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def slurmd_answers(address: tuple[str, int], timeout_s: float = 2.0) -> bool:
    """True only when something accepts a connection on the node's slurmd port."""
    import socket

    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


def back_in_service(nodes: list[str]) -> frozenset[str]:
    """Those of ``nodes`` (lost earlier) that are back: Slurm places jobs on them (``sinfo``) and
    their slurmd answers on its port. Both, because a node that died minutes ago can still look
    allocated and responding to ``sinfo`` until Slurm's next ping fails (``SlurmdTimeout``); where
    the slurmd addresses cannot be told (several slurmd on one address), none is."""
    candidates = sorted(nodes_in_service(nodes))
    if not candidates:
        return frozenset()
    addresses = slurmd_addresses(candidates)
    return frozenset(n for n in candidates if n in addresses and slurmd_answers(addresses[n]))


def probe_nodes(nodes: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> list[ProbeResult]:
    """All nodes at once: the check takes one probe's time, not one per node. A node whose slurmd
    port refuses connections is lost at once; the others get the srun probe."""
    if not nodes:
        return []
    addresses = slurmd_addresses(nodes)
    me = this_node()
    if me is None or me not in addresses or slurmd_refuses(addresses[me]):
        # This node's own slurmd runs (this job is on it): if it seems not to, the addresses are wrong.
        addresses = {}

    def probe(node: str) -> ProbeResult:
        address = addresses.get(node)
        if address is not None and slurmd_refuses(address):
            return ProbeResult(node, False, f"slurmd at {address[0]}:{address[1]} refuses connections")
        return probe_node(node, timeout_s)

    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        return list(pool.map(probe, nodes))
