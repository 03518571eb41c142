"""Checkpoint content digests: a checkpoint whose marker and sizes check out but whose bytes do not
is skipped (and marked) in favour of the newest good one; the resumed run ends where an
uninterrupted one does."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest

from orchestrator.contract import checkpoints
from orchestrator.contract.checkpoints import check_checkpoint_content
from orchestrator.contract.run_dir import (
    CORRUPT_MARKER,
    check_checkpoint,
    corrupt_checkpoints,
    last_complete_checkpoint,
)
from tests.helpers import train_launch as tl
from tests.helpers.net import free_port
from tests.helpers.run_dirs import make_checkpoint
from train import checkpointing

STEPS = 20
EVERY = 5


def _with_digests(folder: Path) -> None:
    marker_path = folder / "COMPLETE.json"
    marker = json.loads(marker_path.read_text())
    marker["sha256"] = {
        rel: hashlib.sha256((folder / rel).read_bytes()).hexdigest() for rel in marker["files"]
    }
    marker_path.write_text(json.dumps(marker))


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_is_found_and_the_older_checkpoint_chosen(tmp_path: Path) -> None:
    for step in (5, 10):
        _with_digests(make_checkpoint(tmp_path, step, {"model.bin": 64, "optimizer.bin": 32}))
    newest = tmp_path / "checkpoints" / "step_00000010"
    assert check_checkpoint_content(newest, check_checkpoint(newest)[0] or {}) == ""
    _flip_middle_byte(newest / "optimizer.bin")
    marker, _ = check_checkpoint(newest)
    assert marker is not None, "sizes are intact: the stat-only rule still calls it complete"
    assert "optimizer.bin" in check_checkpoint_content(newest, marker)

    warnings: list[str] = []
    found = checkpoints.find_resumable(tmp_path, warnings.append)
    assert found is not None and found[0].name == "step_00000005"
    assert any("step_00000010" in w and "content does not match" in w for w in warnings), warnings
    # Marked: neither status's rule nor a later resume picks it again, and it is listed with why.
    assert (newest / CORRUPT_MARKER).is_file()
    info = last_complete_checkpoint(tmp_path)
    assert info is not None and info.step == 5
    assert [(s, "optimizer.bin" in why) for s, why in corrupt_checkpoints(tmp_path)] == [(10, True)]


def test_checkpoint_without_digests_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before digests existed are not refused."""
    make_checkpoint(tmp_path, 5, {"model.bin": 8})
    found = checkpoints.find_resumable(tmp_path, print)
    assert found is not None and found[0].name == "step_00000005"


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,flip",
    [
        pytest.param("ddp", None, id="ddp-rank0-checks"),
        # FSDP2: rank 0 leaves the shards to the ranks; this one only rank 1 reads and checks
        pytest.param("full_shard", "optimizer_0/__1_0.distcp", id="fsdp2-rank1-shard"),
    ],
)
def test_corrupt_newest_checkpoint_resumes_from_previous_with_equal_final_loss(
    tmp_path: Path, strategy: str, flip: str | None
) -> None:
    baseline = tl.cached_run(strategy, 2, 1, 2, ("--max-steps", str(STEPS)))
    assert baseline.returncodes == [0], baseline.output()
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    first = tl.start(run_dir, strategy, 2, 1, 2, ["--max-steps", str(STEPS), "--ckpt-every", str(EVERY)])
    try:
        first.poll_until(
            lambda: (ckpts / f"step_{2 * EVERY:08d}" / "COMPLETE.json").exists(), 150, "the second checkpoint"
        )
    finally:
        first.kill(signal.SIGKILL)
    complete = [p for _, p in checkpointing.step_folders(run_dir) if (p / "COMPLETE.json").exists()]
    assert len(complete) >= 2 and all(p.name != f"step_{STEPS:08d}" for p in complete), complete
    newest, previous = complete[0], complete[1]
    marker = json.loads((newest / "COMPLETE.json").read_text())
    assert set(marker["sha256"]) == set(marker["files"]), "the marker carries a digest of every file"
    biggest = flip or max(marker["files"], key=lambda rel: marker["files"][rel])
    _flip_middle_byte(newest / biggest)

    second = tl.run(run_dir, strategy, 2, 1, 2, ["--max-steps", str(STEPS)])
    assert second.returncodes == [0], second.output()
    out = second.output()
    assert f"skipping checkpoint {newest}" in out and "content does not match" in out, out
    assert out.count(f"skipping checkpoint {newest}") == 1, out  # once, not again when choosing again
    loaded = tl.read_json(run_dir / "loaded.json")
    resumed_at = int(previous.name.removeprefix("step_"))
    assert loaded["step"] == resumed_at and loaded["checkpoint"].endswith(previous.name)
    assert (newest / CORRUPT_MARKER).is_file()
    ref, got = tl.losses(baseline.run_dir), tl.losses(run_dir)
    tail = [s for s in ref if s > resumed_at]
    assert tail and [got[s] for s in tail] == [ref[s] for s in tail]
    assert (
        tl.read_json(run_dir / "final.json")["loss"] == tl.read_json(baseline.run_dir / "final.json")["loss"]
    )


