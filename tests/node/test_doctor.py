"""A node's part of ``orchestrator doctor`` (:mod:`orchestrator.node.doctor`), on this machine: what
it measures here, and the go/no-go plus the all-reduce between two real processes over gloo on
loopback (a node that cannot import torch must cost the others no rendezvous timeout). Two simulated
nodes of a GPU profile on this machine's torch, which sees no GPU: the report says so, the all-reduce
is not run (``torch.cuda.set_device`` never reached), and no traceback."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.node.doctor import (
    JOIN_TIMEOUT_S,
    image_start,
    limits,
    package_versions,
    ports_taken,
    run_dir_check,
)
from orchestrator.supervise.doctor import (
    HOST_FILE,
    NODE_FILE,
    REPORT_MARKER,
    WAITED_FOR_OTHERS,
    Expected,
    NodeResult,
    diagnose,
)
from tests.helpers.cli import REPO
from tests.helpers.net import free_port

PAIR = """
import json, sys
from orchestrator.node.doctor import JOIN_TIMEOUT_S, allreduce
from orchestrator.node.preflight import agree
rank, port, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
out = {"go": agree(rank, 2, "127.0.0.1", port, ready, JOIN_TIMEOUT_S)}
if out["go"]:
    out["allreduce"] = allreduce(rank, 2, "127.0.0.1", port + 1, False)
print(json.dumps(out), flush=True)
"""


def run_pair(ready: tuple[bool, bool]) -> tuple[list[dict[str, object]], float]:
    port = free_port()
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PAIR, str(rank), str(port), "1" if ready[rank] else "0"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=JOIN_TIMEOUT_S + 60)
        assert proc.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs, time.monotonic() - started


def test_two_ready_nodes_all_reduce_and_report_bandwidth() -> None:
    outs, _ = run_pair((True, True))
    for out in outs:
        assert out["go"] is True
        figures = out["allreduce"]
        assert isinstance(figures, dict) and figures["backend"] == "gloo"
        assert figures["mbps"] > 0 and figures["bytes"] == 16 << 20


def test_a_node_that_cannot_join_stops_every_node_at_once() -> None:
    outs, seconds = run_pair((True, False))
    assert [out["go"] for out in outs] == [False, False]
    assert seconds < JOIN_TIMEOUT_S / 2  # told at once, not after the rendezvous timeout


def test_the_run_directory_is_written_and_the_host_s_file_read(tmp_path: Path) -> None:
    (tmp_path / HOST_FILE).write_text("token-1")
    assert run_dir_check(tmp_path, 3, "token-1") == {"host_file_seen": True}
    assert (tmp_path / NODE_FILE.format(rank=3)).read_text() == "token-1"
    assert run_dir_check(tmp_path, 3, "another")["host_file_seen"] is False
    own_disk = run_dir_check(tmp_path / "absent", 0, "t")  # made here: not shared, not unwritable
    assert own_disk == {"host_file_seen": False}
    (tmp_path / "file").write_text("")
    blocked = run_dir_check(tmp_path / "file" / "sub", 0, "t")
    assert "cannot write" in blocked["error"] and blocked["host_file_seen"] is False


def test_limits_are_this_process_s() -> None:
    got = limits()
    soft_n, hard_n = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert got["nofile"][0] == (-1 if soft_n == resource.RLIM_INFINITY else soft_n)
    assert isinstance(got["shm_bytes"], int) and got["shm_bytes"] > 0
    soft_l, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert got["memlock_kib"] == (-1 if soft_l == resource.RLIM_INFINITY else soft_l // 1024)


def test_package_versions_name_what_does_not_import(tmp_path: Path) -> None:
    shadow = tmp_path / "accelerate"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('planted: broken accelerate')\n")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        "from orchestrator.node.doctor import package_versions; print(json.dumps(package_versions()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    got = json.loads(out.stdout)
    assert got["accelerate"] == {"error": "ImportError: planted: broken accelerate"}
    assert "version" in got["torch"] and "version" in package_versions()["orchestrator"]


def test_ports_taken_sees_a_listening_and_a_connected_socket_in_the_range() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            mine = client.getsockname()[1]
            found = ports_taken(min(port, mine), max(port, mine))
            assert {port, mine} <= set(found["taken"]), found
            assert ports_taken(port, port)["taken"] == [port]
    low, high = found["ephemeral"]
    assert 0 < low <= high <= 65535


def test_image_start_times_the_command_and_keeps_its_last_line() -> None:
    """A real process stands in for the runtime: its exit status, time and last line are reported."""
    said = image_start([sys.executable, "-c", "print('one'); print('torch 2.13.0')"], [])
    assert said is not None and said["code"] == 0 and said["last"] == "torch 2.13.0", said
    assert said["runtime"] == sys.executable and 0 < said["seconds"] < 60, said
    failed = image_start([sys.executable, "-c", "import sys; sys.exit('no torch in the image')"], [])
    assert failed is not None and failed["code"] == 1 and failed["last"] == "no torch in the image", failed
    missing = image_start(["/nonexistent/podman", "run"], [])
    assert missing is not None and missing["code"] is None and "No such file" in missing["last"], missing


def test_an_image_that_is_not_there_or_no_runtime_is_not_started(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    argv = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    assert image_start(argv, ["container image x not found on this node"]) is None
    assert image_start(None, []) is None and not marker.exists()


def test_a_gpu_profile_on_a_torch_that_sees_no_gpu_says_so_and_runs_no_all_reduce(tmp_path: Path) -> None:
    import torch

    port = free_port()
    spec = {
        "scheduler": "local",
        "folder": str(tmp_path / "doctor"),
        "token": "t",
        "gpus": 2,
        "image": None,
        "image_start": None,
        "port_range": [port, port + 1],
    }
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "CUDA_VISIBLE_DEVICES": "",  # a CUDA build on a GPU machine sees none either
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "2",
        "SUBMITIT_LOCAL_LOCALID": "0",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "orchestrator.node.doctor", json.dumps(spec)],
            cwd=REPO,
            env={**env, "SUBMITIT_LOCAL_NODEID": str(rank), "SUBMITIT_LOCAL_GLOBALID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=JOIN_TIMEOUT_S + 60)
        assert proc.returncode == 0 and "Traceback" not in out, out
        line = next(line for line in out.splitlines() if line.startswith(REPORT_MARKER))
        results.append(NodeResult(json.loads(line.split(" ", 1)[1]), file_seen=True))
    for result in results:
        assert result.report is not None
        gpus = result.report["gpus"]
        assert gpus["count"] == 0 and gpus["torch"] == torch.__version__, gpus
        assert gpus["cpu_only"] is (torch.version.cuda is None and torch.version.hip is None), gpus
        assert result.report["allreduce"] == {"error": "not run: torch sees no GPU here"}, result.report
    want = Expected(["n1", "n2"], 2, sys.executable, "0", str(tmp_path), False, 1000.0)
    rows = {(r.check, r.node): r for r in diagnose(want, results).rows}
    build = " (a CPU-only build)" if torch.version.cuda is None else ""
    for node in ("n1", "n2"):
        row = rows[("GPUs", node)]
        assert not row.ok and row.value.startswith(
            f"0 GPU(s) seen by torch {torch.__version__}{build}, gpus_per_node is 2"
        ), row
        if build:
            assert "install a CUDA build of torch" in row.fix, row
    allreduce = rows[("all-reduce", "all")]
    assert not allreduce.ok and allreduce.value == "n1: not run: torch sees no GPU here", allreduce
    assert WAITED_FOR_OTHERS not in allreduce.value
