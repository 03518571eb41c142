"""``orchestrator doctor``'s decision: every node's report in, one row per check and node out, each
failure with its fix. Pure (``tests/supervise/test_doctor.py`` feeds it synthetic reports); the
runner (:mod:`orchestrator.runner.doctor`) starts the step, the node's part is
:mod:`orchestrator.node.doctor`, and the thresholds are declared here, once, each saying why.

A node's report is the JSON its part printed (``REPORT_MARKER`` line), read from the step's output,
never only from the shared folder: a node whose run directory is not shared still tells what it
measured. What the submitting host adds: whether it sees the file the node wrote there, and the
clock the node printed against the host's own clock when the line arrived.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: ``/dev/shm`` below this fails. Why: DataLoader workers hand batches to their rank through
#: ``/dev/shm`` and NCCL's shared-memory transport puts its buffers there; a container's default 64 MiB
#: ends the first large batch with "Bus error" or "No space left on device", far from its cause.
MIN_SHM_BYTES = 1 << 30
#: ``ulimit -n`` (soft) below this fails. Why: every rank holds a socket per peer in the process
#: group's bootstrap, and torch's DataLoader shares tensors through file descriptors; the common
#: default 1024 runs out at a few hundred ranks or workers ("Too many open files").
MIN_NOFILE = 4096
#: ``ulimit -l`` (soft, KiB) below this fails. Why: 8 MiB is Linux's default since 5.16 and what gloo
#: and NCCL over sockets need; the old default 64 KiB fails as soon as a library pins a buffer.
MIN_MEMLOCK_KIB = 8192
#: On GPU profiles ``ulimit -l`` must be unlimited. Why: NCCL over InfiniBand or RoCE pins (registers)
#: its communication buffers, and ``ibv_reg_mr`` fails past the limit; NCCL's own docs ask for
#: ``unlimited``, and a job would otherwise fall back to sockets silently or die at its first step.
MEMLOCK_UNLIMITED_ON_GPUS = True
#: A node's clock further than this from the submitting host's (or from another node's) fails. Why:
#: nodes and the host compare times the others wrote (heartbeats of the hang watchdog, a run's
#: liveness by file times, the cost's placement of metrics in an allocation), and munge refuses
#: credentials past 300 s; the line carrying the clock arrives within milliseconds, so 2 s is skew,
#: not the measurement.
MAX_CLOCK_SKEW_S = 2.0
#: The profile's ``port_range`` fails on a node where more than this share of its ports is taken. Why:
#: each job derives its rendezvous port from its id within the range (``config.render.port_for_job``),
#: so this share is the chance that a job's port is already bound there and its launch dies with
#: "Address already in use"; a range that overlaps the kernel's ephemeral ports is taken a little
#: more by every outgoing connection.
MAX_PORTS_TAKEN_SHARE = 0.05

#: What the node's part prints before its JSON report (one line), and the shell preamble before the
#: node's clock, or when the interpreter is not there.
REPORT_MARKER = "orchestrator-doctor-report"
CLOCK_MARKER = "orchestrator-doctor-clock"
NO_PYTHON_MARKER = "orchestrator-doctor-no-python"
#: What a node that could join the all-reduce says when another could not (node 0's no-go).
WAITED_FOR_OTHERS = "not run: another node cannot join"
#: The module each node runs (by name: ``python -m``), after the profile's set-up lines.
NODE_MODULE = "orchestrator.node.doctor"
#: The variable a scheduler's step sets to the node's name as the scheduler knows it (else the host name).
NODE_NAME_VAR = "ORCHESTRATOR_NODE_NAME"
#: The file each node writes into the doctor's folder in the run root (its token), and the host's.
NODE_FILE = "node_{rank}.txt"
HOST_FILE = "host.txt"
#: The packages a training job imports on the nodes, in the order checked.
PACKAGES = ("orchestrator", "torch", "accelerate")

ALL_NODES = "all"


@dataclass(frozen=True)
class Expected:
    """What the profile and the submitting host expect of every node."""

    nodes: list[str]
    """The step's node names, in node-rank order (the names the shell printed; ``node<i>`` when unknown)."""
    gpus_per_node: int
    python: str
    """The profile's ``python`` (or the submitting interpreter), as the set-up lines must make it."""
    version: str
    """The submitting host's orchestrator version: the nodes must run the same."""
    run_root: str
    container: bool
    """The profile has a container block: its image must be there on each node."""
    min_bandwidth_mbps: float
    """The profile's ``preflight.min_bandwidth_mbps``: the floor each job's links are held to."""
    image_start: bool = False
    """Each node starts the image with the profile's runtime (podman, apptainer); pyxis and OCI images
    are started by the step's own flags, so only their presence is checked."""


