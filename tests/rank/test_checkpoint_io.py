"""orchestrator.rank.checkpoint_io.checked_choice: a checkpoint whose shard files do not match their
digests is skipped with one warning, and so is every other skipped checkpoint of the same resume
(rank 0's ``find_resumable`` reported the newer ones already; choosing again does not report them,
nor the skipped one, a second time). One process, no process group, real files."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from orchestrator.contract.checkpoints import finalize, find_resumable
from orchestrator.contract.run_dir import CORRUPT_MARKER
from orchestrator.rank.checkpoint_io import checked_choice

SHARD = "pytorch_model_fsdp_0/__1_0.distcp"


def _checkpoint(ckpts: Path, step: int, flip_shard: bool = False) -> Path:
    """A complete two-rank sharded checkpoint of ``step`` (marker with every file's sha256);
    ``flip_shard``: then one byte of rank 1's shard inverted, sizes intact."""
    tmp, final = ckpts / f".tmp-step_{step:08d}-x", ckpts / f"step_{step:08d}"
    for rank in (0, 1):
        (tmp / "pytorch_model_fsdp_0").mkdir(parents=True, exist_ok=True)
        (tmp / "pytorch_model_fsdp_0" / f"__{rank}_0.distcp").write_bytes(bytes(range(256)) * 4)
    (tmp / "meta.json").write_text(f'{{"step": {step}}}')
    finalize(tmp, final, {"step": step})
    if flip_shard:
        data = bytearray((final / SHARD).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (final / SHARD).write_bytes(bytes(data))
    return final


def test_each_skipped_checkpoint_is_reported_once(tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    good = _checkpoint(ckpts, 8)
    older_bad = _checkpoint(ckpts, 9, flip_shard=True)
    newer_bad = _checkpoint(ckpts, 10, flip_shard=True)
    torn = _checkpoint(ckpts, 12)
    (torn / "COMPLETE.json").unlink()
    lines: list[str] = []
    accelerator = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)

    found = find_resumable(tmp_path / "run", lines.append, shards=False)
    assert found is not None and found[0] == newer_bad  # its shards are not read here
    chosen = checked_choice(accelerator, tmp_path / "run", (str(found[0]), found[1]), lines.append)

    assert chosen is not None and chosen[0] == str(good)
    assert len(lines) == 3, lines
    assert lines[0] == f"warning: skipping checkpoint {torn}: no COMPLETE.json (the save did not finish)"
    for line, folder in zip(lines[1:], (newer_bad, older_bad), strict=True):
        assert line.startswith(
            f"warning: skipping checkpoint {folder}: content does not match COMPLETE.json: file {SHARD}: sha256 "
        ), line
        assert (folder / CORRUPT_MARKER).is_file()
    for folder in (torn, newer_bad, older_bad):
        assert sum(f"skipping checkpoint {folder}:" in line for line in lines) == 1, (folder, lines)
