"""Batched scheduler queries through real subprocesses; fallbacks; ``status`` and ``cancel`` commands.

Every answer Slurm gives on a success path comes from the real cluster
(tests/cluster/test_scheduler_query.py). Here, a fake binary first on PATH is only a fault injection,
named as such (``inject_fault``): a hung squeue/sacct, accounting that is disabled; a missing binary
is an empty PATH. The counting wrappers of the 1,000-job test are no fake: they log the call and exec
the real Slurm client (Debian's slurm-client) when it exists; without a running controller it fails
like it would on a broken cluster, which exercises the squeue -> sacct -> registry fallback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry, SchedulerKind
from orchestrator.schedulers.query import run_bounded
from orchestrator.schedulers.slurm.query import parse_sacct, parse_squeue, query_states
from tests.helpers.cli import REPO, poll, run_cli

REAL_SQUEUE = shutil.which("squeue")
REAL_SACCT = shutil.which("sacct")


def inject_fault(bin_dir: Path, name: str, body: str) -> Path:
    """A fault injection: an executable ``name`` in ``bin_dir`` (put first on PATH) that misbehaves as
    the bash ``body`` says (hangs, or fails the way a misconfigured cluster does)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_hung_binary(bin_dir: Path, name: str, sessions: Path, hang: str) -> Path:
    """Fault: ``name`` logs its session id to ``sessions``, then hangs as ``hang`` says (a controller
    that never answers)."""
    return inject_fault(bin_dir, name, f"echo {name} $$ >> {sessions}\n" + hang)


def fake_sacct_without_accounting(bin_dir: Path) -> Path:
    """Fault: sacct on a cluster without accounting storage (exit 1, Slurm's own words)."""
    return inject_fault(
        bin_dir, "sacct", "echo 'sacct: error: Slurm accounting storage is disabled' >&2; exit 1\n"
    )


def counting_wrappers(bin_dir: Path, counter: Path) -> None:
    """squeue/sacct that log each call (with its argument count) then run the real binary."""
    for name, real in (("squeue", REAL_SQUEUE), ("sacct", REAL_SACCT)):
        tail = (
            f'exec {real} "$@"\n'
            if real
            else f'echo "{name}: error: Unable to contact slurm controller" >&2\nexit 1\n'
        )
        bin_dir.mkdir(parents=True, exist_ok=True)
        wrapper = bin_dir / name
        wrapper.write_text(f'#!/bin/bash\necho "{name} $#" >> {counter}\n' + tail)
        wrapper.chmod(0o755)


@pytest.fixture
def fault_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A folder first on PATH for :func:`inject_fault`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def _add_jobs(
    home: Path, ids: list[str], scheduler: SchedulerKind = "slurm", run_root: Path | None = None
) -> None:
    with Registry.open(home) as reg:
        for i, job_id in enumerate(ids):
            reg.add_job(
                job_id=job_id,
                name=f"job{i}",
                profile="slurm_test",
                scheduler=scheduler,
                strategy="fsdp2",
                nodes=2,
                procs_per_node=2,
                command=["python", "t.py"],
                run_dir=(run_root or home / "runs") / job_id,
                state=JobState.RUNNING,
            )


# ---------------------------------------------------------------- parsing
def test_parse_squeue() -> None:
    out = "101|RUNNING|None|n[1-2]|2025-01-01T10:00:00|1:02:03\n102|PENDING|Resources|||0:00\n\n103|COMPLETING|None|n1|x|5:00\n"
    got = parse_squeue(out)
    assert (
        got["101"].state is JobState.RUNNING
        and got["101"].node_list == "n[1-2]"
        and got["101"].reason is None
    )
    assert (
        got["102"].state is JobState.PENDING
        and got["102"].reason == "Resources"
        and got["102"].node_list is None
    )
    assert got["103"].state is JobState.RUNNING and got["103"].raw_state == "COMPLETING"
    assert all(s.source == "squeue" and not s.stale for s in got.values())


