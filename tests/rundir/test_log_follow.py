"""Log following by offset: complete lines only, new attempts/files, tail, rank filter, ``logs`` CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry
from orchestrator.rundir.log_follow import LogFollower, LogLine
from tests.helpers.cli import run_cli


def log_path(run_dir: Path, attempt: int, node: int) -> Path:
    p = run_dir / "logs" / f"attempt_{attempt}" / f"node_{node}.log"
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


def texts(lines: list[LogLine]) -> list[str]:
    return [ln.text for ln in lines]


def test_only_complete_lines_and_never_twice(tmp_path: Path) -> None:
    p = log_path(tmp_path, 0, 0)
    append(p, "one\ntw")
    f = LogFollower(tmp_path)
    assert texts(f.poll()) == ["one"]
    assert f.poll() == []
    append(p, "o\nthree\n")
    assert texts(f.poll()) == ["two", "three"]
    assert f.poll() == []
    append(p, "partial at end")
    assert f.poll() == []
    assert texts(f.poll(final=True)) == ["partial at end"]


def test_new_files_and_new_attempts_are_picked_up(tmp_path: Path) -> None:
    append(log_path(tmp_path, 0, 0), "a0n0\n")
    f = LogFollower(tmp_path)  # newest attempt is 0
    assert [(ln.attempt, ln.node, ln.text) for ln in f.poll()] == [(0, 0, "a0n0")]
    append(log_path(tmp_path, 0, 1), "a0n1\n")  # node 1 started late
    append(log_path(tmp_path, 1, 0), "a1n0\n")  # requeued
    assert [(ln.attempt, ln.node, ln.text) for ln in f.poll()] == [(0, 1, "a0n1"), (1, 0, "a1n0")]


def test_default_starts_at_newest_attempt(tmp_path: Path) -> None:
    append(log_path(tmp_path, 0, 0), "old\n")
    append(log_path(tmp_path, 10, 0), "ten\n")
    append(log_path(tmp_path, 9, 0), "nine\n")
    assert texts(LogFollower(tmp_path).poll()) == ["ten"]  # 10 > 9 numerically
    assert texts(LogFollower(tmp_path, attempt=0).poll()) == ["old"]


def test_node_and_rank_selection(tmp_path: Path) -> None:
    for node in (0, 1):
        append(
            log_path(tmp_path, 0, node),
            "".join(f"[default{r}]:n{node} r{r}\n" for r in (0, 1)) + f"launcher n{node}\n",
        )
    assert texts(LogFollower(tmp_path, node=1).poll()) == [
        "[default0]:n1 r0",
        "[default1]:n1 r1",
        "launcher n1",
    ]
    # global rank 3 = node 1, local rank 1 with 2 processes per node
    assert texts(LogFollower(tmp_path, rank=3, procs_per_node=2).poll()) == [
        "[default1]:n1 r1",
        "launcher n1",
    ]
    with pytest.raises(ValueError, match="rank 3 runs on node 1"):
        LogFollower(tmp_path, rank=3, node=0, procs_per_node=2)


def test_tail_then_follow_without_gaps_or_duplicates(tmp_path: Path) -> None:
    p = log_path(tmp_path, 0, 0)
    append(p, "".join(f"line {i}\n" for i in range(1000)) + "torn")
    f = LogFollower(tmp_path)
    assert texts(f.tail(3)) == ["line 997", "line 998", "line 999"]
    append(p, " now whole\nnext\n")
    assert texts(f.poll()) == ["torn now whole", "next"]
    assert texts(LogFollower(tmp_path).tail(0)) == []


def test_tail_reads_from_the_end(tmp_path: Path) -> None:
    p = log_path(tmp_path, 0, 0)
    with open(p, "wb") as fh:  # 40 MB of one endless line, then 5 normal lines
        fh.write(b"z" * (40 << 20) + b"\n")
        fh.write(b"".join(b"L%d\n" % i for i in range(5)))
    f = LogFollower(tmp_path)
    assert texts(f.tail(2)) == ["L3", "L4"]


def test_truncated_file_starts_over(tmp_path: Path) -> None:
    p = log_path(tmp_path, 0, 0)
    append(p, "aaaa\nbbbb\n")
    f = LogFollower(tmp_path)
    assert len(f.poll()) == 2
    p.write_text("new\n")
    assert texts(f.poll()) == ["new"]


def test_follow_until_done(tmp_path: Path) -> None:
    p = log_path(tmp_path, 0, 0)
    append(p, "start\n")
    checks = {"n": 0}
    slept: list[float] = []

    def is_done() -> bool:
        checks["n"] += 1
        if checks["n"] == 1:
            append(p, "middle\n")
            return False
        if checks["n"] == 2:
            append(log_path(tmp_path, 1, 0), "after requeue\nlast words without newline")
            return False
        return True

    f = LogFollower(tmp_path)
    out = list(f.follow(is_done, interval=0.01, max_interval=0.05, done_check_s=0.0, sleep=slept.append))
    assert texts(out) == ["start", "middle", "after requeue", "last words without newline"]
    assert checks["n"] == 3
    assert slept and max(slept) <= 0.05  # bounded poll interval


@settings(max_examples=40, deadline=None)
@given(
    lines=st.lists(st.text(alphabet="abcxyz é[]0123456789:", max_size=20), min_size=1, max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_any_write_chunking_yields_each_line_once(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], cuts: list[int]
) -> None:
    run = tmp_path_factory.mktemp("run")
    p = log_path(run, 0, 0)
    data = "".join(ln + "\n" for ln in lines).encode()
    bounds = sorted({0, len(data), *[c for c in cuts if c < len(data)]})
    f = LogFollower(run)
    got: list[str] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        with open(p, "ab") as fh:
            fh.write(data[a:b])
        got += texts(f.poll())
    got += texts(f.poll(final=True))
    # splitting bytes mid-character only delays a line, never changes it
    assert got == lines


# ---------------------------------------------------------------- `orchestrator logs`
def _job(orch_env: dict[str, str], run_dir: Path, job_id: str = "local-1", nodes: int = 2) -> None:
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        reg.add_job(
            job_id=job_id,
            name="t",
            profile="local",
            scheduler="local",
            strategy="ddp",
            nodes=nodes,
            procs_per_node=2,
            command=["python"],
            run_dir=run_dir,
            state=JobState.RUNNING,
        )


def test_logs_cli(orch_env: dict[str, str], tmp_path: Path) -> None:
    rd = tmp_path / "runs" / "local-1"
    for node in (0, 1):
        append(
            log_path(rd, 0, node),
            "".join(f"[default{r}]:n{node} step {i}\n" for i in range(3) for r in (0, 1)),
        )
    _job(orch_env, rd)
    res = run_cli(["logs", "local-1", "--node", "1", "--tail", "2"], orch_env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["[default0]:n1 step 2", "[default1]:n1 step 2"]
    res = run_cli(["logs", "local-1", "--rank", "2"], orch_env, timeout=60)
    assert res.stdout.splitlines() == [f"[default0]:n1 step {i}" for i in range(3)]
    res = run_cli(["logs", "local-1", "--tail", "1"], orch_env, timeout=60)
    assert res.stdout.splitlines() == ["[a0 n0] [default1]:n0 step 2", "[a0 n1] [default1]:n1 step 2"]


@pytest.mark.parametrize("args", [["--node", "2"], ["--rank", "4"], ["--attempt", "-1"], ["--tail", "-3"]])
def test_logs_cli_bad_selection_exit_2(orch_env: dict[str, str], tmp_path: Path, args: list[str]) -> None:
    _job(orch_env, tmp_path / "r")
    res = run_cli(["logs", "local-1", *args], orch_env, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_logs_follow_stops_when_job_is_terminal(orch_env: dict[str, str], tmp_path: Path) -> None:
    rd = tmp_path / "runs" / "local-1"
    append(log_path(rd, 0, 0), "".join(f"l{i}\n" for i in range(20)) + "no newline at the end")
    (rd / "local_state.json").write_text(json.dumps({"state": "COMPLETED", "exit_code": 0}))
    _job(orch_env, rd, nodes=1)
    res = run_cli(["logs", "local-1", "-f", "--tail", "3"], orch_env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["l17", "l18", "l19", "no newline at the end"]
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        assert reg.get("local-1").last_state is JobState.COMPLETED


def test_follow_job_until_done_returns_final_state(orch_env: dict[str, str], tmp_path: Path) -> None:
    import io

    from orchestrator.runner.logs import follow_job_until_done

    rd = tmp_path / "runs" / "local-1"
    append(log_path(rd, 0, 0), "hello\n")
    (rd / "local_state.json").write_text(json.dumps({"state": "FAILED", "exit_code": 1}))
    _job(orch_env, rd, nodes=1)
    out = io.StringIO()
    assert os.environ["ORCHESTRATOR_HOME"] == orch_env["ORCHESTRATOR_HOME"]
    state = follow_job_until_done("local-1", out=out, tail=None, interval=0.01)
    assert state is JobState.FAILED
    assert out.getvalue() == "hello\n"


def test_a_second_follower_continues_at_each_files_offsets(tmp_path: Path) -> None:
    """What a laptop's `logs -f` resumes from after a dropped connection (core.logs.Resume): the
    tail's window starts, then each printed line's end offset. A second follower started there
    prints exactly the lines the first had not, in each file, though more were written meanwhile
    and its own tail would have begun elsewhere."""
    from orchestrator.runner.logs import Resume

    for n in (0, 1):
        append(log_path(tmp_path, 0, n), "".join(f"n{n} line {i}\n" for i in range(30)))
    first = LogFollower(tmp_path)
    shown = first.tail(10)
    state = Resume(
        {"m": first.min_attempt, "c": {f"{a}.{n}": list(at) for (a, n), at in first.window_starts.items()}}
    )
    printed = shown[:3] + shown[10:13]  # 3 lines of each file reached the reader before the drop
    for line in printed:
        state.take({"t": line.text, "k": f"{line.attempt}.{line.node}", "e": line.end})
    for n in (0, 1):
        append(log_path(tmp_path, 0, n), "".join(f"n{n} line {i}\n" for i in range(30, 35)))
    second = LogFollower(tmp_path)
    second.start_at(state.min_attempt, state.offsets())
    rest = second.poll()
    for n in (0, 1):
        got = [t for t in texts(printed) + texts(rest) if t.startswith(f"n{n} ")]
        assert got == [f"n{n} line {i}" for i in range(20, 35)]


# ---------------------------------------------------------------- symlinks out of the run (issue 41)
SECRET = "secret line from outside the run"


def link_out_of_run(rd: Path, outside: Path, kind: str) -> Path:
    """The run's one node log (attempt 0, node 0) reached through a symlink of ``kind``; returns the
    link. ``outside`` is a folder next to the run holding a log of someone else's."""
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "node_0.log").write_text(SECRET + "\n")
    attempt = rd / "logs" / "attempt_0"
    if kind == "file":  # node_0.log -> a file outside
        attempt.mkdir(parents=True)
        link, target = attempt / "node_0.log", outside / "node_0.log"
    elif kind == "attempt folder":  # attempt_0 -> a folder outside
        (rd / "logs").mkdir(parents=True)
        link, target = attempt, outside
    elif kind == "logs folder":  # logs -> a folder outside (holding attempt_0/node_0.log)
        rd.mkdir(parents=True)
        (outside / "attempt_0").mkdir()
        (outside / "node_0.log").rename(outside / "attempt_0" / "node_0.log")
        link, target = rd / "logs", outside
    elif kind == "dangling":  # node_0.log -> a file outside that does not exist yet
        attempt.mkdir(parents=True)
        link, target = attempt / "node_0.log", outside / "later.log"
    else:
        raise AssertionError(kind)
    link.symlink_to(target)
    return link