@dataclass
class NodeResult:
    """One node, as the submitting host saw it."""

    report: dict[str, Any] | None
    """The JSON the node printed (None: its part did not run to the end)."""
    output: list[str] = field(default_factory=list)
    """The node's other output lines (set-up lines, a traceback)."""
    file_seen: bool = False
    """The host sees the file the node wrote in the run root."""
    skew_s: float | None = None
    """The node's clock minus the host's, when its clock line arrived."""
    no_python: bool = False


@dataclass(frozen=True)
class Row:
    check: str
    node: str
    ok: bool
    value: str
    fix: str = ""


@dataclass
class Diagnosis:
    rows: list[Row]

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def as_json(self) -> dict[str, Any]:
        return {"ok": not self.failed, "rows": [asdict(r) for r in self.rows]}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _limit(value: int | None) -> str:
    return "unlimited" if value is None or value < 0 else str(value)


def _last_words(output: list[str]) -> str:
    lines = [line.strip() for line in output if line.strip()]
    return lines[-1][:200] if lines else "no output"


def node_rows(name: str, result: NodeResult, want: Expected) -> list[Row]:
    """Every check of one node."""
    report = result.report
    if report is None:
        if result.no_python:
            return [
                Row(
                    "interpreter",
                    name,
                    False,
                    f"{want.python} not found after the set-up lines",
                    f"make the profile's setup lines put {want.python} on PATH on every node "
                    "(source the venv, module load), or set the profile key python to its path",
                )
            ]
        return [
            Row(
                "interpreter",
                name,
                False,
                f"the node check did not run: {_last_words(result.output)}",
                f"install orchestrator {want.version} into the nodes' interpreter ({want.python}), "
                "or fix the setup lines so that they run it",
            )
        ]
    rows = [Row("interpreter", name, True, f"{report.get('python')} (Python {report.get('python_version')})")]
    imports = report.get("imports") or {}
    for package in PACKAGES:
        got = imports.get(package) or {"error": "not checked"}
        if "error" in got:
            rows.append(
                Row(
                    f"import {package}",
                    name,
                    False,
                    str(got["error"])[:200],
                    f"install {package} into {report.get('python')} on this node, or fix the setup "
                    "lines that change its environment here",
                )
            )
        elif package == "orchestrator" and got.get("version") != want.version:
            rows.append(
                Row(
                    "import orchestrator",
                    name,
                    False,
                    f"{got.get('version')}, the submitting host has {want.version}",
                    f"install orchestrator {want.version} on the nodes (the same version on both sides)",
                )
            )
        else:
            rows.append(Row(f"import {package}", name, True, str(got.get("version"))))
    rows += [_gpu_row(name, report, want), *_run_dir_rows(name, report, result, want)]
    shm = report.get("shm_bytes")
    rows.append(
        Row("/dev/shm", name, True, _size(shm))
        if isinstance(shm, int) and shm >= MIN_SHM_BYTES
        else Row(
            "/dev/shm",
            name,
            False,
            f"{_size(shm)} < {_size(MIN_SHM_BYTES)}" if isinstance(shm, int) else "not mounted",
            "ask the cluster's admins for a larger /dev/shm on the nodes (containers: a larger --shm-size "
            "or a tmpfs mount); DataLoader workers and NCCL need it",
        )
    )
    rows += _limit_rows(name, report, want)
    if isinstance(report.get("ports"), dict):
        rows.append(_port_row(name, report["ports"]))
    if result.skew_s is not None:
        ok = abs(result.skew_s) <= MAX_CLOCK_SKEW_S
        rows.append(
            Row(
                "clock vs submitting host",
                name,
                ok,
                f"{result.skew_s:+.2f} s" + ("" if ok else f" (more than {MAX_CLOCK_SKEW_S:g} s)"),
                "" if ok else "synchronise the node's clock (chrony/ntpd) with the submitting host's",
            )
        )
    if want.container or want.image_start:
        rows.append(_image_row(name, report, want))
    return rows


def _image_row(name: str, report: dict[str, Any], want: Expected) -> Row:
    """The image is on the node, and the profile's runtime starts it with the image's interpreter."""
    problems = report.get("image_problems") or []
    if problems:
        return Row(
            "container image",
            name,
            False,
            "; ".join(problems),
            "put the profile's container.image on this node (pull it into its store, or a path "
            "every node mounts)",
        )
    start = report.get("image_start")
    if not want.image_start:
        return Row("container image", name, True, "present")
    if not isinstance(start, dict):
        return Row("container image", name, False, "not started: the node did not say", "rerun the doctor")
    said = f": {start.get('last')}" if start.get("last") else ""
    if start.get("code") == 0:
        return Row(
            "container image",
            name,
            True,
            f"{start.get('runtime')} started it in {start.get('seconds')} s{said}",
        )
    how = "did not end" if start.get("code") is None else f"exit {start.get('code')}"
    return Row(
        "container image",
        name,
        False,
        f"{start.get('runtime')} could not start it ({how}, {start.get('seconds')} s){said}",
        f"make {start.get('runtime')} start the image on this node as the job will (its storage and "
        "configuration in the setup lines or env), with container.python importing torch and accelerate "
        "in the image",
    )


