"""Every command follows its job to the login host it was submitted through (issue 41, item 3),
against a real OpenSSH server on loopback and the local scheduler (``tests/remote/conftest.py``):
no command answers "unknown job id" for a job this laptop submitted there, a profile loaded with
``--profiles-dir`` is followed as the one in the usual folder, and what is wrong with a login
profile (an interpreter the login host cannot run, an invalid key) is one line and exit 2.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from orchestrator.contract.job_states import JobState
from tests.helpers.cli import kill_tree, poll
from tests.helpers.net import free_port
from tests.remote.conftest import Laptop, submitted, write_profile


def test_every_command_of_the_cli_has_its_route() -> None:
    """A new command must say where it runs from a laptop: by its profile, by its job, here or on
    ``$ORCHESTRATOR_LOGIN``'s host, or only here."""
    from orchestrator.cli.main import COMMANDS
    from orchestrator.remote.routing import BY_JOB, HERE, NO_JOB, PROFILED

    assert set(COMMANDS) == {*PROFILED, *BY_JOB, *NO_JOB, *HERE}
    assert not set(NO_JOB) & {*BY_JOB, *HERE} and not set(HERE) & set(BY_JOB)


def _session(laptop: Laptop, *args: str) -> subprocess.CompletedProcess[str]:
    """The command from the laptop (no ``$ORCHESTRATOR_LOGIN``), which must reach the login host."""
    before = laptop.host.sessions()
    res = laptop.cli(*args)
    assert laptop.host.sessions() > before, f"{args[0]} stayed on the laptop: {res.stderr}"
    assert "unknown job" not in res.stderr, res.stderr
    return res


def test_every_job_command_follows_the_job_to_its_login_host(laptop: Laptop) -> None:
    """``cost`` and ``export`` (which stayed home) and every other command naming a job: each goes
    to the login host the book names for the job, and answers there."""
    job, run_dir = submitted(laptop.cli("submit", "--profile", "cluster", "--nodes", "1", "--procs-per-node",
                                        "1", "--", "job.py", "--lines", "2"))  # fmt: skip
    assert _session(laptop, "wait", job).returncode == 0
    # `--for` goes with it: there, the run (no hook) ended without a checkpoint
    unmet = _session(laptop, "wait", job, "--for", "checkpoint")
    assert unmet.returncode == 1, unmet.stdout + unmet.stderr
    assert f"job {job} ended COMPLETED without a complete checkpoint" in unmet.stderr, unmet.stderr
    bill = _session(laptop, "cost", job, "--json")
    assert bill.returncode == 0, bill.stderr
    assert json.loads(bill.stdout)["target"] == job
    exported = _session(laptop, "export", job, "--out", str(laptop.tmp / f"export-{job}"))
    assert exported.returncode == 2, exported.stdout + exported.stderr  # the login host's own answer:
    assert "checkpoint" in exported.stderr and str(run_dir) in exported.stderr  # its run, no checkpoint
    assert _session(laptop, "status", job).returncode == 0
    assert _session(laptop, "logs", job, "--tail", "1").returncode == 0
    assert _session(laptop, "plot", job, "-o", f"{job}.png").returncode == 0
    assert _session(laptop, "stacks", job).returncode == 1  # an ended job: no process to dump
    assert _session(laptop, "resume", job).returncode == 2  # a COMPLETED job is not resumed
    assert _session(laptop, "cancel", job).returncode in (0, 2)
    # `status` and `list` name no job: they show this laptop's registry, and say where the others are
    for command in ("status", "list"):
        here = laptop.cli(command)
        assert here.returncode == 0, here.stderr
        assert f"`ORCHESTRATOR_LOGIN=cluster orchestrator {command}`" in here.stderr, here.stderr


def test_a_profile_from_profiles_dir_is_followed_to_its_login_host(laptop: Laptop) -> None:
    """``submit --profiles-dir D --profile P``: P is read from D for the connection too (it used to
    be looked for in the usual folders and reported as "no login.host"), and the job's later commands
    find it there again."""
    login = yaml.safe_load((laptop.tmp / "profiles" / "cluster.yaml").read_text())["login"]
    elsewhere = laptop.tmp / "elsewhere"
    write_profile(elsewhere, "aside", "local", login)
    res = laptop.cli("submit", "--profiles-dir", str(elsewhere), "--profile", "aside", "--nodes", "1",
                     "--procs-per-node", "1", "--", "job.py", "--lines", "1")  # fmt: skip
    job, run_dir = submitted(res)
    assert run_dir.is_relative_to(laptop.login_runs)
    done = _session(laptop, "wait", job)
    assert done.returncode == 0 and "COMPLETED" in done.stdout, done.stdout + done.stderr
    checked = laptop.cli("remote", "check", "aside", "--profiles-dir", str(elsewhere))
    assert checked.returncode == 0 and "same as this laptop" in checked.stdout, (
        checked.stdout + checked.stderr
    )


