"""``--async-ckpt``: the same checkpoints as the synchronous save, written off the training thread.

The async save computes the marker's checksums in its writer thread (FSDP: rank 0 reads the written
DCP checkpoint back; DDP: rank 0 sums its staged copies) instead of gathering on the training
thread. These tests pin what must not change: every checkpoint is complete (marker, listed files,
no temp folder left), keep-last-K holds, the checksums are bit-equal to a synchronous save of the
same run at the same step, and resuming from an async checkpoint is exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import train_launch as tl
from train import checkpointing

STEPS = 10
EVERY = 4
ARGS = ("--max-steps", str(STEPS), "--ckpt-every", str(EVERY), "--keep-last", "2")

CASES = [
    pytest.param("ddp", 2, id="ddp"),
    pytest.param("full_shard", 2, id="full_shard-fsdp2"),
    pytest.param("full_shard", 1, id="full_shard-fsdp1"),
]


def _markers(run_dir: Path) -> dict[int, dict]:
    out = {}
    for step, folder in checkpointing.step_folders(run_dir):
        marker, why = checkpointing.validate(folder)
        assert marker is not None, f"{folder}: {why}"
        out[step] = marker
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy,fsdp_version", CASES)
def test_async_checkpoints_match_sync_and_resume_exactly(
    tmp_path: Path, strategy: str, fsdp_version: int
) -> None:
    sync = tl.run(tmp_path / "sync", strategy, fsdp_version, 1, 2, list(ARGS))
    tl.assert_ok(sync)
    run_dir = tmp_path / "async"
    first = tl.run(run_dir, strategy, fsdp_version, 1, 2, [*ARGS, "--async-ckpt"])
    tl.assert_ok(first)
    out = first.output()
    assert "complete (async" in out, out

    got, ref = _markers(run_dir), _markers(sync.run_dir)
    # keep-last 2 of the saves at steps 4, 8 and the final 10; nothing half-written left behind.
    assert sorted(got) == sorted(ref) == [8, 10], (sorted(got), sorted(ref))
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    for step in got:
        assert got[step]["async"] is True and ref[step]["async"] is False
        assert set(got[step]["files"]) == set(ref[step]["files"]), step
        for key in ("param_checksum", "optim_checksum", "samples_seen", "world_size", "strategy"):
            assert got[step][key] == ref[step][key], (step, key, got[step][key], ref[step][key])
        assert got[step]["param_checksum"] is not None
    assert tl.losses(run_dir) == tl.losses(sync.run_dir)

    # Resume from the async step-8 checkpoint (a copy of the run without step 10): the restored state
    # must match the marker's checksums bit for bit and training must end exactly as without a stop.
    resume_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resume_dir)
    shutil.rmtree(resume_dir / "checkpoints" / checkpointing.step_name(10))
    (resume_dir / "final.json").unlink()
    resumed = tl.run(resume_dir, strategy, fsdp_version, 1, 2, list(ARGS))
    tl.assert_ok(resumed)
    loaded = tl.read_json(resume_dir / "loaded.json")
    assert loaded["step"] == 8 and loaded["checkpoint"].endswith(checkpointing.step_name(8))
    assert loaded["param_checksum"] == got[8]["param_checksum"]
    assert loaded["optim_checksum"] == got[8]["optim_checksum"]
    final, ref_final = tl.read_json(resume_dir / "final.json"), tl.read_json(sync.run_dir / "final.json")
    assert final["param_checksum"] == ref_final["param_checksum"]
    assert final["optim_checksum"] == ref_final["optim_checksum"]
    assert final["loss"] == ref_final["loss"]
