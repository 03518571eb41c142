"""``orchestrator doctor`` on the real Slurm test cluster (issue 43 item 2): it passes on the healthy
``slurm_test`` profile with an all-reduce across the nodes, and one doctor job over three nodes names
each problem planted on one of them, with its node and its fix:

* n1: a private mount namespace (``unshare --mount``, root) with a 16 MiB tmpfs on ``/dev/shm`` and
  another over the run root: a small ``/dev/shm`` and a run directory that is not shared, for real;
* n2: a ``torch`` package that raises on import, first on ``PYTHONPATH`` (a module missing there);
* n3: ``ulimit -l 64`` (the old default that breaks pinned memory);
* the profile's container image lies in the run root, so n1 (its own tmpfs there) is a node without it.

The problems come from the profile's own ``setup`` lines (testing ``$SLURMD_NODENAME``), which the
doctor runs on each node as a job's task does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from orchestrator.supervise.doctor import MIN_SHM_BYTES
from tests.helpers.cli import run_cli, user_profile_dir
from tests.helpers.preconditions import require
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
    shadow = tmp_path / "no_torch"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text("raise ImportError('planted: no torch on this node')\n")
    setup = [
        # n1: its own /dev/shm (16 MiB) and its own run root, in a private mount namespace; the whole
        # task script runs again inside it ($BASH_EXECUTION_STRING), once.
        'if [ "$SLURMD_NODENAME" = n1 ] && [ -z "$PLANTED" ]; then export PLANTED=1; '
        "exec unshare --mount --propagation private bash -c "
        '\'mount -t tmpfs -o size=16m planted /dev/shm && mount -t tmpfs planted "$ORCHESTRATOR_RUNS" '
        '&& exec bash -c "$0"\' "$BASH_EXECUTION_STRING"; fi',
        f'if [ "$SLURMD_NODENAME" = n2 ]; then export PYTHONPATH={shadow}:"$PYTHONPATH"; fi',
        'if [ "$SLURMD_NODENAME" = n3 ]; then ulimit -l 64; fi',
    ]
    # The image lies in the run root, which n1's own tmpfs hides: a node without the image.
    image = tmp_path / "runs" / "image.sif"
    image.parent.mkdir(parents=True, exist_ok=True)
    image.write_bytes(b"not a real image: the doctor checks that it is there")
    container = {"runtime": "apptainer", "image": str(image)}
    profiles = user_profile_dir(tmp_path, "slurm_test", setup=setup, container=container)
    code, report, seconds = doctor(["slurm_test", "--nodes", "3", "--profiles-dir", str(profiles)], orch_env)
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
    # Each problem only where it was planted (accelerate imports torch: it fails with it on n2).
    by_node = {node: {c for c, n in got if n == node} for node in ("n1", "n2", "n3")}
    assert by_node == {
        "n1": {"run directory shared", "/dev/shm", "container image"},
        "n2": {"import torch", "import accelerate"},
        "n3": {"ulimit -l"},
    }, got
    # Not run: n2 cannot join, says so at once (no rendezvous timeout), and is the node named.
    assert got[("all-reduce", "all")]["value"] == "n2: not run: torch does not import here", got
    assert seconds < 60
    assert MIN_SHM_BYTES > 16 << 20
    assert report["folder"] is not None  # kept to look at
