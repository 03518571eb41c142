"""One node's part of the preflight (:mod:`orchestrator.supervise.preflight`): a task of the preflight's step.

``python -m orchestrator.node.preflight ATTEMPT``, with ``ORCHESTRATOR_RUN_DIR`` set (the batch
script exports it). It writes ``preflight/attempt_<A>/node_<N>.json`` first with its local checks
(so a node that then hangs in the network check is still told from one that never started), then
again after each transfer it timed. It joins the network check after a local problem it can still
measure through (a full disk): its peers would otherwise wait for it until the timeout. A node that
cannot join (torch does not import, or a GPU profile's torch sees no CUDA device: NCCL needs one)
says so first, over a plain socket (:func:`agree`), and every node then skips the network check at
once; its problem names it. Exit 0 unless it crashed; the verdict is the supervisor's, from the files.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from orchestrator.contract.env import RUN_DIR_ENV
from orchestrator.rank.expectations import cpu_only_build
from orchestrator.supervise.preflight import PAYLOAD_BYTES, PINGS, TRANSFERS

#: How much longer than the profile's ``preflight.timeout_s`` the nodes wait for each other's go/no-go:
#: the supervisor's bound on the step (which started before these processes) then always ends a node
#: that never reaches node 0, and its timeout names it, as it did before there was a go/no-go.
AGREE_PAST_TIMEOUT_S = 30.0


def local_problems(run_dir: Path, folder: Path, node_rank: int, min_free_mb: int, gpus: int) -> list[str]:
    """This node's own problems, each one line naming what was expected."""
    from orchestrator.contract.run_dir import last_complete_checkpoint

    problems: list[str] = []
    probe = folder / f".write_test_node_{node_rank}"
    try:
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as exc:
        problems.append(f"run directory {run_dir} not writable: {exc}")
    try:
        free = shutil.disk_usage(run_dir).free
        checkpoint = last_complete_checkpoint(run_dir)
        need = (checkpoint.total_bytes if checkpoint else 0) + min_free_mb * (1 << 20)
        if free < need:
            problems.append(
                f"{free / (1 << 20):.0f} MiB free in {run_dir}, {need / (1 << 20):.0f} MiB needed "
                f"(the newest checkpoint plus preflight.min_free_mb)"
            )
    except OSError as exc:
        problems.append(f"free space of {run_dir} unknown: {exc}")
    if gpus > 0:
        problems += gpu_problems(gpus)
    return problems


