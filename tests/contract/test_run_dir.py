"""The run-directory contract: the checkpoint rule."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.contract import run_dir as rd
from orchestrator.contract.run_dir import last_complete_checkpoint
from tests.helpers.run_dirs import make_checkpoint


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


def test_the_layout_names_every_file_name_the_contract_declares() -> None:
    doc = rd.__doc__ or ""
    names = {
        value
        for key, value in vars(rd).items()
        if key.isupper() and isinstance(value, str) and (key.endswith(("_FILE", "_DIR", "_MARKER")))
    }
    assert names and {n for n in names if n not in doc} == set()


def test_attempt_numbers_continue_across_submissions(tmp_path: Path) -> None:
    assert rd.next_attempt(tmp_path) == 0
    rd.write_plan(tmp_path, 0, {"nodes": 2})
    assert rd.next_attempt(tmp_path) == 1  # planned, even before any node logged
    rd.attempt_dir(tmp_path, rd.attempt_number(0, 2)).mkdir(parents=True)  # requeued twice
    assert rd.next_attempt(tmp_path) == 3
    rd.write_plan(tmp_path, 3, {"nodes": 4})
    assert rd.read_current_plan_json(tmp_path)["nodes"] == 4
    assert rd.read_plan_json(tmp_path, 0) == {"nodes": 2, "attempt_base": 0}


def test_current_plan_of_a_run_directory_from_before_attempt_files(tmp_path: Path) -> None:
    """Older run directories kept the first plan in job.json and later ones in job.attempt_<A>.json."""
    (tmp_path / "job.json").write_text(json.dumps({"nodes": 2}))
    (tmp_path / "job.attempt_3.json").write_text(json.dumps({"nodes": 4}))
    assert rd.read_current_plan_json(tmp_path)["nodes"] == 4
    assert rd.read_plan_json(tmp_path, 0) == {"nodes": 2}
    assert rd.next_attempt(tmp_path) == 4
