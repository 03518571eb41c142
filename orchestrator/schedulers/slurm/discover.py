"""What a Slurm cluster says about itself, for ``orchestrator profiles init``: partitions, their
nodes, the user's accounts and QOS, ``cred_expire``, pyxis, and (from one short step on a node) the
container runtimes and the fast network interface.

The parsers are pure (the text of ``scontrol show partition|node -o``, ``sacctmgr -nP``, ``scontrol
show config`` in, records out; tested on the real cluster's output); :func:`ask_cluster` runs the
commands, each bounded, and reports what it could not learn instead of failing.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field

#: Bound on each command (``sinfo``-class queries; the node step gets :data:`NODE_STEP_TIMEOUT_S`).
QUERY_TIMEOUT_S = 30.0
NODE_STEP_TIMEOUT_S = 90.0
#: Runtimes ``profiles init`` looks for on a node's PATH.
RUNTIMES = ("apptainer", "singularity", "enroot", "podman")
#: Interface name prefixes of fast fabrics, best first (InfiniBand, HPE Slingshot, AWS EFA-backed...).
FAST_INTERFACES = ("ib", "hsn", "ens", "efa")


@dataclass
class Partition:
    name: str
    default: bool
    nodes: list[str]
    max_time: str | None
    """Slurm's time format; None when UNLIMITED."""
    max_nodes: int | None
    """The partition's MaxNodes (None: UNLIMITED)."""
    allow_accounts: list[str] | None = None
    allow_qos: list[str] | None = None


@dataclass
class Node:
    name: str
    cpus: int
    memory_mb: int
    gres: str
    partitions: list[str]
    state: str

    def gpus(self) -> tuple[int, str | None]:
        """(count, type) of the node's GPUs from its GRES (``gpu:a100:8``, ``gpu:4(S:0-1)``)."""
        kinds = self.gpu_kinds()
        return sum(n for _, n in kinds), next((k for k, _ in kinds if k), None)

    def gpu_kinds(self) -> list[tuple[str | None, int]]:
        """Each GPU entry of the node's GRES, in its order: (type as the cluster spells it, or None
        for ``gpu:N``; count). ``gpu:a100:2,gpu:v100:2`` is two entries: a job asking for
        ``gpu:a100:N`` gets only the first two GPUs."""
        out: list[tuple[str | None, int]] = []
        for item in self.gres.split(","):
            parts = item.split("(")[0].split(":")
            if parts[0] != "gpu" or len(parts) < 2:
                continue
            if len(parts) == 2 and parts[1].isdigit():
                out.append((None, int(parts[1])))
            elif len(parts) >= 3 and parts[2].isdigit():
                out.append((parts[1], int(parts[2])))
        return out


@dataclass
class Association:
    account: str
    partition: str
    qos: list[str]
    default_qos: str


@dataclass
class ClusterFacts:
    """Everything found; ``missing`` says what could not be learned and why (one line each)."""

    partitions: list[Partition] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    associations: list[Association] = field(default_factory=list)
    default_account: str | None = None
    cred_expire_s: int = 120
    pyxis: bool = False
    runtimes: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)
    probed_node: str | None = None
    missing: list[str] = field(default_factory=list)


