"""What an attempt started from (orchestrator.contract.attempt_start) and how Trainer checkpoints are chosen
(orchestrator.hf.last_complete_checkpoint): real files, no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.contract.attempt_start import (
    ENDED_IN_START_UP,
    NO_HOOK,
    describe_newest_start,
    describe_start,
    write_attempt_start,
)
from orchestrator.contract.checkpoints import mark_complete_in_place
from orchestrator.contract.run_dir import attempt_dir
from orchestrator.hf import last_complete_checkpoint


def _attempt(run_dir: Path, attempt: int, ended: bool = True) -> Path:
    folder = attempt_dir(run_dir, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    if ended:
        (folder / "node_0.exit").write_text("0")
    return folder


def test_a_requeued_attempt_without_a_start_record_is_a_restart_not_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _attempt(tmp_path, 0)
    _attempt(tmp_path, 1)
    assert describe_start(tmp_path, 0, first_attempt=0) is None
    assert describe_start(tmp_path, 1, first_attempt=0) == NO_HOOK
    assert describe_newest_start(tmp_path) == NO_HOOK
    # an attempt still starting (no exit file, no record yet) is not judged
    _attempt(tmp_path, 2, ended=False)
    assert describe_newest_start(tmp_path) == NO_HOOK  # still attempt 1's words
    monkeypatch.setenv("ORCHESTRATOR_ATTEMPT", "2")
    monkeypatch.setenv("ORCHESTRATOR_RUN_DIR", str(tmp_path))
    write_attempt_start(40, str(tmp_path / "checkpoints" / "step_00000040"), "accelerate")
    assert describe_newest_start(tmp_path) == "resumed at step 40 from step_00000040 (accelerate hook)"
    write_attempt_start(0, None, "trainer")
    assert describe_newest_start(tmp_path) == (
        "restarted from step 0: no complete checkpoint to resume from (trainer hook)"
    )
    # a script with a hook whose attempt ended before rank 0 restored (a budget's stop, a fault in
    # start-up) trained nothing: never read as "no hook", which status would turn into the job's reason
    _attempt(tmp_path, 2)
    _attempt(tmp_path, 3)
    assert describe_newest_start(tmp_path) == ENDED_IN_START_UP
    assert describe_start(tmp_path, 1, first_attempt=0) == ENDED_IN_START_UP


def _hf_checkpoint(out: Path, step: int, run: str | None) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    mark_complete_in_place(folder, {"step": step, "hook": "trainer", "run": run})
    return folder


def test_the_newest_intact_checkpoint_of_this_run_is_chosen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("ORCHESTRATOR_RUN_DIR", str(run))
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    said: list[str] = []
    assert last_complete_checkpoint(out, said.append) is None  # no folder yet
    _hf_checkpoint(out, 10, str(run.resolve()))
    c20 = _hf_checkpoint(out, 20, str(run.resolve()))
    c30 = _hf_checkpoint(out, 30, str(run.resolve()))
    _hf_checkpoint(out, 40, "/elsewhere/an-earlier-run")
    (out / "checkpoint-50").mkdir()  # killed before anything was written: no marker
    (c30 / "model.safetensors").write_bytes(b"torn")  # truncated
    same_size = bytearray((c20 / "model.safetensors").read_bytes())
    same_size[0] ^= 0xFF
    (c20 / "model.safetensors").write_bytes(bytes(same_size))  # right size, wrong bytes
    assert last_complete_checkpoint(out, said.append) == str(out / "checkpoint-10")
    text = "\n".join(said)
    assert "checkpoint-50" in text and "no COMPLETE.json" in text
    assert "checkpoint-40: written by another run" in text
    assert "checkpoint-30" in text and "truncated or torn" in text
    assert "checkpoint-20" in text and (c20 / "CORRUPT.json").exists()


def test_a_trainer_runs_recorded_checkpoints_count_for_the_run_and_others_are_foreign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook records its output_dir in the run directory: the run's newest complete ``checkpoint-N``
    there is the run's checkpoint (``resume``, ``status``); another run's, or an unmarked folder this
    run never began, is foreign; a folder this run began and did not finish is its own."""
    from orchestrator.contract.hook_checkpoints import record_hook_checkpoint_dir
    from orchestrator.contract.run_dir import last_complete_checkpoint as run_checkpoint
    from orchestrator.rank.hf import foreign_checkpoints

    run, other, out = tmp_path / "run", tmp_path / "other", tmp_path / "out"
    run.mkdir()
    other.mkdir()
    monkeypatch.delenv("RANK", raising=False)
    assert run_checkpoint(run) is None
    _hf_checkpoint(out, 10, str(run.resolve()))
    _hf_checkpoint(out, 30, str(other.resolve()))
    assert run_checkpoint(run) is None  # not recorded yet: the run directory alone knows nothing
    record_hook_checkpoint_dir(run, out, "trainer")
    record_hook_checkpoint_dir(run, out, "trainer", saving=20)
    (out / "checkpoint-20").mkdir()  # this run's save, torn
    (out / "checkpoint-40").mkdir()  # nobody's marker, never begun by this run
    info = run_checkpoint(run)
    assert info is not None and (info.step, info.path) == (10, out / "checkpoint-10"), info
    assert foreign_checkpoints(out, run) == [
        (out / "checkpoint-40", None),
        (out / "checkpoint-30", str(other.resolve())),
    ]
    record_hook_checkpoint_dir(run, out, "trainer", saved=20)
    assert [f.name for f, _ in foreign_checkpoints(out, run)] == [
        "checkpoint-40",
        "checkpoint-30",
        "checkpoint-20",
    ]