def test_parse_sacct() -> None:
    out = (
        "201|COMPLETED|0:0|None|n1|2025-01-01T10:00:00|2025-01-01T11:00:00|01:00:00\n"
        "202|CANCELLED by 0|0:15|None|n[1-2]|s|e|00:00:05\n"
        "203|OUT_OF_MEMORY|0:125|None|n2|s|e|00:01:00\n"
        "203.batch|OUT_OF_MEMORY|0:125||n2|s|e|00:01:00\n"
        "204|PENDING|0:0|BeginTime|None assigned|Unknown|Unknown|00:00:00\n"
    )
    got = parse_sacct(out)
    assert set(got) == {"201", "202", "203", "204"}
    assert (
        got["201"].state is JobState.COMPLETED
        and got["201"].exit_code == "0:0"
        and got["201"].elapsed == "01:00:00"
    )
    assert got["202"].state is JobState.CANCELLED and got["202"].raw_state == "CANCELLED by 0"
    assert got["203"].state is JobState.OUT_OF_MEMORY and got["203"].exit_code == "0:125"
    assert got["204"].node_list is None and got["204"].start is None and got["204"].reason == "BeginTime"


# ---------------------------------------------------------------- one batched query for 1,000 jobs
def test_status_of_1000_jobs_makes_exactly_one_scheduler_query(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    home = Path(orch_env["ORCHESTRATOR_HOME"])
    ids = [str(9_000_000 + i) for i in range(1000)]  # ids no real test cluster will have
    _add_jobs(home, ids)
    counter = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    counting_wrappers(bin_dir, counter)
    env = dict(orch_env, PATH=f"{bin_dir}{os.pathsep}{orch_env['PATH']}")
    t = time.monotonic()
    res = run_cli(["status", "--json", "--timeout", "5"], env, timeout=60)
    elapsed = time.monotonic() - t
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    calls = counter.read_text().splitlines()
    assert [c.split()[0] for c in calls].count("squeue") == 1
    assert [c.split()[0] for c in calls].count("sacct") <= 1
    assert len(calls) <= 2
    # the single squeue call carried all 1,000 ids: -h -j <ids> -o <fmt> = 5 arguments
    assert calls[0] == "squeue 5"
    assert len(data["jobs"]) == 1000 and data["scheduler_calls"]["squeue"] == 1
    # nobody (no cluster, or a cluster without these ids) can answer: last known state, marked stale
    assert data["stale"] is True and data["source"] == "registry"
    assert {j["state"] for j in data["jobs"]} == {"RUNNING"} and all(j["stale"] for j in data["jobs"])
    assert elapsed < 30


# ---------------------------------------------------------------- fallbacks through real subprocesses
def test_missing_binaries_fall_back_to_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    res = query_states(["1", "2"], fallback={"1": JobState.PENDING})
    assert res.stale and res.source == "registry"
    assert res.states["1"].state is JobState.PENDING and res.states["2"].state is JobState.UNKNOWN
    assert any("squeue not found" in e for e in res.errors) and any(
        "sacct not found" in e for e in res.errors
    )


@pytest.mark.parametrize(
    "hang",
    [
        "exec sleep 30\n",
        # a grandchild keeps stdout open after the child is gone: must not hang us either
        "sleep 30 &\nsleep 30\n",
    ],
    ids=["fake_hung_squeue_and_sacct", "fake_hung_with_a_grandchild"],
)
def test_hung_scheduler_is_bounded(fault_path: Path, tmp_path: Path, hang: str) -> None:
    """Both commands are cut off at their own timeout, in order, and nothing they started is left:
    proven by the outcome (each one's whole session gone), not by a wall-clock figure a loaded
    machine can miss."""
    sessions = tmp_path / "sessions"
    fake_hung_binary(fault_path, "squeue", sessions, hang)
    fake_hung_binary(fault_path, "sacct", sessions, hang)
    box: list[Any] = []
    worker = threading.Thread(
        target=lambda: box.append(query_states(["1", "2"], timeout_s=1.0, fallback={"1": JobState.RUNNING})),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=120)  # a bound for the test only: a hang fails here instead of at pytest's timeout
    assert not worker.is_alive() and box, "query_states did not return"
    res = box[0]
    assert res.stale and res.states["1"].state is JobState.RUNNING
    # squeue first, cut off at its share; then sacct with what is left of the budget (none left is
    # a right answer too on a loaded machine: the bound is the whole call's)
    assert res.errors[0].startswith("squeue timed out"), res.errors
    assert res.errors[1].startswith("sacct timed out") or res.errors[1] == "no time left for sacct", (
        res.errors
    )
    started = [line.split() for line in sessions.read_text().splitlines()]
    assert [name for name, _ in started] == ["squeue", "sacct"][: len(started)] and started, started
    for name, sid in started:
        # killed, not waited on by init yet: zombies; a survivor would sleep on for 30 s
        poll(lambda sid=int(sid): not _live_in_session(sid), 10, f"{name}'s processes to be gone")


def _live_in_session(sid: int) -> list[int]:
    live = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return live


def test_run_bounded_reports_instead_of_raising(tmp_path: Path) -> None:
    assert run_bounded([str(tmp_path / "no-such-binary")], 1.0).error is not None
    r = run_bounded([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], 10.0)
    assert r.returncode == 3 and r.stdout == "out\n" and r.error is not None and "exited 3" in r.error


# ---------------------------------------------------------------- `orchestrator status`
def test_status_says_why_when_accounting_is_disabled(orch_env: dict[str, str], tmp_path: Path) -> None:
    """Fault injection: a cluster without accounting (sacct exits 1, "accounting storage is
    disabled"). A job squeue does not answer for (the real squeue: an id it does not know, or no
    controller at all) keeps its last known state, marked stale, and the error reaches stderr."""
    _add_jobs(Path(orch_env["ORCHESTRATOR_HOME"]), ["9999998"])  # an id no test cluster reaches
    bin_dir = tmp_path / "bin"
    fake_sacct_without_accounting(bin_dir)
    env = dict(orch_env, PATH=f"{bin_dir}{os.pathsep}{orch_env['PATH']}")
    res = run_cli(["status"], env, timeout=60)
    assert res.returncode == 0, res.stderr
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("9999998 "))
    assert "RUNNING (stale)" in row, res.stdout
    assert "accounting storage is disabled" in res.stderr, res.stderr


