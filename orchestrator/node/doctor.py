"""One node's part of ``orchestrator doctor`` (:mod:`orchestrator.supervise.doctor` decides).

``python -m orchestrator.node.doctor SPEC_JSON``, one task per node of the doctor's step, after the
profile's set-up lines and environment. It measures, never judges: the interpreter, the packages a
job imports and their versions, the GPUs torch sees (and nvidia-smi's health, on GPU profiles), the
run root written and read both ways (its file for the host, the host's file for it), ``/dev/shm``,
``ulimit -n``/``-l``, the container image (the preflight's check, then the runtime starting it with
the image's interpreter, timed), the ports of the profile's
``port_range`` already taken, and an all-reduce over every node. It prints its report as one JSON line (``REPORT_MARKER``): the host reads it from the step's
output, so a node whose run root is not shared still reports.

The all-reduce needs every node: each first tells node 0 over a plain socket whether it can join
(torch imports), and node 0 answers go or no-go to all. A node that cannot import torch then costs
the others no rendezvous timeout.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from orchestrator.node.preflight import agree, gpu_problems, image_problems
from orchestrator.rank.expectations import cpu_only_build
from orchestrator.supervise.doctor import HOST_FILE, NODE_FILE, PACKAGES, REPORT_MARKER, WAITED_FOR_OTHERS

#: Bytes all-reduced per try, and tries (the best counts: a busy host's noise is not the network's).
ALLREDUCE_BYTES = 16 << 20
ALLREDUCE_TRIES = 5
#: How long nodes wait for each other (the go/no-go, then torch's rendezvous).
JOIN_TIMEOUT_S = 60.0
#: Bound on the runtime starting the image (a first start may unpack or map a large image).
IMAGE_START_TIMEOUT_S = 120.0


def package_versions() -> dict[str, dict[str, str]]:
    """Each package a job imports: its version, or the last line of why it does not import."""
    out: dict[str, dict[str, str]] = {}
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
            out[name] = {"version": str(getattr(module, "__version__", "unknown"))}
        except BaseException as exc:  # noqa: BLE001 - a broken install raises anything
            out[name] = {"error": f"{type(exc).__name__}: {exc}".strip().splitlines()[-1]}
    return out


def gpus_seen(expected: int, torch_ok: bool) -> dict[str, Any]:
    """The GPUs torch sees (their names), torch's version and whether it is a CPU-only build (built
    for neither CUDA nor ROCm: it sees no GPU whatever the node has), and on GPU profiles
    nvidia-smi's ECC errors."""
    info: dict[str, Any] = {"count": 0, "names": [], "problems": []}
    if torch_ok:
        import torch

        info["torch"] = str(torch.__version__)
        info["cpu_only"] = cpu_only_build(torch)
        try:
            count = torch.cuda.device_count()
            info["names"] = [torch.cuda.get_device_name(i) for i in range(count)]
            info["count"] = count
        except Exception as exc:  # noqa: BLE001 - a broken driver raises anything; judged on the host
            info["problems"].append(f"torch.cuda: {type(exc).__name__}: {exc}".splitlines()[0][:300])
    if expected > 0:
        info["problems"] += [p for p in gpu_problems(expected) if "visible" not in p]
    return info


def image_start(argv: list[str] | None, problems: list[str]) -> dict[str, Any] | None:
    """The runtime starting the image (``argv``: :func:`orchestrator.config.container.image_start_argv`),
    timed: its exit status and last output line. None when there is nothing to start (no such runtime)
    or the image is not here (``problems`` already say so)."""
    if not argv or problems:
        return None
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=IMAGE_START_TIMEOUT_S,
        )
        code, output = done.returncode, (done.stdout + done.stderr).strip().splitlines()
    except subprocess.TimeoutExpired:
        code, output = None, [f"no end within {IMAGE_START_TIMEOUT_S:.0f} s"]
    except OSError as exc:
        code, output = None, [f"{argv[0]}: {exc.strerror or exc}"]
    return {
        "runtime": argv[0],
        "code": code,
        "seconds": round(time.monotonic() - started, 2),
        "last": output[-1][:300] if output else "",
    }


def run_dir_check(folder: Path, rank: int, token: str) -> dict[str, Any]:
    """Write this node's file (the token) where the host will look; read the host's. The folder is
    made here when missing: a node whose run root is its own disk is then told as not shared (what it
    is), not as unwritable."""
    out: dict[str, Any] = {}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        mine = folder / NODE_FILE.format(rank=rank)
        tmp = mine.with_name(f".{mine.name}.tmp")
        tmp.write_text(token)
        os.replace(tmp, mine)
    except OSError as exc:
        out["error"] = f"cannot write in {folder}: {exc}"
    try:
        out["host_file_seen"] = (folder / HOST_FILE).read_text() == token
    except OSError:
        out["host_file_seen"] = False
    return out


