"""One node's part of the preflight (:mod:`orchestrator.supervise.preflight`): a task of the preflight's step.

``python -m orchestrator.node.preflight ATTEMPT``, with ``ORCHESTRATOR_RUN_DIR`` set (the batch
script exports it). It writes ``preflight/attempt_<A>/node_<N>.json`` first with its local checks
(so a node that then hangs in the network check is still told from one that never started), then
again after each transfer it timed. It always joins the network check, even after a local problem:
its peers would otherwise wait for it until the timeout. Exit 0 unless it crashed; the verdict is
the supervisor's, from the files.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from orchestrator.contract.env import RUN_DIR_ENV
from orchestrator.supervise.preflight import PAYLOAD_BYTES, PINGS, TRANSFERS


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
    report: dict[str, Any] = {
        "node": node.node_rank,
        "host": socket.gethostname(),
        "problems": local_problems(
            run_dir, folder, node.node_rank, limits.min_free_mb, plan.profile.gpus_per_node
        )
        + image_problems(image_to_check(plan.profile.container)),
        "peers": {},
    }
    report["local_s"] = round(time.monotonic() - started, 3)
    write_json_atomic(path, report)
    if node.num_nodes < 2:
        return 0
    import torch
    import torch.distributed as dist

    gpu = plan.profile.gpus_per_node > 0
    device = "cuda:0" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(0)
    start, end = plan.profile.port_range.start, plan.profile.port_range.end
    # Not training's port: half the range away, so training never meets this step's closing sockets.
    port = start + (port_for_job(node.job_id, start, end) - start + (end - start + 1) // 2) % (
        end - start + 1
    )
    main_ip = node.main_ip(plan, folder)
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://{main_ip}:{port}",
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