def test_status_unknown_job_exit_2(orch_env: dict[str, str]) -> None:
    res = run_cli(["status", "nope"], orch_env, timeout=60)
    assert res.returncode == 2 and "unknown job id 'nope'" in res.stderr and "Traceback" not in res.stderr


def test_status_imports_neither_torch_nor_accelerate(orch_env: dict[str, str], tmp_path: Path) -> None:
    _add_jobs(Path(orch_env["ORCHESTRATOR_HOME"]), ["41"])
    # The status must have run to its end (exit 0, the job listed): a status that fails early imports
    # nothing heavy either.
    code = (
        "import sys, runpy; sys.argv=['orchestrator','status','--json','--timeout','2'];"
        "\ncode = 0\ntry:\n    runpy.run_module('orchestrator', run_name='__main__')\n"
        "except SystemExit as exc:\n    code = exc.code\n"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('torch','accelerate')]\n"
        "print('EXIT', code, 'HEAVY', bad, file=sys.stderr)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=orch_env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert "EXIT 0 HEAVY []" in res.stderr or "EXIT None HEAVY []" in res.stderr, res.stderr
    assert [row["job_id"] for row in json.loads(res.stdout)["jobs"]] == ["41"], res.stdout


# ---------------------------------------------------------------- `orchestrator cancel`
def test_cancel_bad_signal_exit_2(orch_env: dict[str, str]) -> None:
    _add_jobs(Path(orch_env["ORCHESTRATOR_HOME"]), ["52"])
    res = run_cli(["cancel", "52", "--signal", "NOPE"], orch_env, timeout=60)
    assert res.returncode == 2 and "--signal" in res.stderr


def test_cancel_local_kills_process_group(orch_env: dict[str, str], tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _add_jobs(Path(orch_env["ORCHESTRATOR_HOME"]), ["local-3"], scheduler="local", run_root=runs)
    rd = runs / "local-3"
    rd.mkdir(parents=True)
    # a node process with a child in the same group, like a launcher and its worker
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(120)']); time.sleep(120)",
        ],
        start_new_session=True,
    )
    try:
        (rd / "local_pids.json").write_text(json.dumps({"0": leader.pid}))
        st = run_cli(["status", "--json", "local-3"], orch_env, timeout=60)
        assert json.loads(st.stdout)["jobs"][0]["state"] == "RUNNING"
        res = run_cli(["cancel", "local-3"], orch_env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert leader.wait(timeout=30) == -signal.SIGTERM
        st = run_cli(["status", "--json", "local-3"], orch_env, timeout=60)
        assert json.loads(st.stdout)["jobs"][0]["state"] == "CANCELLED"
        again = run_cli(["cancel", "local-3"], orch_env, timeout=60)
        assert again.returncode == 2 and "already ended" in again.stderr  # issue 17: rc 2
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=30)