def limits() -> dict[str, Any]:
    """``/dev/shm``'s size, ``ulimit -n`` (soft, hard) and ``ulimit -l`` in KiB (-1: unlimited)."""
    try:
        st = os.statvfs("/dev/shm")
        shm: int | None = st.f_blocks * st.f_frsize
    except OSError:
        shm = None
    soft_n, hard_n = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft_l, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def value(v: int) -> int:
        return -1 if v == resource.RLIM_INFINITY else v

    return {
        "shm_bytes": shm,
        "nofile": [value(soft_n), value(hard_n)],
        "memlock_kib": -1 if soft_l == resource.RLIM_INFINITY else soft_l // 1024,
    }


def ports_taken(start: int, end: int) -> dict[str, Any]:
    """The ports of ``start``-``end`` that a socket of this node's network namespace holds (any state,
    TCP over IPv4 and IPv6: a port in TIME_WAIT refuses a bind too), from ``/proc/net``, and the
    kernel's ephemeral range. Read, never bound: the check takes no port from a job."""
    taken: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 1 and ":" in fields[1]:
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if start <= port <= end:
                    taken.add(port)
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        ephemeral: list[int] | None = [low, high]
    except (OSError, ValueError):
        ephemeral = None
    return {"range": [start, end], "taken": sorted(taken), "ephemeral": ephemeral}


def allreduce(rank: int, nodes: int, main: str, port: int, gpu: bool) -> dict[str, Any]:
    """Bus bandwidth of an all-reduce over every node (gloo on CPUs, NCCL on GPUs), the best try."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if gpu else "gloo"
    device = "cuda:0" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{main}:{port}",
        rank=rank,
        world_size=nodes,
        timeout=timedelta(seconds=JOIN_TIMEOUT_S),
    )
    try:
        data = torch.ones(ALLREDUCE_BYTES // 4, device=device)
        dist.all_reduce(data)  # warm-up: connections
        best = float("inf")
        for _ in range(ALLREDUCE_TRIES):
            if gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
            dist.all_reduce(data)
            if gpu:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        # Bus bandwidth: what each node's link carries in a ring all-reduce, comparable across sizes.
        mbps = ALLREDUCE_BYTES * 2 * (nodes - 1) / nodes * 8 / best / 1e6
        return {
            "mbps": round(mbps, 1),
            "seconds": round(best, 4),
            "bytes": ALLREDUCE_BYTES,
            "backend": backend,
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    from orchestrator.config.render import port_for_job
    from orchestrator.schedulers import get_scheduler

    spec = json.loads(argv[0])
    node = get_scheduler(spec["scheduler"]).node_environment("")
    rank, nodes = node.node_rank, node.num_nodes
    imports = package_versions()
    torch_ok = "version" in imports["torch"]
    report: dict[str, Any] = {
        "node": rank,
        "host": socket.gethostname(),
        "python": sys.executable,
        "python_version": sys.version.split()[0],
        "imports": imports,
        "gpus": gpus_seen(int(spec["gpus"]), torch_ok),
        "run_dir": run_dir_check(Path(spec["folder"]), rank, spec["token"]),
        **limits(),
        "image_problems": image_problems((spec["image"][0], spec["image"][1]) if spec.get("image") else None),
        # before the all-reduce binds two ports of the range
        "ports": ports_taken(*spec["port_range"]),
    }
    if nodes >= 2:
        start, end = spec["port_range"]
        port = port_for_job(node.job_id, start, end - 1)
        gpu = int(spec["gpus"]) > 0
        # A GPU profile's all-reduce is NCCL's: a node where torch sees no GPU cannot join it.
        why = (
            "not run: torch does not import here"
            if not torch_ok
            else "not run: torch sees no GPU here"
            if gpu and not report["gpus"]["count"]
            else WAITED_FOR_OTHERS
        )
        try:
            main_ip = socket.gethostbyname(node.hostnames[0])
            if agree(rank, nodes, main_ip, port, why == WAITED_FOR_OTHERS, JOIN_TIMEOUT_S):
                report["allreduce"] = allreduce(rank, nodes, main_ip, port + 1, gpu)
            else:
                report["allreduce"] = {"error": why}
        except Exception as exc:  # noqa: BLE001 - reported, judged on the host
            report["allreduce"] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    report["image_start"] = image_start(spec.get("image_start"), report["image_problems"])
    print(f"{REPORT_MARKER} {json.dumps(report)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
