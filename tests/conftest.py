"""Shared fixtures: an isolated registry and runs folder per test, local jobs reaped, the cluster.
Helpers (the CLI runner, polling, Slurm helpers) live in tests/helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import REPO, kill_tree
from tests.helpers.preconditions import in_ci

pytest_plugins = ["tests.helpers.cpu_load", "tests.helpers.cluster_first"]

#: Tests allowed to skip when ``CI`` is set, by node id, each with its reason. Empty: in CI a skip is a
#: failure (a missing cluster, package or device must never pass unnoticed as "skipped").
SKIP_ALLOWED_IN_CI: dict[str, str] = {}


def _has_cuda_device() -> bool:
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        res = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0 and "GPU " in res.stdout


#: The one folder of tests that need the real Slurm test cluster: each test in it is marked ``slurm``
#: here, by folder; a ``slurm`` mark anywhere else is an error (tests/test_tests_layout.py checks the
#: source too).
CLUSTER_TESTS = Path(__file__).resolve().parent / "cluster"


def mark_cluster_tests(items: list[pytest.Item]) -> None:
    """Every test under tests/cluster/ gets the ``slurm`` mark; one elsewhere that carries it stops
    the run (it needs the cluster, so it belongs in the cluster folder)."""
    strays = []
    for item in items:
        if item.path.is_relative_to(CLUSTER_TESTS):
            item.add_marker(pytest.mark.slurm)
        elif item.get_closest_marker("slurm"):
            strays.append(item.nodeid)
    if strays:
        raise pytest.UsageError(
            "marked slurm outside tests/cluster/ (move them there; the folder marks them): "
            + ", ".join(strays)
        )


def order_for_workers(items: list[pytest.Item]) -> None:
    """The cluster's tests first, and among them those marked ``kills_cluster`` last.

    First: under pytest-xdist (``-n 3``, the README's command) the cluster's tests are one work
    unit (:func:`pytest_xdist_make_scheduler`), which then starts at once on one worker while the
    other workers take the rest. Last: a SIGKILLed slurmctld restarts from its last saved state, up
    to seconds old: job ids handed out since are handed out again, and ``sacct -j ID`` can then
    answer with an earlier test's job (CI red once: a job's partition read as empty, its QOS as
    Unknown). No cluster test after them can be misled. Then the tests marked ``warms_cache``: the
    first the other worker takes, they build what a cluster test needs (the Debian image) meanwhile."""

    def rank(item: pytest.Item) -> int:
        if not item.get_closest_marker("slurm"):
            return 2 if item.get_closest_marker("warms_cache") else 3
        return 1 if item.get_closest_marker("kills_cluster") else 0

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Work units for pytest-xdist: the cluster's tests are one (one cluster, run one test at a time:
    they share its nodes and its lock), every other test file is one (its module fixtures are made
    once), handed out in collection order. The cluster's ~37 minutes (the suite's critical path)
    then overlap everything else, which the other workers share (``tests/helpers/cluster_first.py``).
    (Not ``--dist loadgroup``: pytest 9.2 keeps a node id in ``_id``, and
    xdist 3.8's group suffix, written to ``_nodeid``, is lost: every test became its own unit.)"""
    from xdist.scheduler import LoadScopeScheduling

    cluster = CLUSTER_TESTS.relative_to(REPO).as_posix() + "/"

    class ClusterApart(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return cluster if path.startswith(cluster) else path

    config.option.loadscopereorder = False
    return ClusterApart(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The cluster folder's tests are marked ``slurm`` (before ``-m`` selects). Tests marked ``gpu``
    are deselected, visibly, on a machine without a CUDA device (CI has none;
    bench/gpu_submit_check.py runs the product path on one): never a skip that reads as a pass."""
    mark_cluster_tests(items)
    order_for_workers(items)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu or _has_cuda_device():
        return
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def pytest_report_header(config: pytest.Config) -> str:
    return "gpu-marked tests run only on a machine with a CUDA device (nvidia-smi -L)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI, a skipped test (``pytest.skip``, ``importorskip``, a ``skipif``) is reported failed."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if (
        report.skipped
        and in_ci()
        and not hasattr(report, "wasxfail")
        and item.nodeid not in SKIP_ALLOWED_IN_CI
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI ({reason}); a skip in CI is a failure (tests/conftest.py)"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """Under CI, a module skipped at collection (``importorskip`` at module level) fails the run."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and in_ci():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI ({reason}); a skip in CI is a failure (tests/conftest.py)"


@pytest.fixture
def orch_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment for CLI subprocesses: own registry and run folder, repo importable."""
    home = tmp_path / "home"
    runs = tmp_path / "runs"
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
    monkeypatch.setenv("ORCHESTRATOR_RUNS", str(runs))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def reap_local_jobs(tmp_path: Path) -> Iterator[None]:
    """Kill whatever local jobs a test started (their pids are in the run folders)."""
    yield
    import json

    for pids in (tmp_path / "runs").glob("*/local_pids.json"):
        for pid in json.loads(pids.read_text()).values():
            kill_tree(int(pid))
