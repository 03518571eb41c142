"""The Slurm test cluster (tests/cluster/) is a real cluster: real daemons, several nodes, a real
network between them in netns mode, accounting, concurrent jobs, node failure and requeue.

Run: bash tests/cluster/run_with_cluster.sh python -m pytest -q tests/cluster/test_cluster.py
"""

from __future__ import annotations

import datetime as dt
import sys
import textwrap
import time

import pytest

from tests.helpers.preconditions import require
from tests.helpers.slurm_cluster import (
    kill_node_processes,
    require_cluster,
    revive_nodes,
    sacct_rows,
    sbatch,
    slurm,
    slurm_node_pids,
    wait_for_job_state,
    wait_for_node_state,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster():
    return require_cluster()


@pytest.fixture
def shared_dir(tmp_path):
    """A folder every node sees (the nodes share the host's filesystem) and may write to."""
    tmp_path.chmod(0o777)
    return tmp_path


def test_sinfo_shows_partition_with_all_nodes(cluster):
    out = slurm("sinfo", "-h", "-p", cluster.partition, "-o", "%R %D %a").stdout.split()
    assert out == [cluster.partition, str(cluster.nodes), "up"]
    nodes = slurm("sinfo", "-h", "-N", "-p", cluster.partition, "-o", "%N %T").stdout.split("\n")
    states = dict(line.split() for line in nodes if line.strip())
    assert sorted(states) == sorted(cluster.node_names)
    assert all(s in ("idle", "mixed", "allocated") for s in states.values()), states


def test_srun_on_two_nodes(cluster):
    out = slurm(
        "srun",
        "-N2",
        "--ntasks-per-node=1",
        "-l",
        "-p",
        cluster.partition,
        "sh",
        "-c",
        'echo "$SLURMD_NODENAME $(hostname) $(hostname -I)"',
        timeout=60,
    ).stdout
    rows = {}
    for line in out.strip().splitlines():
        rank, rest = line.split(":", 1)
        rows[int(rank)] = rest.split()
    assert [rows[r][0] for r in sorted(rows)] == ["n1", "n2"]
    if cluster.netns:
        # own hostname and own address per node
        assert [rows[r][1] for r in sorted(rows)] == ["n1", "n2"]
        assert rows[0][2] == cluster.node_addrs["n1"] == "10.77.0.11"
        assert rows[1][2] == cluster.node_addrs["n2"] == "10.77.0.12"


def test_tcp_between_tasks_on_different_nodes(cluster, shared_dir):
    if not cluster.netns:
        require(False, "multislurmd mode: all nodes share the host's network, nothing crosses a link")
    script = shared_dir / "tcp_pair.py"
    script.write_text(
        textwrap.dedent("""
        import os, socket, sys, time
        rank = int(os.environ["SLURM_PROCID"])
        port = 29400 + int(os.environ["SLURM_JOB_ID"]) % 500
        deadline = time.monotonic() + 30
        if rank == 0:  # on n1: listen on n1's own address
            srv = socket.create_server((socket.gethostbyname("n1"), port))
            srv.settimeout(30)
            conn, peer = srv.accept()
            data = conn.recv(100).decode()
            print(f"n1 got {data!r} from {peer[0]}", flush=True)
            conn.sendall(b"ack")
        else:  # on n2: connect to n1 by name, retrying until the listener is up
            while True:
                try:
                    c = socket.create_connection(("n1", port), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            c.sendall(f"hello from {socket.gethostname()}".encode())
            print(f"n2 got {c.recv(10).decode()!r}", flush=True)
    """)
    )
    out = slurm(
        "srun",
        "-N2",
        "--ntasks-per-node=1",
        "-p",
        cluster.partition,
        "-w",
        "n1,n2",  # the script's roles are n1's and n2's (a free n3 was chosen after another test)
        sys.executable,
        str(script),
        timeout=90,
    ).stdout
    assert "n1 got 'hello from n2' from 10.77.0.12" in out, out
    assert "n2 got 'ack'" in out, out


def test_sbatch_job_completes_and_shows_in_sacct(cluster, shared_dir):
    if not cluster.accounting:
        require(False, "cluster started with ACCOUNTING=0")
    out_file = shared_dir / "job.out"
    job = sbatch(
        "-N1", "-p", cluster.partition, "-o", str(out_file), "--wrap", "echo hello from $SLURMD_NODENAME"
    )
    wait_for_job_state(job, "COMPLETED", timeout=60)
    # slurmctld sends the record to slurmdbd asynchronously: poll sacct itself.
    deadline = time.monotonic() + 30
    while (rows := sacct_rows(job, "JobID,State,ExitCode")) == [] or rows[0]["State"] != "COMPLETED":
        assert time.monotonic() < deadline, f"sacct never showed COMPLETED: {rows}"
        time.sleep(0.2)
    assert rows[0] == {"JobID": job, "State": "COMPLETED", "ExitCode": "0:0"}
    assert out_file.read_text().startswith("hello from n")


def test_more_nodes_than_partition_is_rejected(cluster):
    proc = slurm(
        "sbatch", "-N", str(cluster.nodes + 1), "-p", cluster.partition, "--wrap", "true", check=False
    )
    assert proc.returncode != 0
    assert "Node count specification invalid" in proc.stderr, proc.stderr


def test_two_jobs_share_two_nodes_at_the_same_time(cluster, shared_dir):
    """Two 2-node jobs, 1 task per node with --cpus-per-task=2 each, run concurrently on n1,n2.

    Each task writes a marker and then waits (bounded) until all four tasks of both jobs have
    written theirs: it can only succeed when both jobs run at the same time.
    """
    barrier = shared_dir / "barrier"
    barrier.mkdir(mode=0o777)
    release = shared_dir / "release"
    script = shared_dir / "job.sh"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        srun -N2 --ntasks-per-node=1 --cpus-per-task=2 bash -c '
          touch {barrier}/$SLURM_JOB_ID.$SLURMD_NODENAME
          end=$((SECONDS + 60))
          until [ $(ls {barrier} | wc -l) -ge 4 ]; do
            [ $SECONDS -lt $end ] || {{ echo "alone: $(ls {barrier})"; exit 1; }}
            sleep 0.1
          done
          n=$(ls {barrier} | wc -l)
          # hold until the test has seen both jobs RUNNING in squeue (else they may end unseen)
          until [ -e {release} ]; do
            [ $SECONDS -lt $end ] || {{ echo "never released"; exit 1; }}
            sleep 0.1
          done
          echo "$SLURMD_NODENAME sees $n tasks"'
    """)
    )
    common = [
        "-N2",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        "--mem=2G",
        "-w",
        "n1,n2",
        "-p",
        cluster.partition,
    ]
    a = sbatch(*common, "-o", str(shared_dir / "a.out"), str(script))
    b = sbatch(*common, "-o", str(shared_dir / "b.out"), str(script))
    try:
        # both RUNNING at once, in squeue (the tasks hold until `release` exists)
        deadline = time.monotonic() + 60
        while True:
            out = slurm("squeue", "-h", "-j", f"{a},{b}", "-o", "%i %T %N").stdout.split("\n")
            running = {line.split()[0]: line.split()[2] for line in out if " RUNNING " in line}
            if len(running) == 2:
                break
            assert time.monotonic() < deadline, f"never both running: {out}"
            time.sleep(0.2)
        assert running == {a: "n[1-2]", b: "n[1-2]"}
        release.touch()
        for job in (a, b):
            wait_for_job_state(job, "COMPLETED", timeout=90)
    finally:
        release.touch()
        slurm("scancel", a, b, check=False)
    assert "sees 4 tasks" in (shared_dir / "a.out").read_text()
    assert "sees 4 tasks" in (shared_dir / "b.out").read_text()

    if cluster.accounting:  # and their time ranges overlap in accounting
        deadline = time.monotonic() + 30
        while True:
            rows = sacct_rows(f"{a},{b}", "JobID,State,Start,End")
            if len(rows) == 2 and all(r["State"] == "COMPLETED" for r in rows):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
        start = [dt.datetime.fromisoformat(r["Start"]) for r in rows]
        end = [dt.datetime.fromisoformat(r["End"]) for r in rows]
        assert max(start) <= min(end), rows


def test_killing_the_processes_on_one_node_fails_the_job(cluster):
    job = sbatch(
        "-N2",
        "--ntasks-per-node=1",
        "-w",
        "n1,n2",
        "-p",
        cluster.partition,
        "-o",
        "/dev/null",
        "--wrap",
        "srun --kill-on-bad-exit=1 sleep 300",
    )
    try:
        wait_for_job_state(job, "RUNNING", timeout=60)
        wait_for_task_on(cluster, "n2", job)
        killed = kill_node_processes("n2", cluster=cluster, job_id=job)
        assert killed
        # srun --kill-on-bad-exit ends the step, the batch script exits non-zero
        assert wait_for_job_state(job, "FAILED", timeout=60) == "FAILED"
        assert wait_for_node_state("n2", ("idle", "mixed"), timeout=30)  # the node itself is fine
    finally:
        slurm("scancel", job, check=False)


def wait_for_task_on(cluster, node, job, timeout=30):
    deadline = time.monotonic() + timeout
    while not slurm_node_pids(node, cluster=cluster, job_id=job):
        assert time.monotonic() < deadline, f"no task of job {job} on {node} after {timeout}s"
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_dead_node_is_noticed_and_its_batch_job_requeued(cluster):
    """n2 dies (slurmd and everything on it): ~20-30 s later it is DOWN and the job, requeued
    (JobRequeue=1), runs again on the remaining nodes; n2 then comes back (ReturnToService=2)."""
    if cluster.nodes < 3:
        require(False, "needs a spare node to requeue a 2-node job onto")
    job = sbatch(
        "-N2", "--ntasks-per-node=1", "-p", cluster.partition, "-o", "/dev/null", "--wrap", "srun sleep 300"
    )
    wait_for_job_state(job, "RUNNING", timeout=60)
    first_nodes = slurm("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
    victim = "n2" if first_nodes in ("n[1-2]", "n[2-3]") else "n1"
    # Trap: kill the node only once the step runs there. A node that dies while srun is still
    # launching makes srun fail ("task launch failed"), the job FAILS and is not requeued.
    wait_for_task_on(cluster, victim, job)
    t0 = time.monotonic()
    try:
        kill_node_processes(victim, include_daemons=True, cluster=cluster)
        wait_for_node_state(victim, "down", timeout=60)
        noticed = time.monotonic() - t0
        deadline = time.monotonic() + 90
        while True:
            q = slurm("squeue", "-h", "-j", job, "-o", "%T %N").stdout.split()
            if (
                q
                and q[0] == "RUNNING"
                and victim not in slurm("scontrol", "show", "hostnames", q[1]).stdout.split()
            ):
                break
            # q empty: the job ended instead of requeueing (once in a loaded CI-like run); sacct says how.
            assert time.monotonic() < deadline, (
                f"job not running again without {victim}: {q}; sacct: "
                + slurm("sacct", "-n", "-X", "-j", job, "-o", "State,ExitCode,NodeList", check=False).stdout
            )
            time.sleep(0.5)
        print(f"{victim} DOWN after {noticed:.0f}s, job running again after {time.monotonic() - t0:.0f}s")
    finally:
        revive_nodes(cluster)
        slurm("scancel", job, check=False)
    wait_for_node_state(victim, ("idle", "mixed"), timeout=30)
    if cluster.accounting:  # sacct -D keeps the record of the failed first run
        deadline = time.monotonic() + 30
        while "NODE_FAIL" not in (
            states := slurm("sacct", "-nXP", "-D", "-j", job, "-o", "State").stdout.split()
        ):
            assert time.monotonic() < deadline, states
            time.sleep(0.5)
