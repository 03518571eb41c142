"""orchestrator.rank.dcp_reader: DCP checkpoints read straight into place, byte-equal to DCP's own
reader, with every case it cannot prove safe left to DCP (counted, so a reader that silently falls
back everywhere fails too). Real DCP files, a real 2-process gloo group for the resharded loads."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from orchestrator.rank.dcp_reader import DirectReader, direct_dcp_reads
from tests.helpers.net import free_port


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "matrix": torch.randn(37, 11, generator=g),
        "bf16": torch.randn(5, 3, 4, generator=g).to(torch.bfloat16),
        "int64": torch.arange(23, dtype=torch.int64) * 3,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(9, 6, generator=g).t(),  # stored with permuted strides
    }


def _save(folder: Path, state: dict[str, torch.Tensor]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def _load(folder: Path, targets: dict[str, torch.Tensor]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)


def test_direct_reads_equal_dcp_and_leave_what_they_cannot_prove_to_dcp(tmp_path: Path) -> None:
    source = _source()
    _save(tmp_path, source)
    targets = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in source.items()}
    targets["transposed"] = torch.zeros(9, 6).t()  # a non-contiguous target: DCP copies into it
    with direct_dcp_reads() as counts:
        assert dcp.FileSystemReader is not DirectReader and issubclass(dcp.FileSystemReader, DirectReader)
        _load(tmp_path, targets)
    assert dcp.FileSystemReader.__name__ == "FileSystemReader", "the name is put back"
    for key, want in source.items():
        assert torch.equal(targets[key], want), key
    # matrix, bf16, int64, scalar straight in; the transposed one through DCP (DCP plans no read
    # for the empty tensor).
    assert (counts.direct, counts.through_dcp) == (4, 1)

    stock = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in source.items()}
    _load(tmp_path, stock)
    assert all(torch.equal(stock[k], targets[k]) for k in source), "same bytes as DCP's own reader"


def test_a_truncated_shard_file_fails_the_load_and_is_not_read_directly(tmp_path: Path) -> None:
    """A torn record (its zip directory cut off) is never parsed into a read: DCP's own path fails
    the load. (Resume never picks such a checkpoint anyway: its marker's sizes and digests differ.)"""
    from torch.distributed.checkpoint.api import CheckpointException

    _save(tmp_path, {"big": torch.ones(4096, 64)})
    shard = next(tmp_path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    target = {"big": torch.zeros(4096, 64)}
    with pytest.raises(CheckpointException, match="corrupted"), direct_dcp_reads() as counts:
        _load(tmp_path, target)
    assert (counts.direct, counts.through_dcp) == (0, 1)
    assert not target["big"].any(), "nothing was written into the target"


def _resharded_load(rank: int, folder: str, port: int, out: str) -> None:
    """Rank ``rank`` of 2 loads the one-chunk checkpoint into DTensors sharded along dim 0 (rows 4+3:
    one byte range each, rank 1's at an offset) and along dim 1 (not one range: DCP's path), then
    saves a 2-chunk checkpoint."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
        targets = {
            "rows": distribute_tensor(torch.zeros(7, 6), mesh, [Shard(0)]),
            "cols": distribute_tensor(torch.zeros(7, 6), mesh, [Shard(1)]),
        }
        with direct_dcp_reads() as counts:
            dcp.load(targets, storage_reader=dcp.FileSystemReader(folder))
        rows, cols = targets["rows"].to_local(), targets["cols"].to_local()
        result = {
            "rows_ok": torch.equal(rows, full[:4] if rank == 0 else full[4:]),
            "cols_ok": torch.equal(cols, full[:, :3] if rank == 0 else full[:, 3:]),
            "direct": counts.direct,
            "through_dcp": counts.through_dcp,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        # And a checkpoint written by the two ranks (one chunk each) for a 1-process load.
        dcp.save(
            {"w": distribute_tensor(full * 10, mesh, [Shard(0)])},
            storage_writer=dcp.FileSystemWriter(str(Path(out, "two_ranks"))),
        )
    finally:
        dist.destroy_process_group()


def test_resharded_loads_read_the_right_rows_over_gloo(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    ckpt = tmp_path / "ckpt"
    full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    _save(ckpt, {"rows": full, "cols": full.clone()})
    mp.start_processes(
        _resharded_load, args=(str(ckpt), free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"rows_ok": True, "cols_ok": True, "direct": 1, "through_dcp": 1}, (rank, got)
    # Two stored chunks into one tensor: each lands in a row range of the target (rows 4.. at an offset).
    whole = {"w": torch.zeros(7, 6)}
    with direct_dcp_reads() as counts:
        _load(tmp_path / "two_ranks", whole)
    assert torch.equal(whole["w"], full * 10)
    assert (counts.direct, counts.through_dcp) == (2, 0)


def test_record_header_reads_what_torchs_zip_reader_reads(tmp_path: Path) -> None:
    """The load plan's two-``pread`` header parse (orchestrator.rank.shard_plan at save time) gives
    every record's dtype, shape, strides and data offset exactly as torch's own zip reader does."""
    import os

    from torch.distributed.checkpoint.filesystem import _create_file_view

    from orchestrator.rank.dcp_reader import _read_header, record_header

    _save(tmp_path, _source())
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    checked = 0
    for info in metadata.storage_data.values():
        path = tmp_path / info.relative_path
        with open(path, "rb") as stream:
            want = _read_header(_create_file_view(stream, info.offset, info.length))
        fd = os.open(path, os.O_RDONLY)
        try:
            got = record_header(fd, info.offset, info.length)
        finally:
            os.close(fd)
        assert want is not None and got is not None
        (dtype, _key, numel), storage_offset, size, stride = got[0]
        assert (dtype, numel * dtype.itemsize, storage_offset, size, stride, got[1]) == (
            want.dtype, want.storage_bytes, want.storage_offset, want.size, want.stride, want.data_offset,
        )  # fmt: skip
        checked += 1
    assert checked == 6
