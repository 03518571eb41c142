"""What `status` reads from a run directory: tail-only metrics, torn lines, ETA, resume counting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.rundir.summary import TAIL_BYTES_CAP, count_resumes, iter_lines_reversed, summarize
from tests.helpers.run_dirs import make_checkpoint, train_event, write_metrics


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


def test_status_reads_only_the_tail_of_a_huge_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
    read: list[int] = []
    real_open = open

    def counting_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        fh = real_open(file, mode, *args, **kwargs)  # type: ignore[call-overload]
        if str(file).endswith("metrics.jsonl"):
            real_read = fh.read

            def read_and_count(n: int = -1) -> bytes:
                data = real_read(n)
                read.append(len(data))
                return data

            fh.read = read_and_count
        return fh

    import builtins

    monkeypatch.setattr(builtins, "open", counting_open)  # counts bytes read; reads for real
    s = summarize(rd)
    monkeypatch.undo()
    assert s.step == 1099
    # The work is what was read, not how long it took (timings live in bench/): a tail, not 60 MB.
    assert 0 < sum(read) <= TAIL_BYTES_CAP, sum(read)


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


@pytest.mark.parametrize(
    "budget, profile, spent",
    [
        ("1cpu-h", {"gpus_per_node": 0}, 0.75),  # 0.5 h x 1 CPU + 0.25 h x 1 CPU
        ("10usd", {"gpus_per_node": 0, "price_per_cpu_hour": 2.0}, 1.5),
        ("10gpu-h", {"gpus_per_node": 8, "price_per_gpu_hour": 3.0}, 0.75),
    ],
)
def test_a_run_with_a_budget_shows_what_every_attempt_spent_of_it(
    tmp_path: Path, budget: str, profile: dict[str, Any], spent: float
) -> None:
    from orchestrator.contract.budget_records import write_meter

    (tmp_path / "job.json").write_text(json.dumps({"budget": budget, "profile": profile}))
    write_meter(tmp_path, 0, 0.0, 1800.0, 1)
    write_meter(tmp_path, 1, 5000.0, 5900.0, 1)
    summary = summarize(tmp_path)
    assert (summary.budget, summary.budget_spent) == (budget, pytest.approx(spent))
    assert summarize(tmp_path / "nothing").budget is None
