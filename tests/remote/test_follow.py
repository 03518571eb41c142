"""The module-level API follows a job to the login host it was submitted through, as the command
line does (issue 41, item 3): ``api.wait(job)``, ``api.status([job])``, ``api.get_job(job)``,
``api.cost(job)``, ``api.logs(job)``, ``api.cancel(job)`` and ``api.plot(job)`` answered "unknown job
id" on the laptop.
An id this laptop's own registry has too is refused, naming both; ``export`` from a laptop writes its
``--out`` on the login host. Against a real OpenSSH server on loopback (``tests/remote/conftest.py``).
"""

from __future__ import annotations

import json
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract.errors import UserError
from orchestrator.contract.job_states import JobState
from tests.helpers import train_launch as tl
from tests.helpers.cli import REPO
from tests.remote.conftest import Laptop, submitted

#: The laptop's program: every module-level call that names a job, for jobs submitted from the
#: laptop through the login host; one JSON object of what each answered.
API_SCRIPT = """
import io, json, sys
from orchestrator import api
from orchestrator.contract.errors import UserError
from orchestrator.runner.progress import WaitTimeout

quick, slow = sys.argv[1], sys.argv[2]
out = {"wait": api.wait(quick, timeout=120).value}
report = api.status([quick])
out["status"] = [report.rows[0].job_id, report.rows[0].state.value, report.all_completed()]
job = api.get_job(quick)
out["get_job"] = [type(job).__name__, str(job.run_dir), job.status().state.value]
out["cost"] = api.cost(quick).to_json()["target"]
lines = io.StringIO()
api.logs(quick, tail=4, out=lines)
out["logs"] = lines.getvalue()
try:
    api.wait(slow, timeout=1, poll=0.2)
except WaitTimeout as exc:
    out["timed_out"] = [exc.job_id, exc.state.value]
out["cancel"] = api.cancel(slow)
out["cancelled"] = api.wait(slow, timeout=120).value
refused = {}
out["plot"] = [str(api.plot(quick)), str(api.plot(quick, "named.png"))]
for name, call in (("stacks", lambda: api.stacks(quick)), ("export", lambda: api.export(quick, "x")),
                   ("resume", lambda: api.resume(quick))):
    try:
        call()
        refused[name] = None
    except UserError as exc:
        refused[name] = str(exc)
out["refused"] = refused
print(json.dumps(out))
"""


#: Steps of the DDP run whose checkpoint the export reads.
STEPS = 4


def _submit(laptop: Laptop, lines: int) -> tuple[str, Path]:
    return submitted(laptop.cli("submit", "--profile", "cluster", "--nodes", "1", "--procs-per-node", "1",
                                "--", "job.py", "--lines", str(lines)))  # fmt: skip


