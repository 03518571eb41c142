"""The Slurm job's environment, read where it runs: ``SLURM_*`` (the only reader), the allocation's
nodes, and the commands that reach them.

``socket`` and ``subprocess`` are imported where used: ``render`` needs none of this.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from orchestrator.contract.errors import RunFailure, UserError
from orchestrator.contract.run_dir import cancel_requested
from orchestrator.schedulers.slurm.cancel_verdict import SlurmView, cancel_verdict, parse_view

SINFO_TIMEOUT_S = 15.0
SCANCEL_TIMEOUT_S = 30.0
#: How long a job that Slurm is ending waits for accounting to record why (it lags slurmctld).
ACCOUNTING_CATCH_UP_S = 10.0
#: How long non-zero nodes wait for node 0 to publish its address.
MAIN_IP_WAIT_S = 120.0
#: Variables an allocation sets that a job submitted from inside it must not inherit.
INHERITED_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SUBMITIT_")
#: The attempt a training step's nodes are in, set by the batch step on each srun: a restart inside
#: the allocation is a new attempt that ``SLURM_RESTART_COUNT`` does not count.
STEP_ATTEMPT_ENV = "ORCHESTRATOR_STEP_ATTEMPT"
#: The batch step's word to a step that runs on fewer nodes than the plan (the job shrank after a
#: node loss: ``on_node_loss: shrink``): how many.
STEP_NODES_ENV = "ORCHESTRATOR_STEP_NODES"


# ---------------------------------------------------------------------------- the job's environment
def batch_job_id() -> str:
    """This job's id as the registry and Slurm's commands name it: ``<array>_<task>`` for a task of
    a job array (a sweep; ``scontrol requeue`` of that id requeues the task alone)."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID", "")


def step_attempt() -> int | None:
    """The attempt the batch step started this step as (:data:`STEP_ATTEMPT_ENV`), if it said."""
    try:
        value = os.environ.get(STEP_ATTEMPT_ENV)
        return int(value) if value else None
    except ValueError:
        return None