def test_doctor_runs_on_the_login_host_under_the_login_profile_s_name(laptop: Laptop) -> None:
    """``doctor PROFILE``: the profile is its first word, not ``--profile``; the login host checks its
    own profile (``login.profile``: local here, which it refuses naming that profile)."""
    res = laptop.cli("doctor", "--nodes", "9", "cluster")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--nodes 9: profile local allows 1 to 4 nodes" in res.stderr, res.stderr


def test_a_login_python_that_does_not_run_is_one_line_and_exit_2(laptop: Laptop) -> None:
    """The login host's shell answers 127 for a missing interpreter (126: not executable), which the
    CLI's contract (0, 1, 2) does not have: one line naming the key, its value and the fix."""
    login = yaml.safe_load((laptop.tmp / "profiles" / "cluster.yaml").read_text())["login"]
    not_executable = laptop.tmp / "not-executable-python"
    not_executable.write_text("")
    for name, python in (("nopy", "/nowhere/venv/bin/python"), ("noexec", str(not_executable))):
        write_profile(laptop.tmp / "profiles", name, "local", {**login, "python": python})
        for args in (("list",), ("submit", "--profile", name, "--", "job.py"), ("ui", "--port", "0")):
            res = laptop.cli(*args, env={**laptop.env, "ORCHESTRATOR_LOGIN": name})
            assert res.returncode == 2, (name, args, res.stdout + res.stderr)
            (line,) = res.stderr.splitlines()
            assert f"profile {name}: login.python {python!r} does not run on login-a" in line, line
            assert f"orchestrator remote install {name}" in line and "Traceback" not in line


def test_an_invalid_login_profile_says_what_is_invalid(laptop: Laptop) -> None:
    """A login profile that does not load is not "missing": the line names its file and key."""
    login = yaml.safe_load((laptop.tmp / "profiles" / "cluster.yaml").read_text())["login"]
    write_profile(laptop.tmp / "profiles", "broken", "local", {**login, "connect_timeout": "soon"})
    for args, env in ((("list",), {"ORCHESTRATOR_LOGIN": "broken"}), (("remote", "check", "broken"), {})):
        res = laptop.cli(*args, env={**laptop.env, **env})
        assert res.returncode == 2, res.stdout + res.stderr
        (line,) = res.stderr.splitlines()
        assert "broken.yaml" in line and "connect_timeout" in line, line
        assert "no profile of that name" not in line
    gone = laptop.cli("list", env={**laptop.env, "ORCHESTRATOR_LOGIN": "nosuch"})
    assert gone.returncode == 2 and "unknown profile 'nosuch'" in gone.stderr, gone.stderr


def test_a_version_mismatch_names_the_profile_to_install(laptop: Laptop) -> None:
    """The login host's orchestrator of another version: the fix names this laptop's profile."""
    login = yaml.safe_load((laptop.tmp / "profiles" / "cluster.yaml").read_text())["login"]
    other = laptop.tmp / "other-version" / "bin" / "python"
    other.parent.mkdir(parents=True)
    # `python -m orchestrator.cli.login_agent VERSION ...` as an agent of another version sees it
    other.write_text(
        f'#!/bin/sh\nshift 3\nexec {sys.executable} -m orchestrator.cli.login_agent 0.0.0-other "$@"\n'
    )
    other.chmod(0o755)
    write_profile(laptop.tmp / "profiles", "older", "local", {**login, "python": str(other)})
    res = laptop.cli("list", env={**laptop.env, "ORCHESTRATOR_LOGIN": "older"})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "run `orchestrator remote install older` on the laptop" in res.stderr, res.stderr
    assert "PROFILE" not in res.stderr


API_SCRIPT = """
import json, orchestrator, sys
job = orchestrator.submit(profile="cluster", script="job.py", args=["--lines", "2"], nodes=1, procs_per_node=1)
state = job.wait(timeout=120)
row = job.status()
slow = orchestrator.submit(profile="cluster", script="job.py", args=["--lines", "600"], nodes=1,
                           procs_per_node=1)
try:
    slow.wait(timeout=1, poll=0.2)
    timed_out = None
except TimeoutError as exc:
    timed_out = str(exc)
slow.cancel()
far = orchestrator.submit(profile="apart", profiles_dir=sys.argv[1], script="job.py", args=["--lines", "1"],
                          nodes=1, procs_per_node=1)
print(json.dumps({
    "state": [type(state).__name__, state.value],
    "row": [type(row.state).__name__, row.state.value, row.job_id, row.step, row.to_json()["job_id"]],
    "job": job.job_id, "timed_out": timed_out, "slow": slow.job_id,
    "slow_after": slow.wait(timeout=120).value,
    "far": [type(far).__name__, str(far.run_dir), far.wait(timeout=120).value],
}))
"""


