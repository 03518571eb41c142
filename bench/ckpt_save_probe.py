"""The product's checkpoint save and load against raw I/O of the very same bytes, same processes.

Launched by bench_ckpt_load.py with ``accelerate launch --config_file <render --strategy full_shard
--wrap-cls TransformerBlock>`` (2 ranks), so the Accelerator, the FSDP2 wrapping and the workarounds
are exactly train/'s. Builds the ``base`` model, takes one AdamW step, then per repetition (order
flipped every repetition):

* ``save``: ``train.checkpointing.save`` -- what train/ does at every checkpoint: ``save_state``
  (DCP shards of model and optimizer, RNG files), barrier, every rank's fsyncs and sha256 digests,
  rank 0's marker and rename;
* ``save_before``: the same save with issue 16's two changes undone (``as_before_issue_16``);
* ``raw_write``: ``os.write`` of every local shard those state dicts hold (model parameters and
  AdamW's exp_avg / exp_avg_sq; each rank its own file) + fsync;
* ``load``: ``train.checkpointing.load`` of the checkpoint just saved (``load_state``);
* ``raw_read``: ``readinto`` of the raw file back into the same local shards;
* ``load_before``: the same load through DCP's stock ``FileSystemReader`` (``stock_dcp_reads``), as
  before issue 16's direct reads;
* ``cold_load`` / ``cold_raw_read`` / ``cold_load_before``: the same three after dropping the page
  cache (root only), as a
  resume on another node finds them;
* ``cold_resume``: what a resumed attempt does, cold: rank 0's ``find_resumable`` (checks the marker's
  sha256 of every file) and then the load.

The three writes rotate their order every repetition; the loads alternate. Both sides of a pair move the same bytes between the same memory and the same disk within seconds
of each other, so the disk's write-back state (which swings a raw write 0.6-4 s on this machine)
hits both. Rank 0 prints one JSON line per repetition.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.contract.checkpoints import find_resumable  # noqa: E402
from orchestrator.rank import workarounds  # noqa: E402
from orchestrator.rank.checkpoint_io import checked_choice  # noqa: E402
from train import checkpointing  # noqa: E402
from train.model import build_model  # noqa: E402

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache() -> None:
    """The cold-cache pairs: a resumed job on another node reads its checkpoint from disk (or the
    network filesystem), not from this node's page cache. Root only; the whole machine's cache."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


@contextlib.contextmanager
def as_before_issue_16() -> Iterator[None]:
    """``save_before``: the same save as it was before issue 16's changes -- torch.save's zip CRC
    computed, rank 0 fsyncing and hashing every rank's shards -- for a same-process comparison."""
    saved = checkpointing.without_zip_crc32, checkpointing.own_shard_digests
    checkpointing.without_zip_crc32 = contextlib.nullcontext  # type: ignore[assignment]
    checkpointing.own_shard_digests = lambda folder, rank, world: {}  # type: ignore[assignment]
    try:
        yield
    finally:
        checkpointing.without_zip_crc32, checkpointing.own_shard_digests = saved


@contextlib.contextmanager
def stock_dcp_reads() -> Iterator[None]:
    """``load_before``: train/'s load with DCP's own FileSystemReader (no load plan, no direct reads)."""
    from orchestrator.rank import dcp_reader, shard_plan

    saved = dcp_reader.direct_dcp_reads, shard_plan.fast_fsdp_loads
    dcp_reader.direct_dcp_reads = contextlib.nullcontext  # type: ignore[assignment]
    shard_plan.fast_fsdp_loads = lambda folder: contextlib.nullcontext(shard_plan.FastLoadReport())  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        dcp_reader.direct_dcp_reads, shard_plan.fast_fsdp_loads = saved


@contextlib.contextmanager
def count_direct_reads(dcp_reader: Any) -> Iterator[dict[str, Any]]:
    """Rank 0's count of tensors the load read through its load plan, straight into place through
    DCP's planner, and left to DCP; and why the load plan was not used, if it was not."""
    from orchestrator.rank import shard_plan

    real, real_plan = dcp_reader.direct_dcp_reads, shard_plan.fast_fsdp_loads
    got: dict[str, Any] = {"planned": 0, "direct": 0, "through_dcp": 0}

    @contextlib.contextmanager
    def counting() -> Iterator[Any]:
        with real() as counts:
            yield counts
        got["direct"] += counts.direct
        got["through_dcp"] += counts.through_dcp

    @contextlib.contextmanager
    def planned(folder: Path) -> Iterator[Any]:
        with real_plan(folder) as report:
            yield report
        got["planned"] += report.tensors
        if report.why_not:
            got["why_not"] = report.why_not

    dcp_reader.direct_dcp_reads, shard_plan.fast_fsdp_loads = counting, planned
    try:
        yield got
    finally:
        dcp_reader.direct_dcp_reads, shard_plan.fast_fsdp_loads = real, real_plan