def image_problems(check: tuple[str, str] | None) -> list[str]:
    """The container image is here (``orchestrator.config.container.image_to_check``)."""
    if check is None:
        return []
    kind, image = check
    if kind == "path":
        return [] if os.path.exists(image) else [f"container image {image} not found on this node"]
    try:
        found = (
            subprocess.run(
                ["podman", "image", "exists", "--", image], capture_output=True, timeout=60
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"container image {image}: podman image exists failed: {exc}"]
    return [] if found else [f"container image {image} not in this node's podman storage"]


def gpu_problems(expected: int) -> list[str]:
    """GPU count and uncorrected ECC errors from nvidia-smi (GPU profiles only; not exercised by the
    CPU test cluster)."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [f"nvidia-smi failed: {exc}"]
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    problems = []
    if len(rows) < expected:
        problems.append(f"{len(rows)} GPU(s) visible, gpus_per_node is {expected}")
    for row in rows:
        if len(row) > 1 and row[1].isdigit() and int(row[1]) > 0:
            problems.append(f"GPU {row[0]}: {row[1]} uncorrected ECC error(s)")
    return problems


def torch_problems(expected: int) -> tuple[list[str], bool]:
    """torch on this node: it imports and, on a GPU profile (``expected`` > 0), sees the profile's
    GPUs. nvidia-smi seeing them is not enough: a CPU-only torch (a ``+cpu`` wheel in the nodes'
    environment) or a CUDA build without a usable driver sees none, and ``torch.cuda.set_device``
    then raised out of this check where it should have named the node. Second: whether this node
    can join the network check (torch imports and, for NCCL, sees a CUDA device)."""
    try:
        import torch
    except BaseException as exc:  # noqa: BLE001 - a broken install raises anything
        said = f"{type(exc).__name__}: {exc}".strip().splitlines()[-1][:300]
        return [f"torch does not import: {said}"], False
    if expected <= 0:
        return [], True
    why: list[str] = []  # torch's own words on why (a CUDA build warns that it found no driver)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            count = torch.cuda.device_count()
        except Exception as exc:  # noqa: BLE001 - a broken driver raises anything
            count = 0
            why.append(f"{type(exc).__name__}: {exc}")
    why += [str(w.message) for w in caught]
    if count >= expected:
        return [], True
    cpu_only = cpu_only_build(torch)
    build = "a CPU-only build" if cpu_only else "a CUDA build"
    seen = "no CUDA device" if count == 0 else f"only {count} CUDA device(s)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not cpu_only and visible is not None:
        seen += f" (CUDA_VISIBLE_DEVICES={visible!r})"
    said = next((w.strip().splitlines()[0][:200] for w in why if w.strip()), "")
    return [
        f"torch {torch.__version__} ({build}) sees {seen} but the profile asks for {expected} GPUs "
        "per node (gpus_per_node)" + (f": {said}" if said else "")
    ], count > 0


def agree(rank: int, nodes: int, main: str, port: int, ready: bool, timeout_s: float) -> bool:
    """Every node says whether it can join a check over every node; node 0 answers go (all can) or
    no-go. A plain socket, no torch: a node that cannot join then costs the others no rendezvous
    timeout. Shared with the doctor (:mod:`orchestrator.node.doctor`)."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        server = socket.create_server(("", port), reuse_port=False)
        server.settimeout(timeout_s)
        peers: list[tuple[socket.socket, bool]] = []
        try:
            while len(peers) < nodes - 1 and time.monotonic() < deadline:
                conn, _ = server.accept()
                conn.settimeout(timeout_s)
                peers.append((conn, conn.recv(1) == b"1"))
        except OSError:
            pass
        go = ready and len(peers) == nodes - 1 and all(ok for _, ok in peers)
        for conn, _ in peers:
            try:
                conn.sendall(b"1" if go else b"0")
            except OSError:
                pass  # that peer is gone: it learns nothing, and joins nothing
            finally:
                conn.close()
        server.close()
        return go
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((main, port), timeout=5) as conn:
                conn.settimeout(timeout_s)
                conn.sendall(b"1" if ready else b"0")
                return conn.recv(1) == b"1"
        except OSError:
            time.sleep(0.2)  # node 0 is not listening yet: retried until the deadline
    return False


def measure_pair(dist: Any, torch: Any, me: int, peer: int, device: str) -> dict[str, float]:
    """Point-to-point figures between node 0 and one other node; both run this. The other node times
    the tiny round trips; each side times the transfer it receives, from the "go" it sends (so a
    sender's slow egress shows at its receiver, whatever the sender's socket buffers hide)."""

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    tiny = torch.zeros(1, device=device)
    big = torch.zeros(PAYLOAD_BYTES // 4, device=device)
    rtts = []
    for _ in range(PINGS):
        if me == 0:
            dist.recv(tiny, peer)
            dist.send(tiny, peer)
        else:
            t = time.perf_counter()
            dist.send(tiny, 0)
            dist.recv(tiny, 0)
            sync()
            rtts.append(time.perf_counter() - t)
    times: list[float] = []
    for _ in range(TRANSFERS):
        for receiver in (peer, 0):  # node 0 -> peer, then peer -> node 0
            sender = 0 if receiver == peer else peer
            if me == receiver:
                dist.send(tiny, sender)
                t = time.perf_counter()
                dist.recv(big, sender)
                sync()
                times.append(time.perf_counter() - t)
            else:
                dist.recv(tiny, receiver)
                dist.send(big, receiver)
                sync()
    out = {"in_mbps": PAYLOAD_BYTES * 8 / min(times) / 1e6}
    if rtts:
        out["rtt_ms"] = min(rtts) * 1000
    return out


def main(argv: list[str]) -> int:
    from orchestrator.config.container import image_to_check
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.render import port_for_job
    from orchestrator.contract.run_dir import preflight_dir, read_current_plan_json, write_json_atomic
    from orchestrator.schedulers import get_scheduler

    attempt = int(argv[0])
    run_dir = Path(os.environ[RUN_DIR_ENV])
    plan = LaunchPlan.from_json(read_current_plan_json(run_dir))
    limits = plan.profile.preflight
    node = get_scheduler(plan.profile.scheduler).node_environment("")
    folder = preflight_dir(run_dir, attempt)
    path = folder / f"node_{node.node_rank}.json"
    started = time.monotonic()
    gpus = plan.profile.gpus_per_node
    problems = local_problems(run_dir, folder, node.node_rank, limits.min_free_mb, gpus) + image_problems(
        image_to_check(plan.profile.container)
    )
    # torch only where it is used: the network check, or a GPU profile's CUDA devices.
    can_join = True
    if gpus > 0 or node.num_nodes >= 2:
        said, can_join = torch_problems(gpus)
        problems += said
    report: dict[str, Any] = {
        "node": node.node_rank,
        "host": socket.gethostname(),
        "problems": problems,
        "peers": {},
    }
    report["local_s"] = round(time.monotonic() - started, 3)
    write_json_atomic(path, report)
    if node.num_nodes < 2:
        return 0
    start, end = plan.profile.port_range.start, plan.profile.port_range.end
    size = end - start + 1
    # Not training's port: half the range away, so training never meets this step's closing sockets.
    # The go/no-go takes that port, the process group the next one.
    offset = (port_for_job(node.job_id, start, end) - start + size // 2) % size
    main_ip = node.main_ip(plan, folder)
    try:
        wait_s = limits.timeout_s + AGREE_PAST_TIMEOUT_S
        go = agree(node.node_rank, node.num_nodes, main_ip, start + offset, can_join, wait_s)
    except OSError as exc:  # node 0's port is taken
        problems.append(f"preflight port {start + offset} (port_range) not free: {exc.strerror or exc}")
        go = False
    if not go:
        report["network"] = "not run: " + (
            "this node cannot join" if not can_join else "another node cannot join"
        )
        report["total_s"] = round(time.monotonic() - started, 3)
        write_json_atomic(path, report)
        return 0
    import torch
    import torch.distributed as dist

    gpu = gpus > 0
    device = "cuda:0" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(0)  # every node said it sees one (torch_problems)
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://{main_ip}:{start + (offset + 1) % size}",
        rank=node.node_rank,
        world_size=node.num_nodes,
        timeout=timedelta(seconds=limits.timeout_s),
    )
    report["joined_s"] = round(time.monotonic() - started, 3)
    write_json_atomic(path, report)
    peers = range(1, node.num_nodes) if node.node_rank == 0 else [node.node_rank]
    for peer in peers:
        figures = measure_pair(dist, torch, node.node_rank, peer, device)
        report["peers"][str(0 if node.node_rank else peer)] = figures
        write_json_atomic(path, report)
        print(
            f"[orchestrator preflight] {node.hostnames[node.node_rank]}: link {0 if node.node_rank else peer}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()),
            file=sys.stderr,
            flush=True,
        )
    report["total_s"] = round(time.monotonic() - started, 3)
    write_json_atomic(path, report)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
