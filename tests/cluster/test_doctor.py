"""``orchestrator doctor`` on the real Slurm test cluster (issue 43 item 2): it passes on the healthy
``slurm_test`` profile with an all-reduce across the nodes, and one doctor job over three nodes names
each problem planted on one of them, with its node and its fix:

* n1: a private mount namespace (``unshare --mount``, root) with a 16 MiB tmpfs on ``/dev/shm`` and
  another over the run root: a small ``/dev/shm`` and a run directory that is not shared, for real;
* n2: a ``torch`` package that raises on import, first on ``PYTHONPATH`` (a module missing there);
* n3: ``ulimit -l 64`` (the old default that breaks pinned memory);
* the profile's podman image (a root filesystem with Python, torch and accelerate, cached per machine
  by ``tests/helpers/container_image.py``) is hidden on n1 by a tmpfs over its cache folder: a node
  without the image; n2 and n3 start it with podman and import torch in it, timed.

The problems come from the profile's own ``setup`` lines (testing ``$SLURMD_NODENAME``), which the
doctor runs on each node as a job's task does.

A GPU profile on the nodes with GRES GPUs (``start_cluster.sh``'s ``GPU_NODES``: Slurm gives the
job their GPUs, the nodes have none) fails the GPU row of each node with its fix.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from orchestrator.supervise.doctor import MIN_SHM_BYTES
from tests.helpers.cli import run_cli, user_profile_dir
from tests.helpers.container_image import CACHE_ROOT, build_image, image_python
from tests.helpers.gres import gres_truth
from tests.helpers.podman import podman_conf
from tests.helpers.preconditions import require, require_debian_packages
from tests.helpers.slurm_cluster import require_cluster

CHECKS = {"interpreter", "import torch", "import accelerate", "import orchestrator", "GPUs", "/dev/shm"}


def doctor(args: list[str], env: dict[str, str]) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    res = run_cli(["doctor", *args, "--json"], env, timeout=240)
    seconds = time.monotonic() - started
    assert res.stdout.strip(), res.stderr
    return res.returncode, json.loads(res.stdout), seconds


def failed(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["check"], r["node"]): r for r in report["rows"] if not r["ok"]}


def test_a_healthy_profile_passes_with_an_all_reduce(
    slurm_cluster: dict[str, str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    code, report, seconds = doctor(["slurm_test", "--nodes", "2"], orch_env)
    assert failed(report) == {} and code == 0, report
    rows = report["rows"]
    assert {r["node"] for r in rows if r["check"] == "/dev/shm"} == {"n1", "n2"}
    assert {r["check"] for r in rows} >= CHECKS
    allreduce = next(r for r in rows if r["check"] == "all-reduce")
    assert "Mbit/s bus bandwidth (gloo, 2 nodes" in allreduce["value"], allreduce
    assert report["folder"] is None and not list((tmp_path / "runs").rglob("node_*.txt"))  # removed
    print(f"\n[doctor] healthy: {seconds:.1f} s wall (CLI), step {report['seconds']} s; {allreduce['value']}")


def test_planted_problems_are_each_named_with_node_and_fix(
    slurm_cluster: dict[str, str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    cluster = require_cluster()
    require(cluster.nodes >= 3, "three nodes (one per planted problem)")
    require(slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_MODE") == "netns", "node names per namespace")
    require_debian_packages("podman", "runc")
    image = build_image()
    assert image.is_relative_to(CACHE_ROOT)
    shadow = tmp_path / "no_torch"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text("raise ImportError('planted: no torch on this node')\n")
    setup = [
        # n1: its own /dev/shm (16 MiB), its own run root and an empty image cache, in a private mount
        # namespace; the whole task script runs again inside it ($BASH_EXECUTION_STRING), once.
        'if [ "$SLURMD_NODENAME" = n1 ] && [ -z "$PLANTED" ]; then export PLANTED=1; '
        "exec unshare --mount --propagation private bash -c "
        '\'mount -t tmpfs -o size=16m planted /dev/shm && mount -t tmpfs planted "$ORCHESTRATOR_RUNS" '
        f'&& mount -t tmpfs planted {CACHE_ROOT} && exec bash -c "$0"\' "$BASH_EXECUTION_STRING"; fi',
        f'if [ "$SLURMD_NODENAME" = n2 ]; then export PYTHONPATH={shadow}:"$PYTHONPATH"; fi',
        'if [ "$SLURMD_NODENAME" = n3 ]; then ulimit -l 64; fi',
    ]
    container = {"runtime": "podman", "image": str(image), "python": image_python()}
    profiles = user_profile_dir(tmp_path, "slurm_test", setup=setup, container=container)
    env = {**orch_env, "CONTAINERS_CONF": str(podman_conf(tmp_path))}
    code, report, seconds = doctor(["slurm_test", "--nodes", "3", "--profiles-dir", str(profiles)], env)
    assert code == 1, report
    got = failed(report)
    print(f"\n[doctor] planted: {seconds:.1f} s wall (CLI); failed: {sorted(got)}")
    assert "run directory shared" in {c for c, n in got if n == "n1"}, got
    shared = got[("run directory shared", "n1")]
    assert "not visible" in shared["value"] and "$ORCHESTRATOR_RUNS" in shared["fix"], shared
    shm = got[("/dev/shm", "n1")]
    assert shm["value"].startswith("16.0 MiB <") and "/dev/shm" in shm["fix"], shm
    torch = got[("import torch", "n2")]
    assert "planted: no torch on this node" in torch["value"] and "install torch" in torch["fix"], torch
    memlock = got[("ulimit -l", "n3")]
    assert memlock["value"].startswith("64 KiB") and "ulimit -l unlimited" in memlock["fix"], memlock
    image_row = got[("container image", "n1")]
    assert str(image) in image_row["value"] and "container.image" in image_row["fix"], image_row
    # Where the image is, podman starts it and torch imports inside: the time it took is said.
    started = {r["node"]: r["value"] for r in report["rows"] if r["check"] == "container image" and r["ok"]}
    assert set(started) == {"n2", "n3"}, report["rows"]
    for value in started.values():
        assert value.startswith("podman started it in ") and " s: torch 2.13" in value, started
    print(f"[doctor] image started: {started}")
    # Each problem only where it was planted (accelerate imports torch: it fails with it on n2).
    by_node = {node: {c for c, n in got if n == node} for node in ("n1", "n2", "n3")}
    assert by_node == {
        "n1": {"run directory shared", "/dev/shm", "container image"},
        "n2": {"import torch", "import accelerate"},
        "n3": {"ulimit -l"},
    }, got
    # Not run: n2 cannot join, says so at once (no rendezvous timeout), and is the node named.
    assert got[("all-reduce", "all")]["value"] == "n2: not run: torch does not import here", got
    assert seconds < 90
    assert MIN_SHM_BYTES > 16 << 20
    assert report["folder"] is not None  # kept to look at


def test_a_gpu_profile_on_gres_nodes_without_gpus_fails_each_node_s_gpu_row(
    slurm_cluster: dict[str, str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    """Slurm places the doctor's step on the nodes whose GRES has the profile's GPUs (its ``--gres``);
    torch sees none there: the GPU row fails on each of them with its fix, exit 1, and the all-reduce
    (NCCL's on a GPU profile) is not attempted."""
    import torch

    nodes, kind, count = gres_truth()
    profiles = user_profile_dir(tmp_path, "slurm_test", gpus_per_node=count, gpu_type=kind)
    code, report, seconds = doctor(["slurm_test", "--nodes", "2", "--profiles-dir", str(profiles)], orch_env)
    assert code == 1 and not report["ok"], report
    got = failed(report)
    print(f"\n[doctor] GPU profile on GRES nodes: {seconds:.1f} s wall (CLI); failed: {sorted(got)}")
    gpu_rows = {n: r for (c, n), r in got.items() if c == "GPUs"}
    assert set(gpu_rows) == set(nodes[:2]), report["rows"]
    for row in gpu_rows.values():
        # The nodes run this interpreter's torch: a CPU-only build is said, with a fix both ways.
        build = " (a CPU-only build)" if torch.version.cuda is None else ""
        assert row["value"].startswith(f"0 GPU(s) seen by torch {torch.__version__}{build}, "), row
        assert f"gpus_per_node is {count}" in row["value"], row
        assert "run on nodes with the profile's GPUs" in row["fix"], row
        assert ("install a CUDA build of torch" in row["fix"]) is bool(build), row
    allreduce = got[("all-reduce", "all")]
    assert allreduce["value"].endswith(": not run: torch sees no GPU here"), allreduce
    assert {c for c, _ in got} <= {"GPUs", "ulimit -l", "all-reduce"}, got