def test_status_watch_ends_when_all_jobs_are_terminal(orch_env: dict[str, str], tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _add_jobs(Path(orch_env["ORCHESTRATOR_HOME"]), ["local-8"], scheduler="local", run_root=runs)
    (runs / "local-8").mkdir(parents=True)
    (runs / "local-8" / "local_state.json").write_text(json.dumps({"state": "TIMEOUT"}))
    res = run_cli(["status", "--watch", "--interval", "0.1", "--json", "local-8"], orch_env, timeout=60)
    assert res.returncode == 1, res.stderr  # --watch ends with the outcome: TIMEOUT is not success
    snapshots = [json.loads(ln) for ln in res.stdout.splitlines()]
    assert len(snapshots) == 1 and snapshots[0]["jobs"][0]["state"] == "TIMEOUT"
    bad = run_cli(["status", "--interval", "0"], orch_env, timeout=60)
    assert bad.returncode == 2 and "--interval" in bad.stderr


def test_status_with_no_jobs(orch_env: dict[str, str]) -> None:
    res = run_cli(["status"], orch_env, timeout=60)
    assert res.returncode == 0 and "no active or recent jobs" in res.stdout


SUPERVISOR = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
def forward(signum, frame):
    child.send_signal(signum)
    child.wait(10)
    sys.exit(0)
signal.signal(signal.SIGTERM, forward)
child.wait()
time.sleep(120)
"""
NODE = """
import signal, sys, time
def on_usr1(signum, frame):
    open(sys.argv[1], "w").write("usr1")
    sys.exit(0)
signal.signal(signal.SIGUSR1, on_usr1)
print("ready", flush=True)  # handler installed: the test may signal now
time.sleep(120)
"""


def test_cancel_local_signal_to_a_supervisor_reaches_its_children(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """A recorded pid that is not a group leader (submitit's controller): USR1 must go to its
    children, not kill the supervisor; plain cancel sends TERM to the supervisor, which forwards it."""
    runs = tmp_path / "runs"
    _add_jobs(Path(orch_env["ORCHESTRATOR_HOME"]), ["local-4"], scheduler="local", run_root=runs)
    rd = runs / "local-4"
    rd.mkdir(parents=True)
    flag = tmp_path / "usr1.flag"
    sup = subprocess.Popen(  # same process group as pytest: not a group leader
        [sys.executable, "-c", SUPERVISOR, NODE, str(flag)], stdout=subprocess.PIPE, text=True
    )
    try:
        import psutil

        assert sup.stdout is not None and sup.stdout.readline() == "ready\n"
        (node,) = psutil.Process(sup.pid).children()
        (rd / "local_pids.json").write_text(json.dumps({"controller": sup.pid}))
        res = run_cli(["cancel", "local-4", "--signal", "USR1"], orch_env, timeout=60)
        assert res.returncode == 0, res.stderr
        node.wait(timeout=30)
        assert flag.read_text() == "usr1"
        assert sup.poll() is None  # the supervisor survived the USR1
        assert not (rd / "cancel_requested.json").exists()  # a signal is not a cancel
        res = run_cli(["cancel", "local-4"], orch_env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert sup.wait(timeout=30) == 0  # its TERM handler ran and exited cleanly
        assert (rd / "cancel_requested.json").exists()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(30)


def test_parsed_states_are_complete_scheduler_states() -> None:
    """parse_squeue builds states without SchedulerState's __init__ (speed): same fields, same values."""
    from orchestrator.schedulers.query import SchedulerState

    got = parse_squeue("7|COMPLETING|None|n[1-2]|2025-01-01T00:00:00|1:00\n")["7"]
    want = SchedulerState(
        job_id="7",
        state=JobState.RUNNING,
        raw_state="COMPLETING",
        source="squeue",
        node_list="n[1-2]",
        start="2025-01-01T00:00:00",
        elapsed="1:00",
    )
    assert got == want and vars(got) == vars(want)
