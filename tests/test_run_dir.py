"""Run-directory reader: tail-only metrics, torn lines, ETA, checkpoint verification, local state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.job_states import JobState
from orchestrator.local_state import local_state
from orchestrator.run_dir import last_complete_checkpoint, write_cancel_marker
from orchestrator.run_summary import count_resumes, iter_lines_reversed, summarize


def train_event(step: int, t: float, max_steps: int = 100, **kw: Any) -> dict[str, Any]:
    ev = {
        "event": "train",
        "step": step,
        "max_steps": max_steps,
        "loss": 10.0 / step,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 1000.0 + step,
        "step_time_s": 0.5,
        "peak_mem_mb": 10.0,
        "world_size": 4,
        "strategy": "fsdp2",
        "time": t,
    }
    ev.update(kw)
    return ev


def write_metrics(run_dir: Path, events: list[dict[str, Any]], torn: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    with open(path, "a") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")
        fh.write(torn)
    return path


def make_checkpoint(
    run_dir: Path, step: int, files: dict[str, int], marker: bool = True, lie: int = 0
) -> Path:
    d = run_dir / "checkpoints" / f"step_{step:08d}"
    for rel, size in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(b"\0" * size)
    d.mkdir(parents=True, exist_ok=True)
    if marker:
        listed = {rel: size + lie for rel, size in files.items()}
        (d / "COMPLETE.json").write_text(
            json.dumps({"step": step, "world_size": 4, "strategy": "fsdp2", "files": listed})
        )
    return d


def test_summary_of_a_run(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    t0 = 1_700_000_000.0
    events: list[dict[str, Any]] = [train_event(s, t0 + 2.0 * s) for s in range(1, 31)]
    events.append({"event": "eval", "step": 30, "val_loss": 0.75, "time": t0 + 61})
    write_metrics(rd, events, torn='{"event": "train", "step": 31, "loss": 0.3')  # torn: ignored
    (rd / "job.json").write_text(
        json.dumps({"strategy": "fsdp2", "nodes": 2, "procs_per_node": 2, "max_steps": 100})
    )
    make_checkpoint(rd, 20, {"model/__0_0.distcp": 100, "optimizer/__0_0.distcp": 50})
    s = summarize(rd)
    assert s.step == 30 and s.max_steps == 100
    assert s.loss == pytest.approx(10.0 / 30)
    assert s.val_loss == 0.75 and s.val_step == 30
    assert s.tokens_per_s == 1030.0
    assert s.eta_s == pytest.approx(70 * 2.0)  # wall-clock slope: 2 s per step
    assert s.world_size == 4 and s.strategy == "fsdp2"
    assert s.checkpoint is not None and s.checkpoint.step == 20 and s.checkpoint.total_bytes == 150
    assert s.resumes == 0
    json.dumps(s.to_json())


def test_summary_of_empty_and_missing_dirs(tmp_path: Path) -> None:
    s = summarize(tmp_path / "nope")
    assert s.step is None and s.eta_s is None and s.checkpoint is None and s.resumes == 0
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"event": "tra')
    assert summarize(tmp_path / "r").step is None


def test_eta_uses_current_attempt_only(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    t0 = 1000.0
    events: list[dict[str, Any]] = [train_event(s, t0 + 1.0 * s) for s in range(1, 21)]
    # crash, requeue, an hour later resume from step 10 and run at 3 s/step
    events.append({"event": "resume", "step": 10, "checkpoint": "step_00000010", "time": t0 + 3600})
    events += [train_event(s, t0 + 3600 + 3.0 * (s - 10)) for s in range(11, 16)]
    write_metrics(rd, events)
    s = summarize(rd)
    assert s.step == 15 and s.resumes == 1
    assert s.eta_s == pytest.approx((100 - 15) * 3.0)


def test_eta_falls_back_to_step_time_and_max_steps_from_job_json(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    ev = train_event(5, 1.0, step_time_s=0.25)
    del ev["max_steps"]
    write_metrics(rd, [ev])
    (rd / "job.json").write_text(json.dumps({"max_steps": 45}))
    s = summarize(rd)
    assert s.max_steps == 45 and s.eta_s == pytest.approx(40 * 0.25)


def test_status_reads_only_the_tail_of_a_huge_file(tmp_path: Path) -> None:
    """60 MB of metrics whose head is not even JSON: summarize must not care (and must be fast)."""
    rd = tmp_path / "run"
    rd.mkdir()
    path = rd / "metrics.jsonl"
    with open(path, "wb") as fh:
        junk = (b"x" * 1023 + b"\n") * 1024  # 1 MiB of non-JSON lines
        for _ in range(60):
            fh.write(junk)
    write_metrics(rd, [train_event(s, float(s)) for s in range(1000, 1100)])
    assert path.stat().st_size > 60 * 1024 * 1024
    count_resumes(rd)  # the one whole-file pass (byte search, cached per inode) happens here
    t = time.perf_counter()
    for _ in range(20):
        s = summarize(rd)
    per_call = (time.perf_counter() - t) / 20
    assert s.step == 1099
    # Parsing 60 MB would take seconds; a 256 KB tail takes milliseconds.
    assert per_call < 0.05, per_call


def test_resume_count_is_incremental_and_exact(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    write_metrics(rd, [train_event(1, 1.0), {"event": "resume", "step": 0, "checkpoint": "a", "time": 2.0}])
    assert count_resumes(rd) == 1
    # a train line whose *text* mentions "resume" must not count
    write_metrics(rd, [train_event(2, 3.0, strategy="resume")], torn='{"event": "resume", "st')
    assert count_resumes(rd) == 1
    with open(rd / "metrics.jsonl", "a") as fh:
        fh.write('ep": 5, "checkpoint": "b", "time": 4.0}\n')
    assert count_resumes(rd) == 2
    write_metrics(rd, [{"event": "resume", "step": 9, "checkpoint": "c", "time": 5.0}])
    assert count_resumes(rd) == 3


def test_checkpoint_verification(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    make_checkpoint(rd, 10, {"a.bin": 10})
    make_checkpoint(rd, 20, {"a.bin": 10, "sub/b.bin": 5})
    make_checkpoint(rd, 30, {"a.bin": 10}, marker=False)  # interrupted: no marker
    make_checkpoint(rd, 40, {"a.bin": 10}, lie=1)  # marker lists a size the file does not have
    d50 = make_checkpoint(rd, 50, {"a.bin": 10, "gone.bin": 3})
    (d50 / "gone.bin").unlink()  # listed file missing
    tmp = rd / "checkpoints" / ".tmp_step_00000060"
    tmp.mkdir()
    (tmp / "COMPLETE.json").write_text(json.dumps({"step": 60, "files": {}}))
    ck = last_complete_checkpoint(rd)
    assert ck is not None and ck.step == 20 and ck.n_files == 2 and ck.path.name == "step_00000020"


def test_checkpoint_marker_cannot_point_outside(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    (tmp_path / "outside.bin").write_bytes(b"1234")
    d = rd / "checkpoints" / "step_00000001"
    d.mkdir(parents=True)
    (d / "COMPLETE.json").write_text(json.dumps({"step": 1, "files": {"../../../outside.bin": 4}}))
    assert last_complete_checkpoint(rd) is None


# ---------------------------------------------------------------- local job state
def _spawn_group_leader() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_local_state_lifecycle(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    rd.mkdir()
    assert local_state(rd).state is JobState.PENDING
    proc = _spawn_group_leader()
    try:
        (rd / "local_pids.json").write_text(json.dumps({"0": proc.pid}))
        ls = local_state(rd)
        assert ls.state is JobState.RUNNING and ls.alive_pids == (proc.pid,)
    finally:
        proc.kill()
        proc.wait(30)
    # dead and nothing recorded: FAILED; with node exit files: from their codes
    assert local_state(rd).state is JobState.FAILED
    (rd / "job.json").write_text(json.dumps({"nodes": 2}))
    att = rd / "logs" / "attempt_0"
    att.mkdir(parents=True)
    (att / "node_0.exit").write_text("0")
    assert local_state(rd).state is JobState.FAILED  # node 1 has not reported
    (att / "node_1.exit").write_text("0\n")
    assert local_state(rd).state is JobState.COMPLETED
    (att / "node_1.exit").write_text("137")
    ls = local_state(rd)
    assert ls.state is JobState.FAILED and ls.exit_code == 137 and "node 1" in (ls.reason or "")
    write_cancel_marker(rd, "SIGTERM", "tester")
    assert local_state(rd).state is JobState.CANCELLED
    (rd / "local_state.json").write_text(
        json.dumps({"state": "OUT_OF_MEMORY", "exit_code": 9, "reason": "oom"})
    )
    ls = local_state(rd)
    assert (ls.state, ls.exit_code, ls.reason) == (JobState.OUT_OF_MEMORY, 9, "oom")


def test_recycled_pid_does_not_look_alive(tmp_path: Path) -> None:
    """A pid file older than the process now holding that pid means the job's process is gone."""
    rd = tmp_path / "run"
    rd.mkdir()
    pids = rd / "local_pids.json"
    pids.write_text(json.dumps({"0": os.getpid()}))
    import psutil

    old = psutil.Process().create_time() - 3600
    os.utime(pids, (old, old))  # the file predates the process that now has this pid
    assert local_state(rd).state is JobState.FAILED
    os.utime(pids, None)
    assert local_state(rd).state is JobState.RUNNING


@settings(max_examples=80, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")), max_size=40),
    torn=st.binary(max_size=10).map(lambda b: b.replace(b"\n", b"")),
    chunk=st.integers(min_value=1, max_value=50),
    window=st.integers(min_value=1, max_value=2000),
)
def test_iter_lines_reversed_matches_naive(
    tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], torn: bytes, chunk: int, window: int
) -> None:
    path = tmp_path_factory.mktemp("rev") / "m.jsonl"
    data = b"".join(ln + b"\n" for ln in lines) + torn
    path.write_bytes(data)
    got = list(iter_lines_reversed(path, window, chunk=chunk))
    # naive: in the last `window` bytes, drop the (possibly cut) first line unless the window starts
    # the file, drop the torn tail, and what is left are whole lines
    start = max(0, len(data) - window)
    body = data[start:]
    if start > 0:
        nl = body.find(b"\n")
        body = body[nl + 1 :] if nl >= 0 else b""
    expected = body.split(b"\n")[:-1]
    assert got == list(reversed(expected))