def test_the_module_level_api_follows_the_book_to_the_login_host(laptop: Laptop) -> None:
    quick, run_dir = _submit(laptop, 2)
    slow, _ = _submit(laptop, 600)
    before = laptop.host.sessions()
    res = subprocess.run([sys.executable, "-c", API_SCRIPT, quick, slow], env=laptop.env, cwd=laptop.project,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    if res.returncode != 0:
        laptop.cli("cancel", slow)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert laptop.host.sessions() > before + 8  # every call was answered there
    assert out["wait"] == JobState.COMPLETED.value
    assert out["status"] == [quick, JobState.COMPLETED.value, True]
    assert out["get_job"] == ["RemoteJob", str(run_dir), JobState.COMPLETED.value]
    assert run_dir.is_relative_to(laptop.login_runs)
    assert out["cost"] == quick
    assert "line 1" in out["logs"], out["logs"]
    assert out["timed_out"][0] == slow and out["timed_out"][1] in ("PENDING", "RUNNING"), out["timed_out"]
    assert out["cancel"], out
    assert out["cancelled"] == JobState.CANCELLED.value
    assert out["plot"] == [f"{quick}.png", "named.png"]  # drawn here, in the laptop's folder
    assert all((laptop.project / name).stat().st_size > 0 for name in out["plot"])
    assert set(out["refused"]) == {"stacks", "export", "resume"}
    for name, said in out["refused"].items():  # answers that are this machine's files: one line each
        assert said == (
            f"{name}: job {quick} is on the login host of cluster (submitted through it), and this call "
            f"answers with this machine's files; run `orchestrator {name} {quick}`, which runs there"
        ), said


def test_an_id_this_laptop_and_a_login_host_both_have_is_refused_naming_both(
    laptop: Laptop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The laptop's own ``local-N`` and a login host's: neither is picked without a word (either could
    be another job than the one meant); ``$ORCHESTRATOR_LOGIN`` says which (``-``: this laptop's)."""
    from orchestrator import api
    from orchestrator.remote import book

    here_env = {**laptop.env, "ORCHESTRATOR_LOGIN": "-"}
    _submit(laptop, 1)  # the login host counts local-1, local-2... as this laptop's scheduler does
    res = laptop.cli("submit", "--profiles-dir", str(REPO / "cluster_profiles"), "--profile", "local",
                     "--nodes", "1", "--procs-per-node", "1", "--", "job.py", "--lines", "1")  # fmt: skip
    job, run_dir = submitted(res)
    assert not run_dir.is_relative_to(laptop.login_runs)  # the laptop's own job
    assert laptop.cli("wait", job, env=here_env).returncode == 0
    for name, value in laptop.env.items():
        monkeypatch.setenv(name, value)
    book.remember(book.Target("cluster"), [job])  # the login host gave that id too (it has, by now)
    before = laptop.host.sessions()
    both = (
        f"job {job}: this laptop's registry has a job of that id, and so does the login host of cluster "
        "(submitted through it); say which: ORCHESTRATOR_LOGIN=cluster for the login host's, "
        "ORCHESTRATOR_LOGIN=- for this laptop's"
    )
    for command in ("status", "wait", "cancel", "logs"):
        res = laptop.cli(command, job)
        assert res.returncode == 2, res.stdout + res.stderr
        assert res.stderr.strip().splitlines() == [f"orchestrator {command}: error: {both}"], res.stderr
    with pytest.raises(UserError) as caught:
        api.wait(job, timeout=30)
    assert str(caught.value) == both
    assert laptop.host.sessions() == before  # nothing was asked there
    here = laptop.cli("status", job, "--json", env=here_env)
    assert here.returncode == 0, here.stderr
    assert json.loads(here.stdout)["jobs"][0]["run_dir"] == str(run_dir)
    monkeypatch.setenv("ORCHESTRATOR_LOGIN", "-")
    assert api.wait(job, timeout=30) == JobState.COMPLETED
    assert laptop.host.sessions() == before
    laptop.cli("status", job, env={**laptop.env, "ORCHESTRATOR_LOGIN": "cluster"})
    assert laptop.host.sessions() > before  # that one is asked there


def test_export_from_a_laptop_writes_out_on_the_login_host(laptop: Laptop) -> None:
    """docs/laptop.md: ``export`` runs where the checkpoints are; a relative ``--out`` is under the
    login host's home, not the laptop's folder the command was typed in."""
    job, run_dir = _submit(laptop, 1)
    assert laptop.cli("wait", job).returncode == 0
    trained = tl.cached_run("ddp", 2, 1, 2, ("--max-steps", str(STEPS)), 300)
    assert trained.returncodes and all(c == 0 for c in trained.returncodes), trained.output()
    shutil.copytree(trained.run_dir / "checkpoints", run_dir / "checkpoints")  # a real DDP checkpoint there
    name = f"export-{job}"
    login_home = Path(pwd.getpwnam("root").pw_dir)
    try:
        res = laptop.cli("export", job, "--out", name, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert (login_home / name / "model.safetensors").is_file(), res.stdout
        assert not (laptop.project / name).exists()
        assert str(run_dir) in res.stdout, res.stdout
    finally:
        shutil.rmtree(login_home / name, ignore_errors=True)
