"""A job's whole request reaches the login host: ``orchestrator.submit(profile=<a login: profile>, ...)``
over a real OpenSSH server on loopback (``tests/helpers/login_host.py``), the laptop being a child
process with its own registry and a PATH of ssh, git and Python only.

``container_image`` was missing from the API's keywords and from the flags sent to the login host,
so the image was dropped without a word; now the request is declared once
(``orchestrator/config/job_request.py``) and both derive from it. What the login host recorded is
read where it keeps it: the plan in the run directory (``job.json``). The login host's profile runs
the local scheduler, which runs no container (a ``container:`` block there is refused), so
``container_image`` arrives as the keywords a local profile refuses do (``auto_resume``, ``exclude``,
``after``): the login host's refusal names each, and the image's own value.
``tests/config/test_job_request.py`` walks every keyword through the same flags without a connection.
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

from orchestrator.config.plan import LaunchPlan
from tests.helpers.cli import REPO, kill_tree
from tests.helpers.login_host import LoginHost, laptop_path, login_host

#: The laptop's script: prints its arguments.
SCRIPT = "import sys\nprint(sys.argv[1:], flush=True)\n"
IMAGE = "/images/requested.sif"

API_SCRIPT = """
import json, orchestrator
job = orchestrator.submit(
    profile="cluster", script="job.py", args=["a b", "--lr", 3e-4],
    strategy="full_shard", options={"mixed_precision": "bf16", "script_hooks": False}, nodes=2,
    procs_per_node=1, name="boxed job", time="00:20:00", max_requeues=1, hang_timeout=600,
)
refusals = {}
for keyword, value in (("auto_resume", True), ("exclude", "n1,n2"), ("after", ["123:any"]),
                       ("container_image", %(image)r)):
    try:
        orchestrator.submit(profile="cluster", script="job.py", **{keyword: value})
    except orchestrator.UserError as exc:
        refusals[keyword] = str(exc)
print(json.dumps({"job": job.job_id, "run_dir": str(job.run_dir), "state": job.wait(), "refusals": refusals}))
"""


@pytest.fixture(scope="module")
def laptop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Path, LoginHost]]:
    """(the laptop's environment, its project folder, the login host). The laptop's profile
    ``cluster`` names the login host and, there, a local profile of its own."""
    tmp = tmp_path_factory.mktemp("remote-request")
    runtime = Path(tempfile.mkdtemp(prefix="xdg-"))  # short: the master's socket path has ~100 bytes
    local = yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())
    there = tmp / "login-profiles" / "boxed.yaml"  # the login host's own profile
    there.parent.mkdir()
    there.write_text(yaml.safe_dump(local))
    with login_host(tmp / "sshd", "login-r") as host:
        login = {"host": "login-r", "ssh_config": str(host.ssh_config), "python": sys.executable,
                 "profile": str(there), "home": str(tmp / "login-home"), "runs": str(tmp / "login-runs"),
                 "connect_timeout": 5}  # fmt: skip
        (tmp / "profiles").mkdir()
        (tmp / "profiles" / "cluster.yaml").write_text(yaml.safe_dump({**local, "login": login}))
        project = tmp / "project"
        project.mkdir()
        (project / "job.py").write_text(SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATOR_", "SLURM_"))}
        env.update(ORCHESTRATOR_PROFILES=str(tmp / "profiles"), ORCHESTRATOR_HOME=str(tmp / "laptop-home"),
                   PATH=laptop_path(tmp), XDG_RUNTIME_DIR=str(runtime), PYTHONPATH=str(REPO))  # fmt: skip
        try:
            yield env, project, host
        finally:
            subprocess.run(
                ["ssh", "-F", str(host.ssh_config), "-o", f"ControlPath={runtime}/orchestrator-ssh/%C",
                 "-O", "exit", "login-r"], capture_output=True, timeout=30, check=False,
            )  # fmt: skip
            shutil.rmtree(runtime, ignore_errors=True)
            for pids in (tmp / "login-runs").glob("*/local_pids.json"):
                for pid in json.loads(pids.read_text()).values():
                    kill_tree(int(pid))


def test_a_remote_submit_keeps_every_keyword(laptop: tuple[dict[str, str], Path, LoginHost]) -> None:
    """The login host's plan has every keyword the API was given; the job runs there to COMPLETED;
    the requested image reaches the login host, whose local profile refuses it by name and value."""
    env, project, host = laptop
    before = host.sessions()
    res = subprocess.run(
        [sys.executable, "-c", API_SCRIPT % {"image": IMAGE}], env=env, cwd=project, capture_output=True,
        text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert host.sessions() > before  # it went through the login host
    run_dir = Path(out["run_dir"])
    assert run_dir.is_relative_to(Path(env["ORCHESTRATOR_HOME"]).parent / "login-runs")
    plan = LaunchPlan.from_json(json.loads((run_dir / "job.json").read_text()))
    assert plan.profile_name == "boxed"  # the login host's profile (login.profile)
    assert Path(plan.script).name == "job.py" and plan.script_args == ["a b", "--lr", "0.0003"]
    assert (plan.options.strategy, plan.options.mixed_precision, plan.options.script_hooks) == (
        "full_shard",
        "bf16",
        False,
    )
    assert (plan.nodes, plan.procs_per_node, plan.job_name, plan.time_limit) == (
        2,
        1,
        "boxed job",
        "00:20:00",
    )
    assert (plan.max_requeues, plan.hang_timeout) == (1, 600)
    assert out["state"] == "COMPLETED"
    # The keywords a local scheduler cannot honour reached the login host, which refused each by name.
    refusals = out["refusals"]
    assert set(refusals) == {"auto_resume", "exclude", "after", "container_image"}, refusals
    assert all(r.startswith("submit on the login host of cluster: ") for r in refusals.values()), refusals
    assert "--auto-resume: profile 'boxed' runs locally" in refusals["auto_resume"]
    assert "--exclude n1,n2: profile 'boxed' runs locally" in refusals["exclude"]
    assert "--after: profile 'boxed' runs locally" in refusals["after"]
    assert f"--container-image {IMAGE!r}: profile " in refusals["container_image"]
    assert "boxed.yaml runs no container" in refusals["container_image"]
