"""The doctor's decision (:func:`orchestrator.supervise.doctor.diagnose`), pure: synthetic node
reports in, which check failed on which node and its fix out. Each planted problem must fail on its
node only, with a fix that names what to change; a healthy report must pass every check."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from orchestrator.supervise.doctor import (
    ALL_NODES,
    MAX_CLOCK_SKEW_S,
    MAX_PORTS_TAKEN_SHARE,
    MIN_MEMLOCK_KIB,
    MIN_NOFILE,
    MIN_SHM_BYTES,
    WAITED_FOR_OTHERS,
    Expected,
    NodeResult,
    Row,
    diagnose,
)

NODES = ["n1", "n2"]


def expected(**changes: Any) -> Expected:
    base: dict[str, Any] = {
        "nodes": NODES,
        "gpus_per_node": 0,
        "python": "python3",
        "version": "1.2.3",
        "run_root": "/shared/runs",
        "container": False,
        "min_bandwidth_mbps": 1000.0,
    }
    base.update(changes)
    return Expected(**base)


def healthy(rank: int) -> dict[str, Any]:
    return {
        "node": rank,
        "python": "/venv/bin/python3",
        "python_version": "3.11.2",
        "imports": {
            "orchestrator": {"version": "1.2.3"},
            "torch": {"version": "2.13.0"},
            "accelerate": {"version": "1.15.0"},
        },
        "gpus": {"count": 0, "names": [], "problems": []},
        "run_dir": {"host_file_seen": True},
        "shm_bytes": 8 << 30,
        "nofile": [65536, 65536],
        "memlock_kib": 8192,
        "image_problems": [],
        "allreduce": {"mbps": 4000.0, "seconds": 0.03, "bytes": 16 << 20, "backend": "gloo"},
    }


def results(**per_node: dict[str, Any]) -> list[NodeResult]:
    out = []
    for rank, name in enumerate(NODES):
        report = copy.deepcopy(healthy(rank))
        change = per_node.get(name, {})
        result = NodeResult(report=report, file_seen=True, skew_s=0.01)
        for key, value in change.items():
            if key in ("file_seen", "skew_s", "report", "no_python", "output"):
                setattr(result, key, value)
            else:
                report[key] = value
        out.append(result)
    return out


def failures(rows: list[Row]) -> dict[tuple[str, str], Row]:
    return {(r.check, r.node): r for r in rows if not r.ok}


def test_a_healthy_cluster_passes_every_check() -> None:
    diagnosis = diagnose(expected(), results())
    assert diagnosis.failed == []
    checks = {r.check for r in diagnosis.rows}
    for check in (
        "interpreter",
        "import torch",
        "import accelerate",
        "import orchestrator",
        "GPUs",
        "run directory shared",
        "/dev/shm",
        "ulimit -n",
        "ulimit -l",
        "clock vs submitting host",
        "clock between nodes",
        "all-reduce",
    ):
        assert check in checks
    allreduce = next(r for r in diagnosis.rows if r.check == "all-reduce")
    assert "4000 Mbit/s" in allreduce.value and allreduce.node == ALL_NODES
    assert diagnosis.as_json()["ok"] is True


def test_torch_failing_on_one_node_names_that_node_and_the_fix() -> None:
    broken = {"torch": {"error": "ImportError: planted"}, "orchestrator": {"version": "1.2.3"}}
    broken["accelerate"] = {"version": "1.15.0"}
    got = failures(
        diagnose(expected(), results(n2={"imports": broken, "allreduce": {"error": "not run: torch"}})).rows
    )
    assert set(got) == {("import torch", "n2"), ("all-reduce", ALL_NODES)}
    assert "ImportError: planted" in got[("import torch", "n2")].value
    assert "install torch" in got[("import torch", "n2")].fix


def test_the_all_reduce_names_the_node_that_could_not_join() -> None:
    told = {"allreduce": {"error": WAITED_FOR_OTHERS}}
    cause = {"allreduce": {"error": "not run: torch does not import here"}}
    row = failures(diagnose(expected(), results(n1=told, n2=cause)).rows)[("all-reduce", ALL_NODES)]
    assert row.value == "n2: not run: torch does not import here"


def test_a_node_whose_check_never_ran_says_why() -> None:
    dead = results(n1={"report": None, "output": ["set-up", "No module named orchestrator"]})
    got = failures(diagnose(expected(), dead).rows)
    assert got[("interpreter", "n1")].value.endswith("No module named orchestrator")
    assert "install orchestrator 1.2.3" in got[("interpreter", "n1")].fix
    missing = results(n2={"report": None, "no_python": True})
    row = failures(diagnose(expected(), missing).rows)[("interpreter", "n2")]
    assert "python3 not found" in row.value and "setup" in row.fix


def test_a_different_orchestrator_version_fails() -> None:
    imports = healthy(0)["imports"] | {"orchestrator": {"version": "0.9"}}
    row = failures(diagnose(expected(), results(n1={"imports": imports})).rows)[("import orchestrator", "n1")]
    assert "0.9" in row.value and "1.2.3" in row.fix


def test_a_gpu_profile_on_nodes_without_gpus_fails() -> None:
    got = failures(diagnose(expected(gpus_per_node=8), results()).rows)
    assert ("GPUs", "n1") in got and ("GPUs", "n2") in got
    assert "0 GPU(s) seen, gpus_per_node is 8" in got[("GPUs", "n1")].value
    # and the memlock rule of GPU profiles: unlimited
    assert ("ulimit -l", "n1") in got


def test_ecc_errors_fail_a_gpu_node() -> None:
    gpus = {"count": 8, "names": ["H100"] * 8, "problems": ["GPU 3: 2 uncorrected ECC error(s)"]}
    got = failures(diagnose(expected(gpus_per_node=8), results(n2={"gpus": gpus, "memlock_kib": -1})).rows)
    assert got[("GPUs", "n2")].value == "GPU 3: 2 uncorrected ECC error(s)"


@pytest.mark.parametrize(
    "change, why",
    [
        ({"file_seen": False}, "the node's file is not visible on the submitting host"),
        ({"run_dir": {"host_file_seen": False}}, "the submitting host's file is not visible on the node"),
    ],
)
def test_an_unshared_run_directory_fails_either_way(change: dict[str, Any], why: str) -> None:
    row = failures(diagnose(expected(), results(n2=change)).rows)[("run directory shared", "n2")]
    assert row.value == why and "/shared/runs" in row.fix


def test_an_unwritable_run_directory_fails() -> None:
    change = {"run_dir": {"error": "cannot write: Read-only file system", "host_file_seen": True}}
    row = failures(diagnose(expected(), results(n1=change)).rows)[("run directory writable", "n1")]
    assert "Read-only" in row.value


def test_small_shm_and_low_limits_fail_at_their_thresholds() -> None:
    fine = {"shm_bytes": MIN_SHM_BYTES, "nofile": [MIN_NOFILE, -1], "memlock_kib": MIN_MEMLOCK_KIB}
    assert diagnose(expected(), results(n1=fine)).failed == []
    low = {"shm_bytes": 64 << 20, "nofile": [1024, 4096], "memlock_kib": 64}
    got = failures(diagnose(expected(), results(n1=low)).rows)
    assert set(got) == {("/dev/shm", "n1"), ("ulimit -n", "n1"), ("ulimit -l", "n1")}
    assert "64.0 MiB" in got[("/dev/shm", "n1")].value
    assert "ulimit -n 4096" in got[("ulimit -n", "n1")].fix  # the hard limit allows no more
    assert "ulimit -l unlimited" in got[("ulimit -l", "n1")].fix


def test_unlimited_memlock_passes_a_gpu_profile() -> None:
    gpus = {"count": 8, "names": ["H100"] * 8, "problems": []}
    both = {"gpus": gpus, "memlock_kib": -1}
    assert diagnose(expected(gpus_per_node=8), results(n1=both, n2=both)).failed == []


def test_clock_skew_against_the_host_and_between_nodes() -> None:
    skewed = results(n2={"skew_s": MAX_CLOCK_SKEW_S + 3})
    got = failures(diagnose(expected(), skewed).rows)
    assert set(got) == {("clock vs submitting host", "n2"), ("clock between nodes", ALL_NODES)}
    assert "n2 ahead of n1" in got[("clock between nodes", ALL_NODES)].value


def test_a_slow_all_reduce_fails_against_the_profile_s_floor() -> None:
    slow = {"allreduce": {"mbps": 300.0, "seconds": 0.4, "bytes": 16 << 20, "backend": "gloo"}}
    row = failures(diagnose(expected(), results(n1=slow)).rows)[("all-reduce", ALL_NODES)]
    assert "300 Mbit/s" in row.value and "< 1000" in row.value


def test_a_missing_image_fails_on_its_node() -> None:
    problem = {"image_problems": ["container image /img.sqsh not found on this node"]}
    got = failures(diagnose(expected(container=True), results(n2=problem)).rows)
    assert set(got) == {("container image", "n2")}


def test_a_step_that_never_started_is_one_allocation_row() -> None:
    none = [NodeResult(report=None), NodeResult(report=None)]
    diagnosis = diagnose(expected(), none, "srun: error: Invalid partition name specified")
    assert [(r.check, r.ok) for r in diagnosis.rows] == [("allocation", False)]
    assert "Invalid partition" in diagnosis.rows[0].value


def test_one_node_skips_the_all_reduce() -> None:
    one = results()[:1]
    diagnosis = diagnose(expected(nodes=["n1"]), one)
    assert diagnosis.failed == []
    assert next(r for r in diagnosis.rows if r.check == "all-reduce").value == "not run (one node)"


@pytest.mark.parametrize("taken", [0, 5, 6, 40])
def test_a_port_range_mostly_taken_on_a_node_fails_there_with_its_fix(taken: int) -> None:
    reports = [healthy(0), healthy(1)]
    for r in reports:
        r["ports"] = {"range": [29500, 29599], "taken": [], "ephemeral": [32768, 60999]}
    reports[1]["ports"]["taken"] = list(range(29500, 29500 + taken))
    rows = [r for r in diagnose(expected(), [NodeResult(r, file_seen=True, skew_s=0.0) for r in reports]).rows
            if r.check == "port range free"]  # fmt: skip
    assert [r.node for r in rows] == NODES and rows[0].ok
    assert rows[1].ok is (taken / 100 <= MAX_PORTS_TAKEN_SHARE), rows[1]
    assert f"{taken} of 100 taken" in rows[1].value
    if not rows[1].ok:
        assert "port_range" in rows[1].fix and "ephemeral" not in rows[1].fix


def test_a_port_range_inside_the_ephemeral_ports_is_said_and_in_the_fix() -> None:
    report = healthy(0)
    report["ports"] = {"range": [40000, 40009], "taken": [40001], "ephemeral": [32768, 60999]}
    (row,) = [r for r in diagnose(expected(nodes=["n1"]), [NodeResult(report, file_seen=True, skew_s=0.0)]).rows
              if r.check == "port range free"]  # fmt: skip
    assert not row.ok and "overlaps the kernel's ephemeral ports 32768-60999" in row.value
    assert "ip_local_port_range" in row.fix


def test_an_image_the_runtime_starts_passes_with_its_time_and_one_it_cannot_fails_there() -> None:
    started = {"runtime": "podman", "code": 0, "seconds": 2.4, "last": "torch 2.13.0 accelerate 1.15.0"}
    broken = {
        "runtime": "podman",
        "code": 1,
        "seconds": 0.8,
        "last": "ModuleNotFoundError: No module named 'torch'",
    }
    want = expected(container=True, image_start=True)
    rows = diagnose(want, results(n1={"image_start": started}, n2={"image_start": broken})).rows
    ok = next(r for r in rows if (r.check, r.node) == ("container image", "n1"))
    assert ok.ok and ok.value == "podman started it in 2.4 s: torch 2.13.0 accelerate 1.15.0", ok
    got = failures(rows)
    assert set(got) == {("container image", "n2")}, got
    row = got[("container image", "n2")]
    assert "podman could not start it (exit 1, 0.8 s)" in row.value and "No module named 'torch'" in row.value
    assert "make podman start the image on this node" in row.fix and "container.python" in row.fix
    hung = {"runtime": "apptainer", "code": None, "seconds": 120.0, "last": "no end within 120 s"}
    row = failures(diagnose(want, results(n1={"image_start": hung})).rows)[("container image", "n1")]
    assert row.value.startswith("apptainer could not start it (did not end, 120.0 s)"), row


def test_a_missing_image_is_named_once_not_started() -> None:
    """The node does not try to start an image it does not have: one row, the missing image's fix."""
    problem = {"image_problems": ["container image x not in this node's podman storage"], "image_start": None}
    started = {"image_start": {"runtime": "podman", "code": 0, "seconds": 1.0, "last": "torch 2.13.0"}}
    got = failures(diagnose(expected(container=True, image_start=True), results(n1=started, n2=problem)).rows)
    assert (
        set(got) == {("container image", "n2")}
        and "pull it into its store" in got[("container image", "n2")].fix
    )


