"""What the remote tests share: a laptop (its own registry, an ssh_config, a PATH of ssh, git and
Python only) whose profile ``cluster`` names a real OpenSSH server on loopback as its login host,
which runs the local scheduler (``tests/helpers/login_host.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import REPO, kill_tree
from tests.helpers.login_host import LoginHost, laptop_path, login_host

#: A script that prints its arguments, then numbered lines at a pace (``logs -f`` has time to drop).
SCRIPT = """import json, os, sys, time
print(json.dumps(sys.argv[1:]), flush=True)
n = int(sys.argv[sys.argv.index("--lines") + 1]) if "--lines" in sys.argv else 3
for i in range(n):
    print(f"line {i} " + "x" * 40, flush=True)
    with open(os.path.join(os.environ["ORCHESTRATOR_RUN_DIR"], "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"event": "train", "step": i + 1, "loss": 1.0 / (i + 1), "step_time_s": 0.1}) + "\\n")
    time.sleep(0.1)
"""


@dataclass
class Laptop:
    tmp: Path
    env: dict[str, str]
    project: Path
    host: LoginHost
    login_runs: Path

    def cli(
        self, *args: str, timeout: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args], env=env or self.env, cwd=self.project,
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def master(self, op: str) -> subprocess.CompletedProcess[str]:
        """``ssh -O op`` on the laptop's master (``check``, ``exit``): the product's ControlPath."""
        path = Path(self.env["XDG_RUNTIME_DIR"]) / "orchestrator-ssh" / "%C"
        return subprocess.run(
            ["ssh", "-F", str(self.host.ssh_config), "-o", f"ControlPath={path}", "-O", op, self.host.alias],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip


def write_profile(folder: Path, name: str, base: str, login: dict[str, object]) -> None:
    data = yaml.safe_load((REPO / "cluster_profiles" / f"{base}.yaml").read_text())
    data["login"] = login
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(data))


@pytest.fixture(scope="module")
def laptop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Laptop]:
    tmp = tmp_path_factory.mktemp("remote")
    runtime = Path(tempfile.mkdtemp(prefix="xdg-"))  # short: the master's socket path has ~100 bytes
    with login_host(tmp / "sshd", "login-a") as host:
        login = {"host": "login-a", "ssh_config": str(host.ssh_config), "python": sys.executable,
                 "profile": "local", "home": str(tmp / "login-home"), "runs": str(tmp / "login-runs"),
                 "connect_timeout": 5}  # fmt: skip
        write_profile(tmp / "profiles", "cluster", "local", login)
        project = tmp / "project"
        project.mkdir()
        (project / "job.py").write_text(SCRIPT)
        (project / "helper.py").write_text("VALUE = 1\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATOR_", "SLURM_"))}
        env.update(ORCHESTRATOR_PROFILES=str(tmp / "profiles"), ORCHESTRATOR_HOME=str(tmp / "laptop-home"),
                   PATH=laptop_path(tmp), XDG_RUNTIME_DIR=str(runtime), PYTHONPATH=str(REPO))  # fmt: skip
        box = Laptop(tmp, env, project, host, tmp / "login-runs")
        try:
            yield box
        finally:
            box.master("exit")
            shutil.rmtree(runtime, ignore_errors=True)
            for pids in (tmp / "login-runs").glob("*/local_pids.json"):
                for pid in json.loads(pids.read_text()).values():
                    kill_tree(int(pid))


def submitted(res: subprocess.CompletedProcess[str]) -> tuple[str, Path]:
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.split("submitted job ")[1].split()[0], Path(
        res.stdout.split("run directory ")[1].split()[0]
    )


def node_log(run_dir: Path) -> str:
    (log,) = sorted((run_dir / "logs").glob("attempt_0/node_0.log")) or sorted(
        (run_dir / "logs").rglob("node_0*.log")
    )
    return log.read_text()