LINK_KINDS = ["file", "attempt folder", "logs folder", "dangling"]


@pytest.mark.parametrize("kind", LINK_KINDS)
def test_the_follower_reads_nothing_through_a_symlink_out_of_the_run(tmp_path: Path, kind: str) -> None:
    rd = tmp_path / "run"
    link = link_out_of_run(rd, tmp_path / "elsewhere", kind)
    for follower_read in (lambda f: f.tail(10), lambda f: f.poll(final=True)):
        follower = LogFollower(rd)
        assert follower_read(follower) == [] and follower.sources() == []
        assert list(follower.refused) == [link]
    if kind == "dangling":  # its target appears later: still not read
        (tmp_path / "elsewhere" / "later.log").write_text(SECRET + "\n")
        follower = LogFollower(rd)
        assert follower.poll(final=True) == [] and list(follower.refused) == [link]


def test_a_symlink_that_stays_inside_the_run_is_followed(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    append(log_path(rd, 0, 0), "attempt 0\n")
    (rd / "logs" / "attempt_1").mkdir()
    (rd / "logs" / "attempt_1" / "node_0.log").symlink_to(rd / "logs" / "attempt_0" / "node_0.log")
    follower = LogFollower(rd, attempt=1)
    assert texts(follower.poll()) == ["attempt 0"] and not follower.refused


@pytest.mark.parametrize("follow", [False, True], ids=["print", "follow"])
@pytest.mark.parametrize("kind", LINK_KINDS)
def test_logs_cli_refuses_a_symlink_out_of_the_run(
    orch_env: dict[str, str], tmp_path: Path, kind: str, follow: bool
) -> None:
    rd = tmp_path / "runs" / "local-1"
    link = link_out_of_run(rd, tmp_path / "elsewhere", kind)
    if kind == "dangling":
        (tmp_path / "elsewhere" / "later.log").write_text(SECRET + "\n")  # dangling no more
    (rd / "local_state.json").write_text(json.dumps({"state": "COMPLETED", "exit_code": 0}))
    _job(orch_env, rd, nodes=1)
    res = run_cli(["logs", "local-1", *(["-f"] if follow else [])], orch_env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert SECRET not in res.stdout + res.stderr and "Traceback" not in res.stderr
    assert f"skipped {link}: a symlink that leads out of the run directory (not read)" in res.stderr


def test_logs_cli_refuses_a_scheduler_log_that_links_out_of_the_run(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """No node logged: the scheduler's own files are shown instead, but not one that links out."""
    rd = tmp_path / "runs" / "local-1"
    (rd / "submitit").mkdir(parents=True)
    (tmp_path / "elsewhere.txt").write_text(SECRET + "\n")
    link = rd / "submitit" / "local-1_0_log.err"
    link.symlink_to(tmp_path / "elsewhere.txt")
    (rd / "submitit" / "local-1_0_log.out").write_text("the scheduler's own line\n")
    (rd / "local_state.json").write_text(json.dumps({"state": "FAILED", "exit_code": 1}))
    _job(orch_env, rd, nodes=1)
    res = run_cli(["logs", "local-1"], orch_env, timeout=60)
    assert SECRET not in res.stdout + res.stderr
    assert "the scheduler's own line" in res.stdout
    assert f"skipped {link}: a symlink that leads out of the run directory (not read)" in res.stderr
