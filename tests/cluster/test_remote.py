"""From a laptop to the Slurm cluster through its login host (issue 29's done-when), for real.

The login host is a network namespace this module creates on the cluster's bridge (10.77.0.250)
running Debian's sshd with key authentication and Slurm's client configuration; the laptop is this
machine's root namespace with no Slurm command on its PATH (asserted), its own registry, and an
ssh_config the test writes. Everything the laptop does goes through one SSH master.

One module, few jobs: a 2-node job (followed by ``logs -f`` through a cut connection, ``status``,
``wait``; requeued by ``cancel --signal USR2`` and resumed from its checkpoint), a 2-task sweep
running beside it, 100 tasks held behind it for one ``status`` call, and one job through the API.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from orchestrator.contract.attempt_start import read_attempt_start
from tests.helpers.cli import REPO, kill_tree, poll
from tests.helpers.login_host import LoginHost, laptop_path, login_host, login_namespace
from tests.helpers.run_dirs import events
from tests.helpers.slurm_cluster import require_cluster, slurm
from tests.scripts.sweep_task import HOLDING_FILE, expected_loss

pytestmark = pytest.mark.slow
LOGIN_ADDR = "10.77.0.250"


class Laptop:
    def __init__(self, tmp: Path, env: dict[str, str], project: Path, host: LoginHost) -> None:
        self.tmp, self.env, self.project, self.host = tmp, env, project, host

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args], env=self.env, cwd=self.project,
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def ok(self, *args: str, timeout: float = 240) -> str:
        res = self.cli(*args, timeout=timeout)
        assert res.returncode == 0, f"{args}: {res.stdout}{res.stderr}"
        return res.stdout

    def master(self, op: str) -> subprocess.CompletedProcess[str]:
        path = Path(self.env["XDG_RUNTIME_DIR"]) / "orchestrator-ssh" / "%C"
        return subprocess.run(
            ["ssh", "-F", str(self.host.ssh_config), "-o", f"ControlPath={path}", "-O", op, self.host.alias],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip


@pytest.fixture(scope="module")
def laptop(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Laptop]:
    cluster = require_cluster()
    from tests.helpers.preconditions import require

    require(cluster.netns, "the login host is a network namespace on the cluster's bridge (netns mode)")
    tmp = tmp_path_factory.mktemp("remote-slurm")
    runtime = Path(tempfile.mkdtemp(prefix="xdg-"))
    namespace = f"orch-login-{os.getpid()}"
    with login_namespace(namespace, LOGIN_ADDR), login_host(
        tmp / "sshd", "cluster-login", address=LOGIN_ADDR, port=22, netns=namespace,
        env={"SLURM_CONF": cluster.slurm_conf},
    ) as host:  # fmt: skip
        data = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
        data["login"] = {"host": "cluster-login", "ssh_config": str(host.ssh_config), "python": sys.executable,
                         "profile": "slurm_test", "home": str(tmp / "login-home"), "runs": str(tmp / "runs")}  # fmt: skip
        (tmp / "profiles").mkdir()
        (tmp / "profiles" / "cluster.yaml").write_text(yaml.safe_dump(data))
        project = tmp / "project"
        project.mkdir()
        shutil.copy(REPO / "tests" / "scripts" / "sweep_task.py", project / "sweep_task.py")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATOR_", "SLURM_"))}
        env.update(ORCHESTRATOR_PROFILES=str(tmp / "profiles"), ORCHESTRATOR_HOME=str(tmp / "laptop-home"),
                   PATH=laptop_path(tmp), XDG_RUNTIME_DIR=str(runtime), PYTHONPATH=str(REPO))  # fmt: skip
        box = Laptop(tmp, env, project, host)
        try:
            yield box
        finally:
            box.master("exit")
            shutil.rmtree(runtime, ignore_errors=True)


def test_a_two_node_job_a_sweep_and_100_jobs_from_the_laptop(laptop: Laptop) -> None:
    assert shutil.which("sbatch", path=laptop.env["PATH"]) is None  # the laptop has no Slurm
    with pytest.raises(FileNotFoundError):
        subprocess.run(["sbatch", "--version"], env=laptop.env, capture_output=True, timeout=10)

    out = laptop.ok("submit", "--profile", "cluster", "--nodes", "2", "--", "sweep_task.py", "--lr", "0.1",
                    "--steps", "4", "--step-s", "0.2", "--hold-lr", "0.1", "--hold-at", "1")  # fmt: skip
    job = out.split("submitted job ")[1].split()[0]
    run_dir = Path(out.split("run directory ")[1].split()[0])
    assert (run_dir / "snapshot" / "sweep_task.py").read_bytes() == (
        laptop.project / "sweep_task.py"
    ).read_bytes()
    small = laptop.ok("sweep", "--profile", "cluster", "--nodes", "1", "--grid", "lr=0.1,0.2", "--",
                      "sweep_task.py", "--lr", "{lr}", "--steps", "2", "--step-s", "0.1")  # fmt: skip
    small_id = small.split("submitted sweep ")[1].split()[0]

    follow_out = laptop.tmp / "follow.out"
    with open(follow_out, "wb") as sink:
        follow = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "logs", job, "-f", "--node", "0", "--tail", "1000000"],
            env=laptop.env, cwd=laptop.project, stdout=sink, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    held = ""
    try:
        poll(lambda: (run_dir / HOLDING_FILE).exists(), 240, "the job holding in step 1")
        # 100 tasks held behind the job: one status call over all of them is one SSH session.
        big = laptop.ok("sweep", "--profile", "cluster", "--nodes", "1", "--after", job, "--grid",
                        f"seed={','.join(map(str, range(100)))}", "--", "sweep_task.py", "--seed", "{seed}")  # fmt: skip
        held = big.split("submitted sweep ")[1].split()[0]
        tasks = [line.split(": job ")[1].split()[0] for line in big.splitlines() if line.startswith("task ")]
        assert len(tasks) == 100
        before = laptop.host.sessions()
        rows = json.loads(laptop.ok("status", "--json", job, *tasks))["jobs"]
        assert laptop.host.sessions() - before == 1
        assert [r["job_id"] for r in rows] == [job, *tasks]
        assert {r["state"] for r in rows[1:]} == {"PENDING"} and rows[0]["state"] == "RUNNING"
        slurm("scancel", held)  # the test's own array: never to run
        held = ""

        poll(lambda: b"[orchestrator node]" in follow_out.read_bytes(), 60, "logs -f streaming")
        assert laptop.master("exit").returncode == 0  # the connection is cut under logs -f
        sent = laptop.ok("cancel", job, "--signal", "USR2")
        assert "USR2" in sent, sent
        done = laptop.cli("wait", job, timeout=300)
        assert done.returncode == 0 and "COMPLETED" in done.stdout, done.stdout + done.stderr
        _, err = follow.communicate(timeout=120)
    finally:
        kill_tree(follow.pid)
        if held:
            slurm("scancel", held, check=False)
    assert follow.returncode == 0, err
    assert b"reconnecting" in err
    # Nothing twice, nothing lost: every line of both attempts' node-0 logs, in order, exactly once.
    followed = follow_out.read_text().splitlines()
    node_lines = [line for a in ("attempt_0", "attempt_1")
                  for line in (run_dir / "logs" / a / "node_0.log").read_text().splitlines()]  # fmt: skip
    assert [line for line in followed if line in set(node_lines)] == node_lines

    (row,) = json.loads(laptop.ok("status", "--json", job))["jobs"]
    assert (row["state"], row["requeues"], row["nodes"]) == ("COMPLETED", 1, 2), row
    # 4 batches over 2 ranks: 2 steps; resumed from the checkpoint of the held step 1, then step 2
    assert read_attempt_start(run_dir, 1)["step"] == 1
    assert [e["step"] for e in events(run_dir, "train")] == [1, 2]

    assert laptop.cli("wait", small_id, timeout=300).returncode == 0
    view = json.loads(laptop.ok("status", small_id, "--json"))
    for task in view["tasks"]:
        lr = float(task["params"]["lr"])
        assert task["state"] == "COMPLETED" and task["loss"] == pytest.approx(expected_loss(lr, 0, 2)), task


API = """
import json, orchestrator
job = orchestrator.submit(profile="cluster", script="sweep_task.py", args=["--steps", "4", "--step-s", "0.1"],
                          nodes=2)
print(json.dumps({"state": job.wait(), "row": job.status(), "run_dir": str(job.run_dir)}))
"""


def test_the_python_api_from_the_laptop(laptop: Laptop) -> None:
    res = subprocess.run([sys.executable, "-c", API], env=laptop.env, cwd=laptop.project, capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["state"] == "COMPLETED" and out["row"]["nodes"] == 2
    assert [e["step"] for e in events(Path(out["run_dir"]), "train")] == [1, 2]