def main() -> None:
    root, reps = Path(sys.argv[1]), int(sys.argv[2])
    from accelerate import Accelerator

    pending = workarounds.before_accelerator()
    acc = Accelerator()
    workarounds.after_accelerator(acc, pending)
    model = workarounds.wrap_model(acc, build_model("base"), pending)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    out = model(torch.randint(0, 100, (1, 16)))
    (out[0] if isinstance(out, tuple) else out).float().mean().backward()
    opt.step()
    rank = acc.process_index

    def local_tensors() -> list[torch.Tensor]:
        got = []
        for p in model.parameters():
            got.append(p.to_local() if hasattr(p, "to_local") else p)
            for v in opt.optimizer.state.get(p, {}).values():
                if torch.is_tensor(v) and v.numel() > 1:
                    got.append(v.to_local() if hasattr(v, "to_local") else v)
        return [t.detach() for t in got]

    def raw_write(folder: Path) -> int:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / f"rank{rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        n = 0
        try:
            for t in local_tensors():
                n += os.write(fd, t.contiguous().view(-1).view(torch.uint8).numpy().data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return n

    def raw_read(folder: Path) -> None:
        with open(folder / f"rank{rank}.bin", "rb", buffering=0) as f:
            for t in local_tensors():
                f.readinto(t.view(-1).view(torch.uint8).numpy().data)

    can_drop_caches = os.access(DROP_CACHES, os.W_OK)
    current = {"world_size": acc.num_processes, "strategy": "full_shard"}
    for rep in range(reps):
        run_dir = root / f"run{rep}"
        raw_dir = root / f"raw{rep}"
        times: dict[str, float] = {}
        info: dict[str, Any] = {}
        kinds = ("save", "raw_write", "save_before")
        for kind in kinds[rep % 3 :] + kinds[: rep % 3]:
            dist.barrier()
            t = time.perf_counter()
            if kind == "save":
                res = checkpointing.save(acc, run_dir, 1, dict(current), keep_last=1)
                info.update(phases=res.phases, bytes=sum(res.marker.get("files", {}).values()))
                folder = res.path
            elif kind == "save_before":
                with as_before_issue_16():
                    old = checkpointing.save(acc, root / f"before{rep}", 1, dict(current), keep_last=1)
                info["phases_before"] = old.phases
                if rank == 0:
                    shutil.rmtree(root / f"before{rep}", ignore_errors=True)
            else:
                info["raw_bytes_rank"] = raw_write(raw_dir)
            dist.barrier()
            times[kind] = time.perf_counter() - t
        warm = ("load", "raw_read", "load_before")
        cold = ("cold_load", "cold_raw_read", "cold_resume", "cold_load_before")
        for kind in (warm + cold) if rep % 2 == 0 else (warm[::-1] + cold[::-1]):
            if kind.startswith("cold_"):
                if not can_drop_caches:
                    continue
                dist.barrier()
                if rank == 0:
                    drop_page_cache()
            dist.barrier()
            t = time.perf_counter()
            if kind == "cold_resume":
                # What a resumed attempt of train/ does: rank 0 picks the newest complete checkpoint
                # (checking the digests of every file but the shards), every rank checks its own
                # shards' digests (checked_choice), then every rank loads it.
                choice: list[Any] = [None]
                if rank == 0:
                    found = find_resumable(run_dir, print, shards=False)
                    assert found is not None and found[0] == folder, found
                    choice = [(str(found[0]), found[1])]
                dist.broadcast_object_list(choice, src=0)
                picked = time.perf_counter()
                checked = checked_choice(acc, run_dir, choice[0])
                assert checked is not None and Path(checked[0]) == folder, checked
                loading = time.perf_counter()
                checkpointing.load(acc, folder, checked[1], opt, current)
                info["resume_phases"] = {"pick": picked - t, "check": loading - picked}
            elif kind.endswith("load"):
                from orchestrator.rank import dcp_reader

                with count_direct_reads(dcp_reader) as counts:
                    checkpointing.load(acc, folder, dict(current), opt, current)
                info["direct_reads"] = counts
            elif kind.endswith("load_before"):
                with stock_dcp_reads():
                    checkpointing.load(acc, folder, dict(current), opt, current)
            else:
                raw_read(raw_dir)
            dist.barrier()
            times[kind] = time.perf_counter() - t
        raw_total = torch.tensor([info["raw_bytes_rank"]], dtype=torch.int64)
        dist.all_reduce(raw_total)
        if rank == 0:
            print(
                json.dumps(
                    {
                        "rep": rep,
                        **{f"{k}_s": round(v, 4) for k, v in times.items()},
                        "save_phases_s": {k: round(v, 4) for k, v in info["phases"].items()},
                        "save_before_phases_s": {k: round(v, 4) for k, v in info["phases_before"].items()},
                        "checkpoint_bytes": info["bytes"],
                        "direct_reads": info.get("direct_reads"),
                        "resume_phases_s": {k: round(v, 4) for k, v in info.get("resume_phases", {}).items()},
                        "raw_bytes": int(raw_total),
                    }
                ),
                flush=True,
            )
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(raw_dir, ignore_errors=True)
        dist.barrier()


if __name__ == "__main__":
    main()