def _fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` of one ``scontrol -o`` line (values without spaces)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", line)}


def expand_hostlist(text: str) -> list[str]:
    """``n[1-3,5],gpu01`` -> names (submitit's parser: the same rules as Slurm's)."""
    from submitit.slurm.slurm import _parse_node_list

    return _parse_node_list(text) if text and text != "(null)" else []


def parse_partitions(text: str) -> list[Partition]:
    out = []
    for line in text.splitlines():
        f = _fields(line)
        if "PartitionName" not in f:
            continue
        max_time = f.get("MaxTime", "UNLIMITED")
        max_nodes = f.get("MaxNodes", "UNLIMITED")

        def names(value: str | None) -> list[str] | None:
            return None if value in (None, "ALL", "") else value.split(",")

        out.append(
            Partition(
                name=f["PartitionName"],
                default=f.get("Default") == "YES",
                nodes=expand_hostlist(f.get("Nodes", "")),
                max_time=None if max_time in ("UNLIMITED", "INFINITE") else max_time,
                max_nodes=int(max_nodes) if max_nodes.isdigit() else None,
                allow_accounts=names(f.get("AllowAccounts")),
                allow_qos=names(f.get("AllowQos")),
            )
        )
    return sorted(out, key=lambda p: (not p.default, p.name))


def parse_nodes(text: str) -> list[Node]:
    out = []
    for line in text.splitlines():
        f = _fields(line)
        if "NodeName" not in f:
            continue
        cpus = f.get("CPUTot", "0")
        mem = f.get("RealMemory", "0")
        out.append(
            Node(
                name=f["NodeName"],
                cpus=int(cpus) if cpus.isdigit() else 0,
                memory_mb=int(mem) if mem.isdigit() else 0,
                gres="" if f.get("Gres") in (None, "(null)") else f["Gres"],
                partitions=[p for p in f.get("Partitions", "").split(",") if p],
                state=f.get("State", ""),
            )
        )
    return out


def parse_associations(text: str) -> list[Association]:
    """``sacctmgr -nP show assoc user=U format=account,partition,qos,defaultqos``."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0]:
            continue
        out.append(Association(parts[0], parts[1], [q for q in parts[2].split(",") if q], parts[3]))
    return out


def parse_cred_expire(config_text: str) -> int:
    """``cred_expire`` from ``scontrol show config``'s AuthInfo (Slurm's default: 120 s)."""
    m = re.search(r"cred_expire=(\d+)", config_text)
    return int(m.group(1)) if m else 120


def parse_node_probe(text: str) -> tuple[list[str], list[str]]:
    """The node step's output: ``runtime NAME`` and ``iface NAME`` lines."""
    runtimes, interfaces = [], []
    for line in text.splitlines():
        kind, _, name = line.strip().partition(" ")
        if kind == "runtime" and name in RUNTIMES:
            runtimes.append(name)
        elif kind == "iface" and name and name != "lo":
            interfaces.append(name)
    return runtimes, interfaces


def fast_interface(interfaces: list[str]) -> str | None:
    """The node's fabric interface, when it has one that is not plain Ethernet (``ib0``, ``hsn0``)."""
    for prefix in FAST_INTERFACES[:2]:
        for name in sorted(interfaces):
            if name.startswith(prefix):
                return name
    return None


#: What the node step prints: the runtimes on its PATH and its network interfaces.
NODE_PROBE = (
    "for r in " + " ".join(RUNTIMES) + '; do command -v "$r" >/dev/null 2>&1 && echo "runtime $r"; done; '
    'for i in /sys/class/net/*; do echo "iface ${i##*/}"; done'
)


def _run(argv: list[str], timeout: float = QUERY_TIMEOUT_S) -> tuple[str | None, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return None, f"{argv[0]} is not installed here"
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(argv[:3])}` gave no answer within {timeout:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return None, f"`{' '.join(argv[:3])}` failed: {last}"
    return done.stdout, ""


def ask_cluster(
    user: str | None = None, partition: str | None = None, probe_node: bool = True
) -> ClusterFacts:
    """Ask the cluster (from a login host: scontrol, sacctmgr, srun); what fails is in ``missing``."""
    facts = ClusterFacts()
    user = user or os.environ.get("USER") or os.environ.get("LOGNAME") or "root"
    text, why = _run(["scontrol", "show", "partition", "-o"])
    if text is None:
        facts.missing.append(f"partitions: {why}")
    else:
        facts.partitions = parse_partitions(text)
    text, why = _run(["scontrol", "show", "node", "-o"])
    if text is None:
        facts.missing.append(f"nodes: {why}")
    else:
        facts.nodes = parse_nodes(text)
    text, why = _run(["scontrol", "show", "config"])
    if text is None:
        facts.missing.append(f"cred_expire: {why}")
    else:
        facts.cred_expire_s = parse_cred_expire(text)
    text, why = _run(
        ["sacctmgr", "-nP", "show", "assoc", f"user={user}", "format=account,partition,qos,defaultqos"]
    )
    if text is None:
        facts.missing.append(f"accounts and QOS: {why}")
    else:
        facts.associations = parse_associations(text)
    text, _ = _run(["sacctmgr", "-nP", "show", "user", user, "format=defaultaccount"])
    if text and text.strip():
        facts.default_account = text.strip().splitlines()[0].strip() or None
    text, why = _run(["srun", "--help"])
    facts.pyxis = bool(text and "--container-image" in text)
    chosen = partition or next((p.name for p in facts.partitions), None)
    if probe_node and chosen:
        argv = [
            "srun",
            f"--partition={chosen}",
            "--nodes=1",
            "--ntasks=1",
            "--time=2",
            "--quiet",
            "bash",
            "-c",
            NODE_PROBE,
        ]
        text, why = _run(argv, NODE_STEP_TIMEOUT_S)
        if text is None:
            facts.missing.append(f"container runtimes and network interfaces of a node: {why}")
        else:
            facts.runtimes, facts.interfaces = parse_node_probe(text)
            facts.probed_node = chosen
    return facts
