"""Commands from a laptop on a login host over SSH (issue 29), against a real OpenSSH server on
loopback and the local scheduler: what the connection must get right without a Slurm cluster.

The login host is Debian's sshd started by the test (key authentication; a second one accepts
passwords only); the laptop is this process's children, with their own registry, an ssh_config the
test writes, and a PATH holding only ssh, git and Python. The jobs are real local jobs the login
host's orchestrator starts. tests/cluster/test_remote.py does the same against the Slurm cluster.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.config.profile.records import ClusterProfile
from orchestrator.remote import sync as remote_snapshot
from orchestrator.remote.calls import agent_command
from tests.helpers.cli import REPO, kill_tree, poll
from tests.helpers.login_host import login_host
from tests.helpers.net import free_port
from tests.remote.conftest import SCRIPT, Laptop, node_log, submitted, write_profile

HOSTILE_NAME = "x'; touch PWNED #$(touch PWNED2)"
HOSTILE_ARGS = ["a b", "$(touch PWNED3)", "--x=';\"`id`", "*"]


def test_submit_carries_hostile_words_and_follows_the_job(laptop: Laptop) -> None:
    """A job submitted from the laptop runs the laptop's script with its arguments exactly as typed
    (no shell on the way re-reads them), `wait` follows it to COMPLETED and `logs` shows its node log."""
    res = laptop.cli("submit", "--profile", "cluster", "--nodes", "1", "--procs-per-node", "1",
                     "--name", HOSTILE_NAME, "--", "job.py", *HOSTILE_ARGS)  # fmt: skip
    job, run_dir = submitted(res)
    assert run_dir.is_relative_to(laptop.login_runs)  # the login host's runs root, not the laptop's
    assert (run_dir / "snapshot" / "job.py").read_text() == SCRIPT  # the code went with it
    done = laptop.cli("wait", job)
    assert done.returncode == 0 and "COMPLETED" in done.stdout, done.stdout + done.stderr
    shown = laptop.cli("logs", job, "--node", "0")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == node_log(run_dir)
    printed = next(line for line in shown.stdout.splitlines() if line.startswith("[default0]:["))
    assert json.loads(printed.split(":", 1)[1]) == HOSTILE_ARGS
    rows = json.loads(laptop.cli("status", job, "--json").stdout)["jobs"]
    assert [(r["job_id"], r["name"], r["state"]) for r in rows] == [(job, HOSTILE_NAME, "COMPLETED")]
    # An ended job's row is the laptop's own copy from now on: no session at the server.
    before = laptop.host.sessions()
    again = laptop.cli("status", job, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["jobs"] == rows, again.stderr
    assert laptop.host.sessions() == before
    # resume and stacks of an ended job: the login host's own refusals, relayed as they are
    refused = laptop.cli("resume", job)
    assert refused.returncode == 2 and "COMPLETED" in refused.stderr, refused.stdout + refused.stderr
    stacks = laptop.cli("stacks", job)
    assert stacks.returncode != 0 and job in stacks.stderr, stacks.stdout + stacks.stderr
    # plot: the run's metrics come over, the picture is drawn here
    drawn = laptop.cli("plot", job, "-o", "curve.png")
    assert drawn.returncode == 0, drawn.stderr
    assert (laptop.project / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (run_dir / "curve.png").exists() and not (run_dir / "plot.png").exists()
    leaked = [
        p for p in (laptop.project, laptop.login_runs, Path.home(), Path("/")) if list(p.glob("PWNED*"))
    ]
    assert leaked == []


def test_logs_follow_survives_a_cut_connection(laptop: Laptop) -> None:
    """The master is killed while `logs -f` streams two nodes' logs, begun with the default tail (10
    lines) of logs already longer than that: it reconnects and continues where each file was cut.
    Each node's printed lines are one unbroken stretch of its log to the end: nothing twice, nothing
    lost, though the two files' lines interleaved differently in each stream."""
    job, run_dir = submitted(laptop.cli("submit", "--profile", "cluster", "--nodes", "2", "--procs-per-node",
                                        "1", "--", "job.py", "--lines", "60"))  # fmt: skip
    logs = [run_dir / "logs" / "attempt_0" / f"node_{n}.log" for n in (0, 1)]
    poll(lambda: all(p.is_file() and b"line 15 " in p.read_bytes() for p in logs), 120, "15 lines per node")
    out = laptop.tmp / f"follow-{job}.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "logs", job, "-f"],
            env=laptop.env, cwd=laptop.project, stdout=sink, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    try:
        poll(lambda: out.read_bytes().count(b"line ") >= 25, 120, "the first lines through logs -f")
        assert laptop.master("exit").returncode == 0  # the connection is cut mid-stream
        _, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, err
    assert b"reconnecting" in err
    printed = out.read_text().splitlines()
    for n, log in enumerate(logs):
        mine = [line.removeprefix(f"[a0 n{n}] ") for line in printed if line.startswith(f"[a0 n{n}] ")]
        whole = log.read_text().splitlines()
        assert mine == whole[len(whole) - len(mine) :], f"node {n}: not one unbroken stretch to the end"
        assert any("line 59 " in line for line in mine), f"node {n}: not followed to the end"
        assert len(whole) - len(mine) >= 5, f"node {n}: the default tail began mid-log"