def _two_rank_save(rank: int, folder: str, port: int) -> None:
    import torch.distributed as dist

    from orchestrator.rank.checkpoint_io import own_shard_digests

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        root = Path(folder)
        for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
            (root / sub).mkdir(parents=True, exist_ok=True)
            (root / sub / f"__{rank}_0.distcp").write_bytes(bytes([rank + 1]) * (1000 + rank))
        (root / f"random_states_{rank}.pkl").write_bytes(b"rng%d" % rank)
        dist.barrier()
        digests = own_shard_digests(root, rank, 2)
        if rank == 0:
            checkpoints.finalize(root, root.parent / "step_00000001", {"step": 1}, digests)
            (root.parent / "known.json").write_text(json.dumps(digests))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_every_rank_digests_its_own_shards_and_the_marker_covers_every_file(tmp_path: Path) -> None:
    """The sharded save's digests: each rank hashes the DCP shard files it wrote, rank 0 the rest;
    the marker still names every file with its size and the right sha256 (a real 2-process gloo
    group)."""
    import torch.multiprocessing as mp

    tmp = tmp_path / "checkpoints" / ".tmp-step_00000001-x"
    mp.start_processes(_two_rank_save, args=(str(tmp), free_port()), nprocs=2, start_method="spawn")
    final = tmp_path / "checkpoints" / "step_00000001"
    marker, why = check_checkpoint(final)
    assert marker is not None, why
    known = json.loads((tmp_path / "checkpoints" / "known.json").read_text())
    shards = {f"{sub}/__{r}_0.distcp" for sub in ("pytorch_model_fsdp_0", "optimizer_0") for r in (0, 1)}
    assert set(known) == shards, "rank 0 gathered exactly the shard files, from both ranks"
    assert set(marker["files"]) == shards | {"random_states_0.pkl", "random_states_1.pkl"}
    for rel in marker["files"]:
        assert marker["sha256"][rel] == hashlib.sha256((final / rel).read_bytes()).hexdigest(), rel
    assert check_checkpoint_content(final, marker) == ""
    _flip_middle_byte(final / "optimizer_0" / "__1_0.distcp")
    assert "__1_0.distcp" in check_checkpoint_content(final, marker)


def test_rank_0_leaves_the_shards_to_the_ranks_but_checks_every_other_file(tmp_path: Path) -> None:
    """find_resumable(..., shards=False): a flipped byte in a DCP shard is not rank 0's to find (each
    rank checks its own: tests/rank/test_shard_plan.py), one in any other file still is; and every
    shard file is some rank's to check, at the saved world size and at others."""
    files = {
        "pytorch_model_fsdp_0/__0_0.distcp": 64,
        "pytorch_model_fsdp_0/__1_0.distcp": 64,
        "load_plan_1.json": 8,
    }
    _with_digests(make_checkpoint(tmp_path, 5, files))
    folder = tmp_path / "checkpoints" / "step_00000005"
    _flip_middle_byte(folder / "pytorch_model_fsdp_0" / "__1_0.distcp")
    found = checkpoints.find_resumable(tmp_path, print, shards=False)
    assert found is not None and found[0] == folder
    assert "__1_0.distcp" in check_checkpoint_content(folder, found[1])
    _flip_middle_byte(folder / "load_plan_1.json")
    assert checkpoints.find_resumable(tmp_path, print, shards=False) is None
    assert (folder / CORRUPT_MARKER).is_file()

    shards = [f"optimizer_0/__{r}_0.distcp" for r in range(4)] + [
        "random_states_0.pkl",
        "optimizer_0/.metadata",
    ]
    assert checkpoints.shard_share(shards, 1, 4) == ["optimizer_0/__1_0.distcp"]
    halves = [checkpoints.shard_share(shards, rank, 2) for rank in (0, 1)]
    assert halves == [["optimizer_0/__0_0.distcp", "optimizer_0/__2_0.distcp"],
                      ["optimizer_0/__1_0.distcp", "optimizer_0/__3_0.distcp"]]  # fmt: skip


def test_a_ranks_shard_list_is_not_upset_by_the_others_writing_their_load_plans(tmp_path: Path) -> None:
    """The ranks list their own shard files while the others still write their load plans (a temp
    file, then a rename: write_json_atomic). Listing by ``stat`` of every file met such a temp file
    gone: FileNotFoundError in rank 0's save, the job FAILED (a CI run)."""
    import threading

    from orchestrator.contract.checkpoints import load_plan_name, rank_shard_files
    from orchestrator.contract.run_dir import write_json_atomic

    for rank in (0, 1):
        (tmp_path / "model_0").mkdir(exist_ok=True)
        (tmp_path / "model_0" / f"__{rank}_0.distcp").write_bytes(b"x")
    stop = threading.Event()

    def other_rank_writes_its_plans() -> None:
        while not stop.is_set():
            write_json_atomic(tmp_path / load_plan_name(1), {"files": {}})

    writer = threading.Thread(target=other_rank_writes_its_plans)
    writer.start()
    try:
        lists = [rank_shard_files(tmp_path, 0) for _ in range(3000)]
    finally:
        stop.set()
        writer.join()
    assert all(found == ["model_0/__0_0.distcp"] for found in lists)