def _port_row(name: str, ports: dict[str, Any]) -> Row:
    start, end = (ports.get("range") or [0, 0])[:2]
    taken, size = ports.get("taken") or [], max(1, int(end) - int(start) + 1)
    ephemeral = ports.get("ephemeral")
    overlap = (
        f"; overlaps the kernel's ephemeral ports {ephemeral[0]}-{ephemeral[1]}"
        if isinstance(ephemeral, list)
        and len(ephemeral) == 2
        and ephemeral[0] <= end
        and start <= ephemeral[1]
        else ""
    )
    value = f"{start}-{end}: {len(taken)} of {size} taken" + (
        f" ({', '.join(map(str, taken[:5]))}{', ...' if len(taken) > 5 else ''})" if taken else ""
    )
    if len(taken) / size <= MAX_PORTS_TAKEN_SHARE:
        return Row("port range free", name, True, value + overlap)
    return Row(
        "port range free",
        name,
        False,
        value + overlap,
        "set the profile's port_range to ports nothing else binds on the nodes"
        + (
            " and outside the kernel's ephemeral range (sysctl net.ipv4.ip_local_port_range)"
            if overlap
            else ""
        ),
    )


def _gpu_row(name: str, report: dict[str, Any], want: Expected) -> Row:
    gpus = report.get("gpus") or {}
    count = gpus.get("count")
    if want.gpus_per_node <= 0:
        return Row("GPUs", name, True, f"{count or 0} seen (CPU profile: gloo)")
    problems = list(gpus.get("problems") or [])
    cpu_only = bool(gpus.get("cpu_only"))
    if not isinstance(count, int) or count < want.gpus_per_node:
        by = f" by torch {gpus['torch']}" if gpus.get("torch") else ""
        build = " (a CPU-only build)" if cpu_only else ""
        problems.insert(0, f"{count or 0} GPU(s) seen{by}{build}, gpus_per_node is {want.gpus_per_node}")
    if problems:
        return Row(
            "GPUs",
            name,
            False,
            "; ".join(problems),
            f"install a CUDA build of torch into {report.get('python')} on the nodes (a CPU-only build sees "
            "no GPU), or, where they have none, run on nodes with the profile's GPUs (partition, gres) or "
            "set gpus_per_node to 0"
            if cpu_only
            else "run on nodes with the profile's GPUs (partition, gres), load the CUDA driver in setup, or "
            "set gpus_per_node to what the nodes have (0 for CPU nodes)",
        )
    return Row("GPUs", name, True, f"{count} seen: {', '.join(gpus.get('names') or [])}")


def _run_dir_rows(name: str, report: dict[str, Any], result: NodeResult, want: Expected) -> list[Row]:
    shared = report.get("run_dir") or {}
    if shared.get("error"):
        return [
            Row(
                "run directory writable",
                name,
                False,
                str(shared["error"])[:200],
                f"make {want.run_root} writable from this node, or set $ORCHESTRATOR_RUNS to a shared "
                "folder that is",
            )
        ]
    missing = []
    if not shared.get("host_file_seen"):
        missing.append("the submitting host's file is not visible on the node")
    if not result.file_seen:
        missing.append("the node's file is not visible on the submitting host")
    if missing:
        return [
            Row(
                "run directory shared",
                name,
                False,
                "; ".join(missing),
                f"put $ORCHESTRATOR_RUNS ({want.run_root}) on a filesystem every node and the submitting "
                "host mount at the same path (NFS, Lustre, GPFS), not a node-local disk",
            )
        ]
    return [Row("run directory shared", name, True, f"{want.run_root}: written and read both ways")]