def test_a_password_only_host_fails_at_once_with_the_command_to_open_it(laptop: Laptop) -> None:
    """No master open, a host that wants a password: exit 2 within 5 s, one line with the exact
    `ssh -fNM ...` command; nothing asked (BatchMode)."""
    with login_host(laptop.tmp / "sshd-password", "login-pw", password_only=True) as host:
        login = {"host": "login-pw", "ssh_config": str(host.ssh_config), "python": sys.executable}
        write_profile(laptop.tmp / "profiles", "pw", "local", login)
        env = {**laptop.env, "ORCHESTRATOR_LOGIN": "pw"}
        started = time.monotonic()
        res = laptop.cli("status", env=env, timeout=30)
        took = time.monotonic() - started
        # The same from a terminal, as a person types it: ssh could open /dev/tty there, and does not.
        command = shlex.join([sys.executable, "-m", "orchestrator", "status"])
        script = shutil.which("script") or "/usr/bin/script"  # util-linux: on every Debian
        typed = subprocess.run([script, "-qec", command, "/dev/null"], env=env, cwd=laptop.project,
                               capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)  # fmt: skip
    assert took < 5, took
    assert typed.returncode == 2 and "'s password" not in typed.stdout.lower(), typed.stdout
    assert "ssh -fNM" in typed.stdout
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = res.stderr.splitlines()
    assert "login-pw" in line and "password" in line
    command = shlex.split(line.split("then run this again: ", 1)[1])
    assert command[:2] == ["ssh", "-fNM"] and command[-1] == "login-pw"
    assert ["-F", str(host.ssh_config)] == command[2:4]


def test_an_unreachable_host_is_one_line_naming_it(laptop: Laptop) -> None:
    closed = free_port()
    (laptop.tmp / "unreachable.cfg").write_text(f"Host login-gone\n  HostName 127.0.0.1\n  Port {closed}\n")
    login = {"host": "login-gone", "ssh_config": str(laptop.tmp / "unreachable.cfg"), "connect_timeout": 3}
    write_profile(laptop.tmp / "profiles", "gone", "local", login)
    started = time.monotonic()
    res = laptop.cli("list", env={**laptop.env, "ORCHESTRATOR_LOGIN": "gone"}, timeout=30)
    assert time.monotonic() - started < 5
    assert res.returncode == 2
    (line,) = res.stderr.splitlines()
    assert "login host login-gone unreachable" in line and "Connection refused" in line


