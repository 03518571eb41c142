"""Helpers for tests that run against the real Slurm test cluster of ``tests/cluster/``.

Start the tests through ``bash tests/cluster/run_with_cluster.sh python -m pytest ...``: it starts
a fresh cluster, exports ``ORCHESTRATOR_TEST_CLUSTER=1`` and the lines of ``$BASE/cluster.env``,
and stops the cluster afterwards.

This is a plain module, not a conftest: import what you need, e.g.::

    from tests.helpers.slurm_cluster import require_cluster, wait_for_job_state

Every wait here polls a condition with a deadline; none sleeps as a means of synchronisation.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.helpers.cli import REPO
from tests.helpers.preconditions import in_ci

ENV_FLAG = "ORCHESTRATOR_TEST_CLUSTER"
ENV_PREFIX = "ORCHESTRATOR_TEST_CLUSTER_"
DEFAULT_BASE = "/tmp/orchestrator-slurm"
CLUSTER_SCRIPTS = REPO / "tests" / "cluster"

#: Job states after which a job never runs again by itself. NODE_FAIL and PREEMPTED are left out:
#: with JobRequeue=1 a batch job in those states is usually requeued (and runs again).
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    """The running test cluster, as described by ``$BASE/cluster.env``."""

    mode: str  # "netns" (own network/hostname per node) or "multislurmd" (all on loopback)
    nodes: int
    base: Path
    partition: str = "debug"
    node_names: tuple[str, ...] = ()
    node_addrs: dict[str, str] = dataclasses.field(default_factory=dict)  # "n1" -> "10.77.0.11"
    controller_addr: str = "10.77.0.1"  # where jobs can reach the host (not 127.0.0.1!)
    accounting: bool = True  # sacct works
    node_cpus: int = 8
    node_mem_mb: int = 4096
    slurm_conf: str = ""

    @property
    def netns(self) -> bool:
        return self.mode == "netns"

    def namespace(self, node: str) -> str:
        """Name of the node's network namespace (``ip netns pids <name>``); netns mode only."""
        if not self.netns:
            raise ValueError(f"no namespaces in mode {self.mode!r}")
        return f"slurm-{node}"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for Slurm client commands (sbatch, srun, sacct...)."""
        env = dict(os.environ)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        env.update(extra)
        return env


def _read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and not line.lstrip().startswith("#"):
                values[key.strip()] = value.strip()
    return values


def load_cluster() -> SlurmCluster:
    """Describe the running cluster from the environment, falling back to ``$BASE/cluster.env``."""
    base = os.environ.get(ENV_PREFIX + "BASE") or os.environ.get("BASE") or DEFAULT_BASE
    values = _read_env_file(Path(base) / "cluster.env")
    values.update({k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX) or k == "SLURM_CONF"})

    def get(key: str, default: str = "") -> str:
        return values.get(ENV_PREFIX + key, default)

    if not get("MODE"):
        raise RuntimeError(
            f"{ENV_FLAG}=1 but no cluster description: neither {ENV_PREFIX}MODE in the environment "
            f"nor {base}/cluster.env (start it with tests/cluster/start_cluster.sh)"
        )
    names = tuple(n for n in get("NODE_NAMES").split(",") if n)
    addrs = tuple(a for a in get("NODE_ADDRS").split(",") if a)
    return SlurmCluster(
        mode=get("MODE"),
        nodes=int(get("NODES", str(len(names)))),
        base=Path(get("BASE", base)),
        partition=get("PARTITION", "debug"),
        node_names=names,
        node_addrs=dict(zip(names, addrs)),
        controller_addr=get("CONTROLLER_ADDR", "10.77.0.1"),
        accounting=get("ACCOUNTING", "1") == "1",
        node_cpus=int(get("NODE_CPUS", "8")),
        node_mem_mb=int(get("NODE_MEM_MB", "4096")),
        slurm_conf=values.get("SLURM_CONF", ""),
    )


_checked: SlurmCluster | None = None


def require_cluster() -> SlurmCluster:
    """Return the running test cluster, or skip the test (fail it when ``CI`` is set).

    A test that needs Slurm must never pass silently in CI because the cluster was not started:
    there, a missing cluster is a failure.
    """
    global _checked
    if os.environ.get(ENV_FLAG) != "1":
        msg = (
            f"needs the Slurm test cluster: run through "
            f"`bash tests/cluster/run_with_cluster.sh python -m pytest ...` ({ENV_FLAG}=1 is not set)"
        )
        if in_ci():
            pytest.fail(msg + " - CI is set, so this is a failure, not a skip", pytrace=False)
        pytest.skip(msg)
    if _checked is None:
        try:
            cluster = load_cluster()
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)
        ping = subprocess.run(
            ["scontrol", "ping"], env=cluster.env(), capture_output=True, text=True, timeout=20
        )
        if ping.returncode != 0 or "UP" not in ping.stdout:
            pytest.fail(f"Slurm test cluster is not answering: {ping.stdout}{ping.stderr}", pytrace=False)
        _checked = cluster
    return _checked


# --------------------------------------------------------------------------------------------
# Running Slurm commands
# --------------------------------------------------------------------------------------------


def slurm(
    *args: str, timeout: float = 30, check: bool = True, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """Run a Slurm client command with a timeout; text output; raises on failure if ``check``."""
    if env is None:
        conf = os.environ.get("SLURM_CONF") or _read_env_file(
            Path(os.environ.get(ENV_PREFIX + "BASE", DEFAULT_BASE)) / "cluster.env"
        ).get("SLURM_CONF")
        env = dict(os.environ, **({"SLURM_CONF": conf} if conf else {}))
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
        )
    return proc


def sbatch(*args: str, timeout: float = 30) -> str:
    """Submit with ``sbatch --parsable ARGS`` and return the job id."""
    out = slurm("sbatch", "--parsable", *args, timeout=timeout).stdout.strip()
    return out.split(";")[0]  # "<id>[;<cluster>]"


def controller_job_ids() -> set[str]:
    """Every job id the controller knows: the live queue and finished jobs it keeps for MinJobAge
    (300 s). For "nothing was submitted" checks: a job sbatch accepted is here at once, while
    accounting (sacct) may record an earlier test's job seconds late and look like a new one."""
    out = slurm("squeue", "-h", "-t", "all", "-o", "%i", timeout=15).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def scancel_quietly(job_id: str) -> None:
    """``scancel JOB``, whatever it answers (cleanup: the job may be gone already)."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)


def job_nodes(job_id: str) -> list[str]:
    """The nodes a job runs on now (``squeue``'s node list, expanded); [] once it runs nowhere."""
    out = slurm("squeue", "-h", "-j", job_id, "-o", "%N").stdout.strip()
    return slurm("scontrol", "show", "hostnames", out).stdout.split() if out else []


def job_state(job_id: str | int) -> str | None:
    """Current state of a job (``RUNNING``, ``COMPLETED``, ...), or None if Slurm does not know it.

    ``squeue`` first (the controller's live view; it keeps finished jobs for MinJobAge=300 s),
    then ``sacct`` for jobs the controller has forgotten. ``CANCELLED by 0`` -> ``CANCELLED``.
    """
    q = slurm("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T", check=False, timeout=15)
    state = q.stdout.strip().splitlines()
    if q.returncode == 0 and state:
        return state[0].split()[0]
    a = slurm("sacct", "-nXP", "-j", str(job_id), "-o", "State", check=False, timeout=15)
    rows = [r for r in a.stdout.splitlines() if r.strip()]
    if a.returncode == 0 and rows:
        return rows[-1].split()[0]
    return None


def wait_for_job_state(
    job_id: str | int,
    states: str | Iterable[str],
    timeout: float = 60,
    poll: float = 0.2,
    fail_on: Iterable[str] | None = None,
) -> str:
    """Poll until the job is in one of ``states``; return that state.

    Raises AssertionError after ``timeout`` seconds, or at once when the job reaches a state of
    ``fail_on`` (default: the terminal states not asked for - waiting for RUNNING on a job that
    already FAILED is pointless). Pass ``fail_on=()`` to wait through everything.
    """
    wanted = {states} if isinstance(states, str) else set(states)
    wanted = {s.upper() for s in wanted}
    stop = set(TERMINAL_STATES - wanted) if fail_on is None else {s.upper() for s in fail_on}
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        state = job_state(job_id)
        if state and (not seen or seen[-1] != state):
            seen.append(state)
        if state in wanted:
            return state
        if state in stop:
            raise AssertionError(
                f"job {job_id} reached {state} while waiting for {sorted(wanted)} "
                f"(states seen: {' -> '.join(seen)})\n{_job_details(job_id)}"
            )
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"job {job_id} not in {sorted(wanted)} after {timeout}s "
                f"(states seen: {' -> '.join(seen) or 'none'})\n{_job_details(job_id)}"
            )
        time.sleep(poll)


