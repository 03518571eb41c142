"""A node's part of the preflight (:mod:`orchestrator.node.preflight`), on this machine.

With the real podman: the image asked about is a name after ``podman image exists``'s end of
options, so a name podman would read as a flag (``--help`` answered "exists") is never taken for a
present image. With two simulated nodes under the supervisor's ``run_preflight``: a node that cannot
join the network check (torch does not import; a GPU profile's torch sees no CUDA device, as this
machine's CPU-only torch) is a named problem of that node, without a traceback, and its peer is told
at once instead of waiting out the timeout.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.node.preflight import image_problems
from orchestrator.supervise.preflight import Verdict, run_preflight
from tests.helpers.cli import REPO
from tests.helpers.podman import import_shell_image, private_podman
from tests.helpers.preconditions import require_debian_packages


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    require_debian_packages("podman", "runc")
    with private_podman(tmp_path) as env:
        for name in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF"):
            monkeypatch.setenv(name, env[name])
        import_shell_image(env, tmp_path, "localhost/present:1")
        yield


@pytest.mark.usefixtures("store")
def test_podman_image_check_reads_every_name_as_an_image() -> None:
    assert image_problems(("podman", "localhost/present:1")) == []
    for name in ("localhost/absent:1", "--help", "-h", "--version"):
        assert image_problems(("podman", name)) == [
            f"container image {name} not in this node's podman storage"
        ]


#: The scheduler's one task per node, for simulated nodes: what submitit's LocalExecutor gives each
#: task (the local scheduler's node environment reads it), node 1 with ``NODE1_PYTHONPATH`` first.
TWO_LOCAL_TASKS = (
    "for r in 0 1; do (export SUBMITIT_LOCAL_NODEID=$r SUBMITIT_LOCAL_GLOBALID=$r; "
    '[ "$r" = 1 ] && export PYTHONPATH="$NODE1_PYTHONPATH:$PYTHONPATH"; exec "$@") & done; wait'
)
NODES = ["n1", "n2"]
#: The preflight's bound here: far above a loaded machine's imports, so a node told at once (under
#: half of it) is told by the go/no-go, never by the timeout.
TIMEOUT_S = 240


def two_free_ports() -> int:
    """A port that, with the next, nothing binds now, below the kernel's ephemeral ports (a port
    ``bind(0)`` gives is one of them, and its neighbour is what outgoing connections take)."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        try:
            with socket.create_server(("", port)), socket.create_server(("", port + 1)):
                return port
        except OSError:
            continue


def run_two_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile: str, node1_path: str = ""
) -> tuple[Verdict, float]:
    """The supervisor's preflight (``run_preflight``) over two simulated nodes of ``profile``, each
    running :mod:`orchestrator.node.preflight` for real, on a port range nothing else uses."""
    from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
    from orchestrator.config.profile.load import load_profile
    from orchestrator.contract.run_dir import write_plan

    name, _, loaded = load_profile(profile)
    data = build_plan(name, loaded, merge_options(loaded), script="x.py", nodes=2, procs_per_node=1).to_json()
    port = two_free_ports()
    data["profile"]["port_range"] = {"start": port, "end": port + 1}
    data["profile"]["preflight"].update(min_free_mb=1, timeout_s=TIMEOUT_S)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_plan(run_dir, 0, data)
    env = {
        "ORCHESTRATOR_RUN_DIR": str(run_dir),
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "2",
        "SUBMITIT_LOCAL_LOCALID": "0",
        "PYTHONPATH": str(REPO),
        "NODE1_PYTHONPATH": node1_path,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    started = time.monotonic()
    verdict = run_preflight(
        run_dir,
        0,
        LaunchPlan.from_json(data),
        NODES,
        ["bash", "-c", TWO_LOCAL_TASKS, "tasks"],
        lambda _: None,
    )
    assert verdict is not None
    return verdict, time.monotonic() - started


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake driver tool saying 8 healthy GPUs: a node whose driver has the profile's GPUs, which this
    machine cannot give for real; only torch, for real here, sees none."""
    folder = tmp_path / "fake_bin"
    folder.mkdir()
    tool = folder / "nvidia-smi"
    tool.write_text('#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "$i, 0"; done\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.usefixtures("fake_nvidia_smi")
def test_a_gpu_profile_on_a_torch_that_sees_no_gpu_names_each_node_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """This machine's torch is CPU-only (on a GPU machine, no device is visible to it): the preflight
    used to raise in ``torch.cuda.set_device`` (a traceback per node) and, with nvidia-smi content,
    to pass; now each node's problem names torch and the profile's GPUs, and nobody starts NCCL."""
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    verdict, seconds = run_two_nodes(tmp_path, monkeypatch, "local_gpu")
    out = capfd.readouterr()
    assert "Traceback" not in out.out + out.err, out.err
    build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build"
    said = f"torch {torch.__version__} ({build}) sees no CUDA device"
    assert verdict.failed and verdict.bad_nodes == NODES, verdict
    for node in NODES:
        assert f"node {node}: {said}" in verdict.reason, verdict.reason
    assert "but the profile asks for 8 GPUs per node (gpus_per_node)" in verdict.reason, verdict.reason
    assert "nvidia-smi" not in verdict.reason, verdict.reason  # the driver's 8 GPUs are fine
    assert seconds < TIMEOUT_S / 2, seconds  # told at once, not after the preflight's timeout
    for rank in (0, 1):
        report = json.loads((tmp_path / "run" / "preflight" / "attempt_0" / f"node_{rank}.json").read_text())
        assert report["network"] == "not run: this node cannot join" and report["peers"] == {}, report


def test_a_node_whose_torch_does_not_import_is_named_and_its_peer_is_told_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('planted: broken torch')\n")
    verdict, seconds = run_two_nodes(tmp_path, monkeypatch, "local", node1_path=str(broken))
    out = capfd.readouterr()
    assert "Traceback" not in out.out + out.err, out.err
    assert verdict.bad_nodes == ["n2"], verdict
    assert "node n2: torch does not import: ImportError: planted: broken torch" in verdict.reason, verdict
    assert seconds < TIMEOUT_S / 2, seconds
    node0 = json.loads((tmp_path / "run" / "preflight" / "attempt_0" / "node_0.json").read_text())
    assert node0["problems"] == [] and node0["network"] == "not run: another node cannot join", node0


def test_cpu_nodes_that_can_join_measure_their_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The go/no-go before the network check lets two good nodes through to gloo's transfers."""
    verdict, _ = run_two_nodes(tmp_path, monkeypatch, "local")
    out = capfd.readouterr()
    assert "Traceback" not in out.out + out.err, out.err
    (link,) = verdict.links
    assert link["rtt_ms"] > 0 and link["to_node_mbps"] > 0 and link["from_node_mbps"] > 0, verdict
    assert "problems" not in verdict.reason and "not run" not in verdict.reason, verdict