def test_a_version_mismatch_says_how_to_fix_it(laptop: Laptop) -> None:
    """The login host's agent refuses a laptop of another version, naming the command that fixes it."""
    line = agent_command(_profile(laptop), ["run", "--", "list"]).replace(
        shlex.quote(_version()), "0.0.0-other", 1
    )
    res = subprocess.run(["ssh", "-F", str(laptop.host.ssh_config), "-o", "BatchMode=yes", laptop.host.alias,
                          line], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2
    assert "laptop's is 0.0.0-other" in res.stderr and "orchestrator remote install" in res.stderr
    same = laptop.cli("remote", "check", "cluster")
    assert (
        same.returncode == 0
        and same.stdout.strip() == f"login-a: orchestrator {_version()}, same as this laptop"
    )


def test_only_changed_files_are_sent_and_links_stay_links(laptop: Laptop) -> None:
    """A second submit of the same folder sends only the file that changed; a link out of the project
    arrives as a link (never followed); an over-large folder is refused before any session."""
    (laptop.project / "outside").symlink_to("/etc")
    (laptop.project / "helper.py").write_text("VALUE = 2\n")
    hostile = "my job $(touch PWNED5) 'q'.py"  # a hostile path: the script's own name
    (laptop.project / hostile).write_text(SCRIPT)
    job, run_dir = submitted(laptop.cli("submit", "--profile", "cluster", "--nodes", "1", "--procs-per-node",
                                        "1", "--", hostile, "--lines", "1"))  # fmt: skip
    assert os.readlink(run_dir / "snapshot" / "outside") == "/etc"
    assert (run_dir / "snapshot" / hostile).read_text() == SCRIPT
    profile = _profile(laptop)
    snap = remote_snapshot.plan_snapshot(laptop.project / "job.py")
    mirror = Path(remote_snapshot.mirror_of(snap.source, profile))
    from orchestrator.cli.login_agent import manifest

    assert remote_snapshot.changes(snap.source, snap.files, manifest(mirror)) == ([], [])
    (laptop.project / "helper.py").write_text("VALUE = 3\n")
    (laptop.project / "outside").unlink()
    snap = remote_snapshot.plan_snapshot(laptop.project / "job.py")
    assert remote_snapshot.changes(snap.source, snap.files, manifest(mirror)) == (["helper.py"], ["outside"])
    with open(laptop.project / "big.bin.data", "wb") as f:
        f.truncate(remote_snapshot.plan_snapshot.__defaults__[0] + 1)  # type: ignore[index]
    before = laptop.host.sessions()
    res = laptop.cli("submit", "--profile", "cluster", "--", "job.py")
    (laptop.project / "big.bin.data").unlink()
    assert res.returncode == 2 and "limit" in res.stderr, res.stderr
    assert laptop.host.sessions() == before
    assert laptop.cli("wait", job).returncode == 0
    assert "line 0 " in node_log(run_dir)
    assert not list(laptop.project.glob("PWNED*")) and not list(laptop.login_runs.glob("*/PWNED*"))


def test_the_laptop_routes_only_what_belongs_to_a_login_host(laptop: Laptop) -> None:
    """A local profile's command runs here; a job id from the book goes to its login host."""
    before = laptop.host.sessions()
    res = laptop.cli("submit", "--profile", "local", "--dry-run", "--", "job.py")
    assert res.returncode == 0, res.stderr
    assert laptop.host.sessions() == before
    listed = laptop.cli("list", "--json", env={**laptop.env, "ORCHESTRATOR_LOGIN": "cluster"})
    assert listed.returncode == 0, listed.stderr
    assert laptop.host.sessions() == before + 1


def _profile(laptop: Laptop) -> ClusterProfile:
    from orchestrator.config.profile.load import parse_profile

    return parse_profile((laptop.tmp / "profiles" / "cluster.yaml").read_text(), "cluster.yaml")


def _version() -> str:
    from orchestrator import __version__

    return __version__


API_SCRIPT = """
import json, orchestrator
job = orchestrator.submit(profile="cluster", script="job.py", args=["--lines", "2", "a b"], nodes=1,
                          procs_per_node=1, name="api job")
state = job.wait()
sweep = orchestrator.sweep(profile="cluster", script="job.py", args=["--lr", "{lr}"], grid={"lr": [0.1, 0.2]},
                           nodes=1, procs_per_node=1)
print(json.dumps({"job": job.job_id, "run_dir": str(job.run_dir), "state": state, "row": job.status(),
                  "logs": job.logs(node=0), "sweep": sweep.wait(), "tasks": sweep.status()["tasks"]}))
"""


def test_the_python_api_submits_and_follows_on_the_login_host(laptop: Laptop) -> None:
    """``orchestrator.submit``/``sweep`` with a login profile: jobs on the login host, followed to the end."""
    before = laptop.host.sessions()
    res = subprocess.run([sys.executable, "-c", API_SCRIPT], env=laptop.env, cwd=laptop.project,
                         capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["state"] == "COMPLETED" and out["row"]["name"] == "api job"
    assert Path(out["run_dir"]).is_relative_to(laptop.login_runs)
    assert out["logs"] == node_log(Path(out["run_dir"]))
    assert '["--lines", "2", "a b"]' in out["logs"]
    assert out["sweep"] == ["COMPLETED", "COMPLETED"]
    assert sorted(t["params"]["lr"] for t in out["tasks"]) == ["0.1", "0.2"]
    assert laptop.host.sessions() > before  # it went through the login host


def _probe_wheel(folder: Path) -> Path:
    """A tiny pure-Python wheel, written by hand (no build tool, no network)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "orch_probe-1.0-py3-none-any.whl"
    files = {
        "orch_probe.py": "VALUE = 7\n",
        "orch_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: orch-probe\nVersion: 1.0\n",
        "orch_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, "orch_probe-1.0.dist-info/RECORD"])
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in {**files, "orch_probe-1.0.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    return wheel


def test_remote_install_pushes_this_laptops_version(laptop: Laptop) -> None:
    """`remote install` puts this laptop's package into a venv on the login host, installs the wheels
    it is given without an index, and names the dependencies still missing there with the fix."""
    from tests.helpers.preconditions import require_debian_packages

    require_debian_packages("python3-venv")
    venv = laptop.tmp / "login-venv"
    login = {"host": "login-a", "ssh_config": str(laptop.host.ssh_config), "python": f"{venv}/bin/python"}
    write_profile(laptop.tmp / "profiles", "fresh", "local", login)
    _probe_wheel(laptop.tmp / "wheels")
    res = laptop.cli("remote", "install", "fresh", "--wheels", str(laptop.tmp / "wheels"), timeout=300)
    probe = "import orchestrator, orch_probe; print(orchestrator.__version__, orch_probe.VALUE)"
    there = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                           timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd="/")  # fmt: skip
    assert there.returncode == 0, there.stderr + res.stderr
    assert there.stdout.split() == [_version(), "7"]
    installed = (venv / "lib").glob("python3*/site-packages/orchestrator/remote/install.py")
    assert [p.read_text() for p in installed] == [
        (REPO / "orchestrator" / "remote" / "install.py").read_text()
    ]
    # The data an editable install keeps beside the package (job_templates/, cluster_profiles/) went too,
    # where the login host's orchestrator looks for it.
    probe = ("import importlib.util as u, json, pathlib; print(json.dumps({d: sorted(p.name for p in pathlib.Path("
             "next(iter(u.find_spec(f'orchestrator.{d}').submodule_search_locations))).iterdir()) for d in "
             "('job_templates', 'cluster_profiles')}))")  # fmt: skip
    shipped = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd="/")  # fmt: skip
    assert shipped.returncode == 0, shipped.stderr
    assert json.loads(shipped.stdout) == {
        d: sorted(p.name for p in (REPO / d).iterdir() if p.name != "__pycache__")
        for d in ("job_templates", "cluster_profiles")
    }
    # What does not import there (Debian's python3 lacks some of them) is named, with the fix.
    deps = ["jinja2", "psutil", "pydantic", "submitit", "yaml"]  # sorted, as install names them
    check = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if not importlib.util.find_spec(m)))"
    lacking = subprocess.run([str(venv / "bin" / "python"), "-c", check, *deps], capture_output=True, text=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd="/").stdout.split()  # fmt: skip
    if not lacking:
        assert res.returncode == 0 and "installed on login-a" in res.stdout, res.stdout + res.stderr
        return
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = res.stderr.splitlines()
    assert f"do not import there: {', '.join(lacking)};" in line
    assert (
        "pip download --dest wheels" in line and "orchestrator remote install fresh --wheels wheels" in line
    )


def test_every_word_is_quoted_for_the_login_hosts_shell(tmp_path: Path) -> None:
    """The line ssh hands over is split by a POSIX shell into exactly the words given (``~/`` alone
    is left to that shell to mean its home)."""
    write_profile(tmp_path, "q", "local", {"host": "h", "python": "~/venv dir/bin/python", "home": "~/o h"})
    profile = _load(tmp_path / "q.yaml")
    words = ["run", "--", "submit", "--name", HOSTILE_NAME, "--", "x y.py", *HOSTILE_ARGS, "", "~/literal"]
    line = agent_command(profile, words)
    prefix = '"$HOME"/' + shlex.quote("venv dir/bin/python") + " -m orchestrator.cli.login_agent "
    assert line.startswith(prefix)  # the interpreter's ~/ is the login host's home
    echo = "python3 -c " + shlex.quote("import json, sys; print(json.dumps(sys.argv[1:]))") + " "
    shown = subprocess.run(["sh", "-c", echo + line[len(prefix):]], capture_output=True, text=True, timeout=30,
                           env={"HOME": "/h", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert json.loads(shown.stdout) == [_version(), *words]


def test_the_book_keeps_the_newest_final_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.remote import book

    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path))
    monkeypatch.setattr(book, "MAX_FINAL_ROWS", 3)
    a = book.Target("a")
    book.remember(a, ["100"])
    assert book.profile_of("100_7") == a  # an array task belongs to its array's login host
    book.remember_final(a, [{"job_id": str(i), "state": "COMPLETED"} for i in range(5)])
    assert [book.final_row(str(i)) is not None for i in range(5)] == [False, False, True, True, True]
    assert book.profile_of("0") == a and book.profile_of("9") is None
    aside = book.Target("b", "/a folder/profiles")  # a profile from --profiles-dir: found there again
    book.remember(aside, ["200"])
    assert book.profile_of("200") == aside and book.profile_of("100") == a


def _load(path: Path) -> ClusterProfile:
    from orchestrator.config.profile.load import parse_profile

    return parse_profile(path.read_text(), path.name)