def _job_details(job_id: str | int) -> str:
    try:
        return slurm("scontrol", "show", "job", str(job_id), check=False, timeout=10).stdout
    except Exception as exc:  # diagnostics only
        return f"(scontrol show job failed: {exc})"


def sacct_rows(
    job_id: str | int, fields: str = "JobID,State,Start,End,NodeList", all_steps: bool = False
) -> list[dict[str, str]]:
    """``sacct -nP -o FIELDS -j ID`` as dicts (``-X``: allocations only, unless ``all_steps``)."""
    args = ["sacct", "-nP", "-j", str(job_id), "-o", fields]
    if not all_steps:
        args.insert(1, "-X")
    names = fields.split(",")
    out = slurm(*args, timeout=15).stdout
    return [dict(zip(names, line.split("|"))) for line in out.splitlines() if line.strip()]


def node_state(node: str) -> str:
    """``sinfo`` state of a node, e.g. ``idle``, ``mixed``, ``down*`` (``*``: not responding)."""
    return slurm("sinfo", "-h", "-N", "-n", node, "-o", "%T", timeout=15).stdout.strip().split("\n")[0]


def wait_for_node_state(
    node: str, states: str | Iterable[str], timeout: float = 60, poll: float = 0.5
) -> str:
    """Poll until ``node_state(node)`` (without a trailing ``*``, lower case) is in ``states``."""
    wanted = {states} if isinstance(states, str) else set(states)
    wanted = {s.lower().rstrip("*") for s in wanted}
    deadline = time.monotonic() + timeout
    while True:
        state = node_state(node)
        if state.lower().rstrip("*~#!%$@^-") in wanted:
            return state
        if time.monotonic() >= deadline:
            raise AssertionError(f"node {node} is {state!r}, not in {sorted(wanted)} after {timeout}s")
        time.sleep(poll)