def test_a_gpu_profile_s_all_reduce_names_the_node_without_a_gpu() -> None:
    gpus = {"count": 8, "names": ["H100"] * 8, "problems": []}
    no_gpu = {"allreduce": {"error": "not run: torch sees no GPU here"}}
    waited = {"allreduce": {"error": WAITED_FOR_OTHERS}, "gpus": gpus, "memlock_kib": -1}
    got = failures(diagnose(expected(gpus_per_node=8), results(n1=waited, n2=no_gpu)).rows)
    assert got[("all-reduce", ALL_NODES)].value == "n2: not run: torch sees no GPU here"


def test_a_cpu_only_torch_on_a_gpu_profile_names_the_build_and_its_fix() -> None:
    cpu_torch = {"count": 0, "names": [], "problems": [], "torch": "2.13.0+cpu", "cpu_only": True}
    cuda_torch = {"count": 0, "names": [], "problems": [], "torch": "2.13.0+cu128", "cpu_only": False}
    got = failures(
        diagnose(expected(gpus_per_node=8), results(n1={"gpus": cpu_torch}, n2={"gpus": cuda_torch})).rows
    )
    assert (
        got[("GPUs", "n1")].value
        == "0 GPU(s) seen by torch 2.13.0+cpu (a CPU-only build), gpus_per_node is 8"
    )
    assert got[("GPUs", "n1")].fix.startswith(
        "install a CUDA build of torch into /venv/bin/python3 on the nodes"
    )
    assert got[("GPUs", "n2")].value == "0 GPU(s) seen by torch 2.13.0+cu128, gpus_per_node is 8"
    assert "load the CUDA driver" in got[("GPUs", "n2")].fix