def test_the_remote_api_waits_with_a_timeout_and_its_status_has_a_state(laptop: Laptop) -> None:
    """``submit(profile=<login profile>).wait(timeout=...)`` (a TypeError after the job was submitted)
    and ``status().state``, as on a local :class:`orchestrator.Job`; a timeout passed is TimeoutError;
    a profile given with ``profiles_dir=`` is followed to its login host as well."""
    login = yaml.safe_load((laptop.tmp / "profiles" / "cluster.yaml").read_text())["login"]
    write_profile(laptop.tmp / "api-profiles", "apart", "local", login)  # only through profiles_dir
    res = subprocess.run([sys.executable, "-c", API_SCRIPT, str(laptop.tmp / "api-profiles")], env=laptop.env,
                         cwd=laptop.project,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    out = json.loads(res.stdout) if res.returncode == 0 else None
    if out is None:
        for pids in laptop.login_runs.glob("*/local_pids.json"):
            for pid in json.loads(pids.read_text()).values():
                kill_tree(int(pid))
    assert out is not None, res.stdout + res.stderr
    assert out["state"] == ["JobState", "COMPLETED"]
    assert out["row"] == ["JobState", "COMPLETED", out["job"], 2, out["job"]]
    assert out["timed_out"] and out["slow"] in out["timed_out"], out["timed_out"]
    assert out["slow_after"] == JobState.CANCELLED.value
    kind, far_run_dir, far_state = out["far"]  # a profile from profiles_dir= goes to its login host too
    assert kind == "RemoteJob" and Path(far_run_dir).is_relative_to(laptop.login_runs), out["far"]
    assert far_state == "COMPLETED"


#: ``train/train.py``'s shape: a script in a package folder that imports the package by its name.
PACKAGED = """import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train import checkpointing

print("imported", checkpointing.WHERE, flush=True)
"""


def test_a_script_in_a_package_arrives_with_its_folder(laptop: Laptop) -> None:
    """``train/train.py`` importing ``from train import checkpointing`` runs from a laptop (its folder
    used to arrive flattened on the login host, where ``train`` was then ``train.py`` itself), and
    from a local ``--snapshot`` too, which copied the same flattened folder."""
    project = laptop.tmp / "packaged"
    (project / "train").mkdir(parents=True)
    (project / "train" / "__init__.py").write_text("")
    (project / "train" / "checkpointing.py").write_text("WHERE = 'the package'\n")
    (project / "train" / "train.py").write_text(PACKAGED)
    for profile in ("cluster", "local"):
        # the laptop's own jobs in a registry of their own: its local-N ids are also the login host's
        env = {**laptop.env, "ORCHESTRATOR_RUNS": str(laptop.tmp / "laptop-runs")}
        if profile == "local":
            env["ORCHESTRATOR_HOME"] = str(laptop.tmp / "laptop-local-home")
        res = subprocess.run(
            [sys.executable, "-m", "orchestrator", "submit", "--profile", profile, "--snapshot", "--nodes", "1",
             "--procs-per-node", "1", "--wait", "--", "train/train.py"],
            env=env, cwd=project, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        job, run_dir = submitted(res)
        assert (run_dir / "snapshot" / "train" / "checkpointing.py").is_file(), profile
        shown = subprocess.run([sys.executable, "-m", "orchestrator", "logs", job], env=env, cwd=project,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "imported the package" in shown.stdout, (profile, shown.stdout + shown.stderr)


def _dashboard_agents() -> list[psutil.Process]:
    """The login host's agents serving a laptop's forwarded dashboard (sshd is on this machine)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        words = proc.info["cmdline"] or []
        if "orchestrator.cli.login_agent" in words and "ui" in words:
            found.append(proc)
    return found


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
def test_the_login_hosts_dashboard_is_forwarded_here_and_stopped_with_ctrl_c(
    laptop: Laptop, stop: signal.Signals
) -> None:
    """``ORCHESTRATOR_LOGIN=P orchestrator ui``: the dashboard runs on the login host behind a token
    (its loopback is every user's there), this laptop's port is forwarded to it and printed with the
    token; Ctrl-C ends the dashboard there and the forward here (it used to be left running)."""
    job, _ = submitted(laptop.cli("submit", "--profile", "cluster", "--nodes", "1", "--procs-per-node", "1",
                                  "--", "job.py", "--lines", "1"))  # fmt: skip
    assert laptop.cli("wait", job).returncode == 0
    port = free_port()
    out = laptop.tmp / f"ui-{port}.out"
    env = {**laptop.env, "ORCHESTRATOR_LOGIN": "cluster"}
    # SIGINT at its default in the child, as a terminal gives it, whatever this worker's disposition is
    # (ignored in a suite run as a background job, CONTRIBUTING's trap; tests/cli/test_wait.py does the
    # same). In the whole suite on two workers the Ctrl-C was ignored twice (60 s, the TERM variant
    # fine) while this file alone passed: the child had inherited SIG_IGN from its worker.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(out, "wb") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", "--port", str(port)], env=env,
                                    cwd=laptop.project, stdout=sink, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        poll(lambda: b"serving" in out.read_bytes() or proc.poll() is not None, 60, "the forwarded dashboard")
        line = out.read_text().splitlines()[0]
        assert line.startswith(f"orchestrator ui: serving http://127.0.0.1:{port}/?token="), line
        token = line.split("?token=", 1)[1].split()[0]
        (agent,) = _dashboard_agents()
        ask = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/jobs", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(ask, timeout=30) as answer:
            assert job in answer.read().decode()  # the login host's registry, through the forward
        with pytest.raises(
            urllib.error.HTTPError
        ) as refused:  # no token: refused, as to any other user there
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/jobs", timeout=30)
        assert refused.value.code in (401, 403)
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 130, err
    psutil.wait_procs([agent], timeout=30)
    assert not agent.is_running() and _dashboard_agents() == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_busy_laptop_port_is_one_line_and_nothing_is_left_running(laptop: Laptop) -> None:
    """The forward cannot open (this laptop's port is taken): exit 2, one line naming the port, and
    the dashboard already started on the login host is stopped."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = laptop.cli(
            "ui", "--port", str(port), env={**laptop.env, "ORCHESTRATOR_LOGIN": "cluster"}, timeout=60
        )
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = res.stderr.splitlines()
    assert f"--port {port}: cannot forward it to login-a" in line, line
    poll(lambda: _dashboard_agents() == [], 30, "the login host's dashboard to stop")


def test_an_id_two_login_hosts_gave_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clusters count job ids on their own: a job id the book has from two login hosts is not
    sent to the newer one (whose job of that id is another), nor answered from the other's ended row."""
    from orchestrator.contract.errors import UserError
    from orchestrator.remote import book
    from orchestrator.remote.routing import route

    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path))
    monkeypatch.delenv("ORCHESTRATOR_LOGIN", raising=False)
    a, b = book.Target("a"), book.Target("b", "/elsewhere")
    book.remember(a, ["100", "200"])
    book.remember_final(a, [{"job_id": "100", "state": "COMPLETED"}])
    assert book.final_row("100", a) is not None and book.final_row("100", b) is None
    book.remember(b, ["100"])
    with pytest.raises(UserError, match=r"job 100_3: that id was given by more than one login host \(a, b\)"):
        route(["status", "100_3"])
    assert book.final_row("100", a) is None and book.final_row("100", b) is None
    assert route(["logs", "200"]) == a and route(["cost", "300"]) is None
    book.remember(book.Target("a", "/its/folder"), ["200"])  # the same profile, its folder now known
    assert route(["logs", "200"]) == book.Target("a", "/its/folder")


def test_a_profile_found_in_the_submitting_folder_is_found_again_from_anywhere(laptop: Laptop) -> None:
    """``./cluster_profiles/P.yaml`` of the folder the job was submitted from: later commands, typed
    in another folder, still find P (the book keeps the folder it was found in)."""
    login = yaml.safe_load((laptop.tmp / "profiles" / "cluster.yaml").read_text())["login"]
    write_profile(laptop.project / "cluster_profiles", "nearby", "local", login)
    job, _ = submitted(laptop.cli("submit", "--profile", "nearby", "--nodes", "1", "--procs-per-node", "1",
                                  "--", "job.py", "--lines", "1"))  # fmt: skip
    res = subprocess.run([sys.executable, "-m", "orchestrator", "wait", job], env=laptop.env, cwd=laptop.tmp,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    assert res.returncode == 0 and "COMPLETED" in res.stdout, res.stdout + res.stderr