def _limit_rows(name: str, report: dict[str, Any], want: Expected) -> list[Row]:
    rows = []
    nofile = report.get("nofile") or [None, None]
    if isinstance(nofile[0], int) and 0 <= nofile[0] < MIN_NOFILE:
        hard = nofile[1]
        target = MIN_NOFILE * 16 if hard is None or hard < 0 else min(hard, MIN_NOFILE * 16)
        rows.append(
            Row(
                "ulimit -n",
                name,
                False,
                f"{nofile[0]} < {MIN_NOFILE}",
                f"add `ulimit -n {target}` to the profile's setup lines"
                + (
                    ""
                    if hard is None or hard < 0 or hard >= MIN_NOFILE
                    else f" (the hard limit {hard} is too low: ask the admins)"
                ),
            )
        )
    else:
        rows.append(Row("ulimit -n", name, True, _limit(nofile[0])))
    memlock = report.get("memlock_kib")
    unlimited = not isinstance(memlock, int) or memlock < 0
    need_unlimited = want.gpus_per_node > 0 and MEMLOCK_UNLIMITED_ON_GPUS
    low = isinstance(memlock, int) and not unlimited and (need_unlimited or memlock < MIN_MEMLOCK_KIB)
    if low:
        rows.append(
            Row(
                "ulimit -l",
                name,
                False,
                f"{memlock} KiB < "
                + ("unlimited (GPU profile)" if need_unlimited else f"{MIN_MEMLOCK_KIB} KiB"),
                "add `ulimit -l unlimited` to the profile's setup lines; if the hard limit forbids it, ask "
                "the admins for memlock unlimited (limits.conf, slurmd's LimitMEMLOCK, PropagateResourceLimits)",
            )
        )
    else:
        rows.append(Row("ulimit -l", name, True, "unlimited" if unlimited else f"{memlock} KiB"))
    return rows


def cross_rows(nodes: list[str], results: list[NodeResult], want: Expected) -> list[Row]:
    """What is measured between nodes: clock skew and the all-reduce."""
    rows = []
    skews = {n: r.skew_s for n, r in zip(nodes, results) if r.skew_s is not None}
    if len(skews) >= 2:
        spread = max(skews.values()) - min(skews.values())
        ok = spread <= MAX_CLOCK_SKEW_S
        ahead = max(skews, key=lambda n: skews[n])
        behind = min(skews, key=lambda n: skews[n])
        rows.append(
            Row(
                "clock between nodes",
                ALL_NODES,
                ok,
                f"{spread:.2f} s" + (f" ({ahead} ahead of {behind})" if spread >= 0.005 else ""),
                "" if ok else "synchronise the nodes' clocks (chrony/ntpd)",
            )
        )
    rows.append(_allreduce_row(nodes, results, want))
    return rows


def _allreduce_row(nodes: list[str], results: list[NodeResult], want: Expected) -> Row:
    if len(nodes) < 2:
        return Row("all-reduce", ALL_NODES, True, "not run (one node)")
    figures = []
    errors: list[tuple[str, str]] = []
    for name, result in zip(nodes, results):
        got = (result.report or {}).get("allreduce") or {}
        if result.report is None:
            return Row(
                "all-reduce", ALL_NODES, False, f"not run: {name}'s check did not run", "fix that node first"
            )
        if "error" in got:
            errors.append((name, str(got["error"])[:200]))
        elif "mbps" in got:
            figures.append(got)
    if errors:
        # The node that could not join, not the ones that were told so.
        name, error = next((e for e in errors if e[1] != WAITED_FOR_OTHERS), errors[0])
        return Row(
            "all-reduce",
            ALL_NODES,
            False,
            f"{name}: {error}",
            "fix the failures above first; if none: the nodes cannot reach each other on the profile's "
            "port_range and network_interface (firewall, GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME in env)",
        )
    if not figures:
        return Row("all-reduce", ALL_NODES, False, "no node measured it", "fix the failures above first")
    slowest = min(figures, key=lambda f: float(f["mbps"]))
    value = f"{slowest['mbps']:.0f} Mbit/s bus bandwidth ({slowest.get('backend')}, {len(nodes)} nodes, {_size(slowest.get('bytes', 0))})"
    if slowest["mbps"] < want.min_bandwidth_mbps:
        return Row(
            "all-reduce",
            ALL_NODES,
            False,
            f"{value} < {want.min_bandwidth_mbps:g} Mbit/s",
            "check the fabric: the profile's network_interface and NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME "
            "should name the fast interface (or lower preflight.min_bandwidth_mbps if this is the network)",
        )
    return Row("all-reduce", ALL_NODES, True, value)


def diagnose(want: Expected, results: list[NodeResult], step_error: str | None = None) -> Diagnosis:
    """Pure: every node's result (in node-rank order, one per ``want.nodes``) in, the rows out.
    ``step_error``: the scheduler's own words when the step did not start on any node."""
    if step_error is not None and not any(r.report or r.output for r in results):
        return Diagnosis(
            [
                Row(
                    "allocation",
                    ALL_NODES,
                    False,
                    step_error[:300],
                    "check the profile's partition, account, qos, mem, gpus and the node count against "
                    "the cluster (`orchestrator profiles init` writes them from what it says)",
                )
            ]
        )
    rows: list[Row] = []
    for name, result in zip(want.nodes, results):
        rows += node_rows(name, result, want)
    return Diagnosis(rows + cross_rows(want.nodes, results, want))