# --------------------------------------------------------------------------------------------
# Processes on a node (simulating failures)
# --------------------------------------------------------------------------------------------

_DAEMONS = ("slurmd", "slurmstepd")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _is_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # field 3, after "(comm)"


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def slurm_node_pids(
    node: str,
    include_daemons: bool = False,
    job_id: str | int | None = None,
    cluster: SlurmCluster | None = None,
) -> list[int]:
    """PIDs of the processes running "on" a node: the job tasks (training processes...).

    netns mode: the processes in the node's network namespace (``ip netns pids slurm-nI``),
    which is exactly what runs on that node. multislurmd mode: the processes whose environment
    has ``SLURMD_NODENAME=<node>`` (Slurm sets it for each task; children inherit it).
    ``job_id``: only that job's tasks (``SLURM_JOB_ID`` in their environment) - other people's
    jobs may share the node. ``include_daemons`` adds slurmd and slurmstepd (whatever the job;
    in multislurmd mode only the node's slurmd, as a slurmstepd does not say which node it
    serves). Zombies are left out.
    """
    cluster = cluster or require_cluster()
    daemons: list[int] = []
    tasks: list[int] = []
    if cluster.netns:
        out = subprocess.run(
            ["ip", "netns", "pids", cluster.namespace(node)],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        ).stdout
        for pid in map(int, out.split()):
            (daemons if _comm(pid) in _DAEMONS else tasks).append(pid)
    else:
        entry = f"SLURMD_NODENAME={node}".encode()
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid() and _environ_has(int(d.name), entry):
                tasks.append(int(d.name))
        pid_file = cluster.base / "run" / f"slurmd-{node}.pid"
        if pid_file.is_file():
            daemons.append(int(pid_file.read_text().split()[0]))
    if job_id is not None:
        entry = f"SLURM_JOB_ID={job_id}".encode()
        tasks = [p for p in tasks if _environ_has(p, entry)]
    pids = tasks + (daemons if include_daemons else [])
    return sorted(p for p in set(pids) if _is_running(p))


def kill_node_processes(
    node: str,
    sig: int = signal.SIGKILL,
    include_daemons: bool = False,
    job_id: str | int | None = None,
    cluster: SlurmCluster | None = None,
) -> list[int]:
    """Send ``sig`` to the processes on ``node`` (see :func:`slurm_node_pids`); return the PIDs.

    ``include_daemons=False``: "the training processes on n2 die" - Slurm sees a failed task.
    ``include_daemons=True`` (with SIGKILL): "n2 dies" - the controller marks it DOWN after
    ~SlurmdTimeout (20-30 s) and requeues its batch jobs; bring it back with :func:`revive_nodes`.
    With ``job_id`` only that job's tasks are hit (plus the daemons if asked for).
    """
    pids = slurm_node_pids(node, include_daemons=include_daemons, job_id=job_id, cluster=cluster)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def revive_nodes(cluster: SlurmCluster | None = None, timeout: float = 90) -> None:
    """Restart whatever daemon of the cluster is missing (e.g. a killed slurmd) and wait until
    every node is usable again. Runs ``start_cluster.sh`` (idempotent, no FRESH)."""
    cluster = cluster or require_cluster()
    env = dict(
        os.environ,
        BASE=str(cluster.base),
        NODES=str(cluster.nodes),
        MODE=cluster.mode,
        ACCOUNTING="1" if cluster.accounting else "0",
        FRESH="0",
    )
    proc = subprocess.run(
        ["bash", str(CLUSTER_SCRIPTS / "start_cluster.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"start_cluster.sh failed:\n{proc.stdout}\n{proc.stderr}")
