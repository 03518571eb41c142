"""tests/cluster/start_cluster.sh starts after an unclean stop: daemons killed with SIGKILL, stale or
lost pid files, a stray daemon still running, a leftover veth, a half-made node network. It removes
only what is its own: a namespace and a link of somebody else's survive."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import REPO, poll
from tests.helpers.slurm_cluster import SlurmCluster, load_cluster, slurm

START = REPO / "tests" / "cluster" / "start_cluster.sh"
#: Job ids may be handed out again after it (tests/conftest.py runs it last).
pytestmark = pytest.mark.kills_cluster
FOREIGN_NS = "orch-test-foreign"
FOREIGN_LINK = "vslforeign0"  # looks like ours to a careless pattern (vsl*), is not vslN


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed daemon whose parent is gone may wait unreaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def test_start_after_unclean_stop(slurm_cluster: dict) -> None:
    cluster = load_cluster()
    base = cluster.base
    run = base / "run"
    pid_files = sorted(run.glob("slurmd-*.pid")) + [run / "slurmctld.pid", run / "mariadbd.pid"]
    stray_dbd = _pid(run / "slurmdbd.pid")
    assert stray_dbd is not None, "the cluster runs with accounting"
    # Earlier tests' jobs end first: killing slurmd under running tasks would leave their nodes to
    # Slurm's own recovery, which is not what this test is about.
    poll(lambda: not _live_jobs(), 120, "earlier jobs to end", diagnostics=lambda: slurm("squeue").stdout)
    live_before = _live_jobs()
    try:
        # Unclean: every daemon but slurmdbd SIGKILLed; slurmdbd keeps running but its pid file is
        # gone (a daemon restarted by hand), the other pid files stay behind, stale.
        for f in pid_files:
            pid = _pid(f)
            if pid:
                os.kill(pid, signal.SIGKILL)
        (run / "slurmdbd.pid").unlink()
        if cluster.netns:
            (run / "netns.list").unlink(missing_ok=True)
            # node 1: namespace gone, a host-side veth left behind ("RTNETLINK answers: File exists").
            # (The kernel keeps the pair while a killed task still holds the namespace; otherwise
            # a stand-in is made.)
            assert _ip("netns", "del", "slurm-n1").returncode == 0
            if _ip("link", "show", "vsl1").returncode != 0:
                assert _ip("link", "add", "vsl1", "type", "veth", "peer", "name", "vsl1peer").returncode == 0
            # node 2: namespace still there, its veth pair gone (half-made network)
            assert _ip("link", "del", "vsl2").returncode == 0
            # the bridge left without its address
            _ip("addr", "flush", "dev", "slbr0")
        assert _ip("netns", "add", FOREIGN_NS).returncode == 0
        assert _ip("link", "add", FOREIGN_LINK, "type", "veth", "peer", "name", "vslforeign1").returncode == 0

        started = _start(cluster)
        assert started.returncode == 0, started.stdout + started.stderr
        said = started.stdout + started.stderr
        assert "ending stray slurmdbd" in said
        if cluster.netns:
            assert "rebuilding the network of n2" in said, said
        assert not _running(stray_dbd), "the stray slurmdbd was ended"
        # Usable: every node up (earlier tests' jobs may still end on some), a 2-node step runs,
        # accounting answers.
        up = slurm("sinfo", "-h", "-N", "-t", "idle,mixed,allocated,completing", "-o", "%N").stdout.split()
        assert len(set(up)) == cluster.nodes, slurm("sinfo", "-N").stdout
        hosts = slurm("srun", "-N", "2", "-t", "1", "hostname", timeout=120).stdout.split()
        assert len(hosts) == 2
        assert slurm("sacct", "-nX", "-S", "now-5minutes").returncode == 0
        # Somebody else's namespace and link were left alone.
        assert FOREIGN_NS in _ip("netns", "list").stdout
        assert _ip("link", "show", FOREIGN_LINK).returncode == 0
        if cluster.netns:
            assert _ip("link", "show", "vsl1peer").returncode != 0, "the leftover veth pair was removed"
            for i, node in enumerate(cluster.node_names, 1):
                assert "master slbr0" in _ip("link", "show", f"vsl{i}").stdout, node
                addr = _ip("-n", f"slurm-{node}", "-4", "addr", "show", "dev", "eth0").stdout
                assert f" {cluster.node_addrs[node]}/" in addr, (node, addr)
    finally:
        _ip("netns", "del", FOREIGN_NS)
        _ip("link", "del", FOREIGN_LINK)
        _start(cluster)  # idempotent: whatever this test broke is mended for the tests after it
        # A SIGKILLed slurmctld restarts from its last saved state, in which jobs that earlier tests
        # had cancelled may still run: end them, so they hold no node the next tests need.
        revived = sorted(_live_jobs() - live_before)
        if revived:
            slurm("scancel", *revived, check=False)
            poll(lambda: not (_live_jobs() & set(revived)), 60, f"revived jobs {revived} to end")
        # Leave every node idle for the tests after this one.
        poll(
            lambda: (
                len(set(slurm("sinfo", "-h", "-N", "-t", "idle", "-o", "%N").stdout.split())) == cluster.nodes
            ),
            90,
            "every node idle again",
            diagnostics=lambda: slurm("sinfo", "-N", "-l").stdout,
        )


def _live_jobs() -> set[str]:
    return set(slurm("squeue", "-h", "-o", "%i", check=False).stdout.split())


def _start(cluster: SlurmCluster) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BASE": str(cluster.base), "NODES": str(cluster.nodes), "MODE": cluster.mode}
    return subprocess.run(
        ["bash", str(START)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
