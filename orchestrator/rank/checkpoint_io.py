"""Rank-side speed-ups of a sharded save and load, shared by train/ and :mod:`orchestrator.loop`.

All keep the files and the marker protocol of :mod:`orchestrator.contract.checkpoints` unchanged; they
only move work off rank 0's critical path, drop a checksum nobody reads, and read shards ahead and
straight into place (figures in bench/README.md, item ``ckpt_base``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` (which DCP's FileSystemWriter runs once per tensor) computes a CRC-32 of every
    zip record by default; ``torch.load`` never checks it, and the checkpoint's marker holds a sha256
    of every file, which a restore does check. Skipping the CRC cut a 1.54 GB sharded save's write
    phase by about a fifth on this machine."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


def own_shard_digests(folder: Path, rank: int, world_size: int) -> dict[str, str]:
    """Every rank writes its load plan (:func:`orchestrator.rank.shard_plan.write_load_plan`: where
    the bytes it will read back lie), then fsyncs and hashes the shard files it wrote and that plan
    (in its page cache, on its own core); rank 0 gets them all. Collective: every rank calls it after
    the save's barrier. Rank 0 alone hashing every rank's shards grows with the world size; this
    does not."""
    from orchestrator.contract.checkpoints import fsync_and_digest, rank_shard_files
    from orchestrator.rank.shard_plan import write_load_plan

    plan = write_load_plan(folder, rank, world_size)
    mine = fsync_and_digest(folder, rank_shard_files(folder, rank) + ([plan] if plan else []))
    if world_size <= 1:
        return mine
    import torch.distributed as dist

    gathered: list[dict[str, str] | None] = [None] * world_size if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    merged: dict[str, str] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def _read_ahead(folder: Path, rels: list[str]) -> int:
    """``POSIX_FADV_WILLNEED`` on each file: the kernel starts reading it into the page cache and
    returns. Returns the bytes asked for; a no-op where fadvise is missing."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return 0
    asked = 0
    for rel in rels:
        try:
            fd = os.open(folder / rel, os.O_RDONLY)
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            asked += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return asked


def prefetch_own_shards(folder: Path, rank: int) -> int:
    """Ask the kernel to read this rank's shard files ahead (:func:`_read_ahead`) before
    ``load_state`` walks them item by item: a resume on another node finds them on disk, not in its
    page cache, and the reads otherwise wait on the disk one item at a time."""
    from orchestrator.contract.checkpoints import rank_shard_files

    return _read_ahead(folder, rank_shard_files(folder, rank))


def check_own_shards(accelerator: Any, folder: Path, digests: dict[str, str]) -> list[str]:
    """Why ``folder``'s shard files do not match the marker's ``digests`` ([] when they do), the same
    list on every rank. Each rank hashes its share (:func:`orchestrator.contract.checkpoints.shard_share`:
    at an unchanged world size, the files it wrote and will read), all at once, which also leaves
    them in its page cache for the load that follows; rank 0 checked the other files
    (``find_resumable(..., shards=False)``). Collective. Nothing is loaded before the check, so a
    corrupt checkpoint is refused with the state untouched and an older one can be chosen."""
    from orchestrator.contract.checkpoints import file_digests, shard_share

    rank, world = accelerator.process_index, accelerator.num_processes
    mine = shard_share(digests, rank, world)
    _read_ahead(folder, mine)  # the kernel fetches while sha256 runs: cold, the two overlap
    problems = []
    for rel, got in file_digests(folder, mine).items():
        if isinstance(got, OSError):
            problems.append(f"cannot read {rel}: {got.strerror or got}")
        elif got != digests[rel]:
            problems.append(f"file {rel}: sha256 {got[:12]}..., the marker says {str(digests[rel])[:12]}...")
    if world <= 1:
        return problems
    import torch.distributed as dist

    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, problems)
    return [p for part in gathered for p in (part or [])]


def _older_folders(run_dir: Path, skipped: Path) -> list[Path]:
    """The run's checkpoint folders older than ``skipped``, newest first: those rank 0's
    ``find_resumable`` has not looked at yet (it returned ``skipped`` and reported the newer ones it
    passed over). All of them when ``skipped`` is not one of the run's."""
    from orchestrator.contract.run_dir import checkpoint_folders

    folders = [folder for _, folder in checkpoint_folders(run_dir)]
    names = [folder.name for folder in folders]
    return folders[names.index(skipped.name) + 1 :] if skipped.name in names else folders


def checked_choice(
    accelerator: Any, run_dir: Path, found: tuple[str, dict] | None, warn: Any = print
) -> tuple[str, dict] | None:
    """The checkpoint to resume from, its shard files checked: ``found`` is rank 0's
    ``find_resumable(run_dir, warn, shards=False)`` as every rank received it. A checkpoint whose
    shards do not match its digests is marked corrupt and skipped with one warning, as
    ``find_resumable`` does with the other files, and rank 0 chooses again among the older ones
    (``newest_complete``): the newer ones were skipped, and reported, already, so each skipped
    checkpoint is reported once. Collective; the same answer on every rank."""
    from orchestrator.contract.checkpoints import mark_checkpoint_corrupt, newest_complete
    from orchestrator.contract.run_dir import COMPLETE_MARKER
    from orchestrator.rank.shard_plan import gc_paused

    while found is not None:
        folder, marker = Path(found[0]), found[1]
        digests = marker.get("sha256")
        with gc_paused():  # a full collection in a rank's heap costs more than the check itself
            problems = check_own_shards(accelerator, folder, digests) if isinstance(digests, dict) else []
        if not problems:
            return found
        choice: list[tuple[str, dict] | None] = [None]
        if accelerator.is_main_process:
            why = "; ".join(problems)
            mark_checkpoint_corrupt(folder, why)
            warn(f"warning: skipping checkpoint {folder}: content does not match {COMPLETE_MARKER}: {why}")
            again = newest_complete(_older_folders(run_dir, folder), warn, shards=False)
            choice = [(str(again[0]), again[1]) if again else None]
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(choice, src=0)
        found = choice[0]
    return None


def load_state(accelerator: Any, folder: Path) -> Any:
    """``accelerator.load_state(folder)`` as train/ and the loop restore: this rank's shard files
    read ahead; an FSDP2 model and optimizer read through each rank's load plan where the sharding is
    the saved one (:mod:`orchestrator.rank.shard_plan`), else every DCP tensor read straight into
    place (:mod:`orchestrator.rank.dcp_reader`). Returns the fast path's report."""
    from orchestrator.rank.dcp_reader import direct_dcp_reads
    from orchestrator.rank.shard_plan import fast_fsdp_loads

    prefetch_own_shards(folder, accelerator.process_index)
    with fast_fsdp_loads(folder) as report, direct_dcp_reads():
        accelerator.load_state(str(folder))
    return report