def batch_restarts() -> int:
    """How often Slurm requeued this job (``SLURM_RESTART_COUNT``; absent on the first run)."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


#: sinfo's short node states of a node Slurm will place a job on; any suffix (``*`` not responding,
#: ``~`` powered off, ``@`` reboot pending, ...) or another state (down, drain, fail, ...) is not.
IN_SERVICE_STATES = frozenset({"idle", "mix", "alloc", "comp"})


def nodes_in_service(nodes: list[str]) -> frozenset[str]:
    """Those of ``nodes`` that Slurm says it would place a job on now (one ``sinfo``; an empty set
    when it cannot be asked: the caller then keeps excluding them, as before)."""
    import subprocess

    if not nodes:
        return frozenset()
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    if proc.returncode != 0:
        return frozenset()
    states: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        name, _, state = line.strip().partition(" ")
        states.setdefault(name, set()).add(state.strip())  # a node in two partitions: two lines
    return frozenset(n for n, seen in states.items() if n in nodes and seen <= IN_SERVICE_STATES)


def allocation_nodes() -> list[str]:
    """Host names of this allocation (``SLURM_JOB_NODELIST`` expanded by Slurm itself)."""
    import subprocess

    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodelist:
        return []
    proc = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
    )
    return proc.stdout.split() if proc.returncode == 0 else []


def clean_submit_environment() -> None:
    """sbatch inside an allocation inherits its SLURM_*/SBATCH_* variables (node list, task
    counts, memory): a job submitted from there must be described by its own script only."""
    for name in list(os.environ):
        if name.startswith(INHERITED_PREFIXES):
            del os.environ[name]


def cancelled_by_user(run_dir: Path, job_id: str, asked: SlurmView | None = None) -> str | None:
    """Why not to requeue: ``orchestrator cancel`` left its marker, or Slurm says the job was
    cancelled (a plain ``scancel`` also sends SIGTERM, which training handles like a preemption:
    :mod:`orchestrator.schedulers.slurm.cancel_verdict` tells them apart). Bounded: accounting is
    waited for at most :data:`ACCOUNTING_CATCH_UP_S`. ``asked``: a view of the job just taken (the
    first look then asks Slurm nothing more)."""
    import time

    if cancel_requested(run_dir):
        return "cancelled by user (orchestrator cancel)"
    deadline = time.monotonic() + ACCOUNTING_CATCH_UP_S
    view = asked or slurm_view(job_id)
    while True:
        verdict = cancel_verdict(view, patient=time.monotonic() < deadline)
        if verdict.settled:
            return verdict.cancelled
        time.sleep(0.5)
        view = slurm_view(job_id)


def slurm_view(job_id: str) -> SlurmView:
    """``scontrol show job -o`` and ``sacct``'s State of ``job_id`` (each bounded; a command that
    cannot answer leaves its part empty, sacct's None: no accounting)."""
    import subprocess

    def ask(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None

    shown = ask(["scontrol", "show", "job", "-o", job_id])
    line = shown.stdout if shown is not None and shown.returncode == 0 else ""
    acct = ask(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    state = acct.stdout.strip().splitlines()[-1:] if acct is not None and acct.returncode == 0 else None
    return parse_view(line, None if state is None else (state[0] if state else ""))


def interface_address(name: str) -> str:
    """IPv4 address of a network interface on this host (e.g. ib0)."""
    import socket

    import psutil

    addrs = psutil.net_if_addrs().get(name)
    if not addrs:
        raise RunFailure(f"network_interface '{name}' does not exist on {socket.gethostname()}")
    for addr in addrs:
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise RunFailure(f"network_interface '{name}' on {socket.gethostname()} has no IPv4 address")


def srun_on_every_node(nodes: list[str], job_id: str | None = None, overlap: bool = True) -> list[str]:
    """One task per node of the allocation, beside the running step (``--overlap``; without it for a
    step that runs alone, the preflight); ``job_id`` from outside the allocation (the login host)."""
    return [
        "srun",
        *([f"--jobid={job_id}"] if job_id else []),
        *(["--overlap"] if overlap else []),
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        "--kill-on-bad-exit=0",
        "--quiet",
    ]


def job_nodes(job_id: str) -> list[str]:
    """A running job's nodes (squeue), expanded; [] when it is not running."""
    import subprocess

    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        if not out:
            return []
        return subprocess.run(
            ["scontrol", "show", "hostnames", out], capture_output=True, text=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return []


def partition_node_cpus(partition: str) -> dict[str, int]:
    """``{node: CPUs}`` of a partition's nodes, asking sinfo once (bounded)."""
    import subprocess

    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-p", partition, "-o", "%N %c"],
            capture_output=True,
            text=True,
            timeout=SINFO_TIMEOUT_S,
        )
    except FileNotFoundError:
        raise UserError(
            "sinfo not found: this profile needs a Slurm cluster (or use --profile local)"
        ) from None
    except subprocess.TimeoutExpired:
        raise RunFailure(f"sinfo did not answer within {SINFO_TIMEOUT_S:.0f} s: is slurmctld up?") from None
    if proc.returncode != 0:
        raise RunFailure(f"sinfo failed: {proc.stderr.strip() or proc.returncode}")
    nodes: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            nodes[parts[0]] = int(parts[1])
    if not nodes:
        raise UserError(
            f"--profile: partition '{partition}' does not exist on this cluster (sinfo knows nothing of it)"
        )
    return nodes


def expand_hostlist(text: str) -> list[str]:
    """A Slurm host list (``n[1-3],gpu01``) expanded by Slurm itself; UserError when it is not one.
    The syntax is checked first: scontrol reads ``zz[1-3`` as ``zz]`` instead of refusing it."""
    import re
    import subprocess

    items = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text)
    item_re = re.compile(r"[A-Za-z0-9_.-]+(?:\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\][A-Za-z0-9_.-]*)*")
    if not text or ",".join(items) != text or not all(item_re.fullmatch(i) for i in items):
        raise UserError(f"--exclude {text!r}: not a Slurm host list (expected names such as n1,n2 or n[1-4])")

    try:
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=SINFO_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RunFailure(f"scontrol show hostnames failed: {exc}") from None
    names = proc.stdout.split()
    if proc.returncode != 0 or not names:
        why = (proc.stderr.strip().splitlines() or ["not a host list"])[-1]
        raise UserError(f"--exclude {text!r}: not a Slurm host list ({why})")
    return names


def this_node() -> str | None:
    """The Slurm name of the node this process runs on (slurmd's ``SLURMD_NODENAME``), if in a job."""
    return os.environ.get("SLURMD_NODENAME") or None


def step_nodes() -> int | None:
    """The step's node count when the batch step shrank it (:data:`STEP_NODES_ENV`), else None."""
    value = os.environ.get(STEP_NODES_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def step_hostnames() -> list[str] | None:
    """The host names of this task's step (``SLURM_STEP_NODELIST``), None outside a step. With spare
    nodes a step runs on some of the allocation's nodes, whose list is the job's."""
    from submitit.slurm.slurm import _parse_node_list

    listed = os.environ.get("SLURM_STEP_NODELIST", "")
    return _parse_node_list(listed) if listed else None


def fill_task_variables(env: MutableMapping[str, str]) -> None:
    """Inside Slurm 22.05's OCI containers the task's own variables are the batch script's: every
    node's task saw ``SLURM_NODEID=0``, ``SLURM_PROCID=0`` and the first node's SLURMD_NODENAME
    (measured), so both nodes took rank 0. A job runs one task per node (``--ntasks-per-node=1``): the
    task's rank is its host's place in the step's node list (expanded by submitit's own parser: the
    image has no ``scontrol``; the container shares the node's hostname)."""
    import socket

    from submitit.slurm.slurm import _parse_node_list

    listed = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    nodes = _parse_node_list(listed) if listed else []
    host = socket.gethostname()
    me = host if host in nodes else host.split(".")[0]
    if me not in nodes:
        raise RunFailure(f"node {me} is not in the step's node list {listed!r}: cannot tell its rank")
    env["SLURM_NODEID"] = env["SLURM_PROCID"] = str(nodes.index(me))
    env["SLURM_LOCALID"] = "0"
    env["SLURMD_NODENAME"] = me
