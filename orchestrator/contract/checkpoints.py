"""Checkpoint folders on disk, without torch: the atomic-marker protocol's file side.

``train/`` and the API for users' loops (:mod:`orchestrator.loop`) write their checkpoints through
:func:`finalize` and pick the one to resume with :func:`find_resumable`; the HF Trainer hook
(:mod:`orchestrator.hf`) marks Transformers' in-place ``checkpoint-N`` folders with
:func:`mark_complete_in_place`. The rule for "complete" is :func:`orchestrator.contract.run_dir.check_checkpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import (
    CHECKPOINTS_DIR,
    COMPLETE_MARKER,
    CORRUPT_MARKER,
    check_checkpoint,
    checkpoint_folder_name,
    checkpoint_folders,
    write_json_atomic,
)

MARKER = COMPLETE_MARKER
Warn = Callable[[str], None]


# ---------------------------------------------------------------------------- content digests
def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in 4 MiB blocks into one buffer (no new block per read)."""
    h = hashlib.sha256()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_digests(folder: Path, rels: Any) -> dict[str, str | OSError]:
    """``{rel: sha256 or the OSError reading it}`` for files under ``folder``, several at once.

    sha256 runs at well under the disk's speed on one core (~0.9 GB/s), and a checkpoint is a few
    large files (each rank's shard): hashed one after another they cost more than writing them
    (1.8 s of a 1.54 GB save). hashlib and file reads release the GIL, so threads hash the files in
    parallel on however many cores there are; largest first, so one big file does not finish last.
    """
    from concurrent.futures import ThreadPoolExecutor

    names = [str(r) for r in rels]

    def one(rel: str) -> str | OSError:
        try:
            return file_digest(Path(folder) / rel)
        except OSError as exc:
            return exc

    sizes = {rel: os.stat(p).st_size if (p := Path(folder) / rel).is_file() else 0 for rel in names}
    order = sorted(names, key=sizes.__getitem__, reverse=True)
    workers = min(len(order), os.cpu_count() or 1)
    if workers <= 1:
        return {rel: one(rel) for rel in names}
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="digest") as pool:
        done = dict(zip(order, pool.map(one, order), strict=True))
    return {rel: done[rel] for rel in names}


# DCP's FileSystemWriter (single_file_per_rank) names each rank's shard file ``__<rank>_<n>.distcp``.
_RANK_SHARD = re.compile(r"__(\d+)_\d+\.distcp")


def rank_shard_files(folder: Path, rank: int) -> list[str]:
    """The shard files rank ``rank`` wrote under ``folder`` (relative paths): the bulk of a sharded
    checkpoint, which that rank digests itself (``digests`` of :func:`finalize`). Names only: the
    other ranks are still writing their load plans beside them (a temp file, then a rename), and a
    ``stat`` of every file listed met one gone (FileNotFoundError in rank 0's save: a CI run)."""
    return sorted(
        path.relative_to(folder).as_posix()
        for path in Path(folder).rglob("__*.distcp")
        if (m := _RANK_SHARD.fullmatch(path.name)) and int(m.group(1)) == rank
    )


def is_rank_shard(rel: str) -> bool:
    """A DCP shard file (``__<rank>_<n>.distcp``): what the ranks check while they load it."""
    return _RANK_SHARD.fullmatch(rel.rsplit("/", 1)[-1]) is not None


def shard_share(rels: Iterable[str], rank: int, world_size: int) -> list[str]:
    """The shard files among ``rels`` whose digests rank ``rank`` of ``world_size`` checks at a load:
    those the same rank wrote (at the same world size, the very files it reads), and those of ranks
    that are gone, dealt out by their rank modulo the world size."""
    return [
        rel
        for rel in rels
        if (m := _RANK_SHARD.fullmatch(rel.rsplit("/", 1)[-1])) and int(m.group(1)) % world_size == rank
    ]


def load_plan_name(rank: int) -> str:
    """Rank ``rank``'s load plan in a sharded checkpoint (:mod:`orchestrator.rank.shard_plan`)."""
    return f"load_plan_{rank}.json"


def fsync_and_digest(folder: Path, rels: list[str]) -> dict[str, str]:
    """fsync and sha256 of the given files (a rank's own shards, while they are in its page cache)."""
    for rel in rels:
        fsync_path(folder / rel)
    got = file_digests(folder, rels)
    for value in got.values():
        if isinstance(value, OSError):
            raise value
    return {rel: str(value) for rel, value in got.items()}


def check_checkpoint_content(ckpt_dir: Path, marker: dict[str, Any], shards: bool = True) -> str:
    """ "" when every file's bytes match the marker's ``sha256`` digests, else why not. Reads every
    byte, so it is for a restore (once per start), never for ``status``. Checkpoints written before
    digests existed pass. ``shards=False``: the DCP shard files are left out (every digest must still
    be there): the ranks check those while they load them (``train/``: ``checkpointing.load``)."""
    digests = marker.get("sha256")
    if not isinstance(digests, dict):
        return ""
    rels = [str(rel) for rel in marker.get("files", {})]
    for rel in rels:
        if digests.get(rel) is None:
            return f"{COMPLETE_MARKER} has no sha256 of {rel}"
    if not shards:
        rels = [rel for rel in rels if not is_rank_shard(rel)]
    got_all = file_digests(Path(ckpt_dir), rels)
    for rel in rels:
        got, want = got_all[rel], digests[rel]
        if isinstance(got, OSError):
            return f"cannot read {rel}: {got.strerror or got}"
        if got != want:
            return f"file {rel}: sha256 {got[:12]}..., {COMPLETE_MARKER} says {str(want)[:12]}..."
    return ""


def mark_checkpoint_corrupt(ckpt_dir: Path, reason: str) -> None:
    """Record that a checkpoint's content is bad, so no later resume or ``status`` picks it."""
    write_json_atomic(Path(ckpt_dir) / CORRUPT_MARKER, {"reason": reason, "time": time.time()})


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_files(folder: Path) -> dict[str, int]:
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MARKER:
            files[path.relative_to(folder).as_posix()] = path.stat().st_size
    return files


def _process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, racing threads that
    create files meanwhile): ``Umask:`` of ``/proc/self/status`` (Linux 4.7+), else owner-only."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o077


def _follow_umask(folder: Path, rels: Iterable[str]) -> None:
    """Give a checkpoint's files the mode the job's umask gives new files: safetensors' ``save_file``
    creates its file 0600 whatever the umask, which kept a ``share_with_group`` run's weights from the
    group (0640 promised)."""
    mode = 0o666 & ~_process_umask()
    for rel in rels:
        with contextlib.suppress(OSError):
            if (folder / rel).stat().st_mode & 0o777 != mode:
                os.chmod(folder / rel, mode)


def finalize(
    tmp: Path, final: Path, marker: dict[str, Any], digests: dict[str, str] | None = None
) -> dict[str, Any]:
    """Rank 0: fsync the files, write the marker (fsync), rename into place (atomic), fsync the parent.

    ``digests``: sha256 of files already fsynced and hashed by the ranks that wrote them
    (:func:`fsync_and_digest`), so rank 0 hashes only the rest; a 2-rank base save's digests took
    0.5-1.7 s on rank 0 alone."""
    _follow_umask(tmp, list_files(tmp))
    marker = _write_marker(tmp, marker, digests or {})
    if final.exists():
        # The same step saved before (e.g. a run killed after its save): replace it, never mix the two.
        trash = final.parent / f".trash-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, final)
    fsync_path(final.parent, directory=True)
    return marker


def _write_marker(
    folder: Path, marker: dict[str, Any], known: dict[str, str] | None = None
) -> dict[str, Any]:
    """fsync every file of ``folder``, then write the marker naming them (size and content digest:
    a restore checks both, so a file with the right size and wrong bytes is skipped for the newest
    good checkpoint), fsync it and the folders. ``known``: digests of files their writers already
    fsynced and hashed."""
    files = list_files(folder)
    known = {rel: digest for rel, digest in (known or {}).items() if rel in files}
    digests: dict[str, Any] = dict(known)
    digests.update(fsync_and_digest(folder, [rel for rel in files if rel not in known]))
    marker = {**marker, "files": files, "sha256": {rel: digests[rel] for rel in files}}
    with open(folder / MARKER, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({(folder / rel).parent for rel in files} | {folder}):
        fsync_path(sub, directory=True)
    return marker


def mark_complete_in_place(folder: Path, marker: dict[str, Any]) -> dict[str, Any]:
    """For checkpoints another library writes in place (Transformers' ``checkpoint-N``): once every
    rank has finished writing, the marker makes the folder complete; a folder torn by a kill before
    that has none and is never chosen. Any old marker goes first, so a rewrite is never complete
    under the previous write's marker."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / MARKER)
    return _write_marker(folder, marker)


def newest_complete(
    folders: Iterable[Path], warn: Warn = print, shards: bool = True
) -> tuple[Path, dict[str, Any]] | None:
    """The first of ``folders`` (newest first) that is complete and whose content matches its digests;
    torn ones are skipped with a warning, corrupt ones are also marked (``CORRUPT.json``) so neither a
    later resume nor ``status`` picks them again. ``shards``: see :func:`check_checkpoint_content`."""
    for folder in folders:
        marker, why = check_checkpoint(folder)
        if marker is not None:
            why = check_checkpoint_content(folder, marker, shards)
            if not why:
                return folder, marker
            mark_checkpoint_corrupt(folder, why)
            why = f"content does not match {MARKER}: {why}"
        warn(f"warning: skipping checkpoint {folder}: {why}")
    return None


# ---------------------------------------------------------------------------- unfinished saves
#: A save being written (``.tmp-step_<8d>-<id>``), and a replaced checkpoint on its way out.
UNFINISHED_GLOBS = (".tmp-step_*", ".trash-*")


def temp_folder(run_dir: str | os.PathLike[str], step: int, unique: str) -> Path:
    """Where a save of ``step`` is written before :func:`finalize` renames it into place."""
    return checkpoints_dir(run_dir) / f".tmp-{checkpoint_folder_name(step)}-{unique}"


@contextlib.contextmanager
def removed_if_unfinished(tmp: Path) -> Iterator[Path]:
    """Around a save into ``tmp`` (every rank): when it raises, the half-written folder goes before the
    error travels on (best effort), so a failed save gives back the room it took. A full disk is the
    common cause, and the traceback, the launcher's and the node's last lines need that room to reach
    the logs. A rank whose peer removed the folder first fails to write into it, and removes it too.

    What a kill leaves (no ``except`` runs) goes at the next attempt's start: :func:`remove_unfinished`."""
    try:
        yield tmp
    except BaseException as exc:
        discard_failed_save(tmp, exc)
        raise


def discard_failed_save(tmp: Path, exc: BaseException) -> None:
    """Remove the folder of a save that raised ``exc`` (best effort); when the disk is full, say so on
    stderr: the writer's own error may name no disk (``torch.save``: ``basic_ios::clear: iostream
    error``), and this line, printed once the removal made room for it, is what the failure report
    finds."""
    full = disk_full_words(exc, tmp.parent)  # before the removal gives the room back
    shutil.rmtree(tmp, ignore_errors=True)
    if full:
        with contextlib.suppress(Exception):
            name = tmp.name.removeprefix(".tmp-").rsplit("-", 1)[0]
            print(f"[orchestrator] checkpoint {name} not saved: {full}; its unfinished folder is removed",
                  file=sys.stderr, flush=True)  # fmt: skip


#: Less room than this for an unprivileged writer: the disk is full (a failed save's words, and
#: the failure report's: ``orchestrator.supervise.disk_full``).
FULL_BELOW_BYTES = 1 << 20


def disk_full_words(exc: BaseException, folder: Path) -> str:
    """``No space left on device (0 B free on its filesystem)`` / ``Disk quota exceeded`` when ``exc``
    (or an exception it came from) is ENOSPC or EDQUOT, or ``folder``'s filesystem is full now; else
    ""."""
    avail = None
    with contextlib.suppress(OSError):
        st = os.statvfs(folder)
        avail = st.f_bavail * st.f_frsize
    room = f" ({avail} bytes free on its filesystem)" if avail is not None else ""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return os.strerror(cause.errno) + room
        cause = cause.__cause__ or cause.__context__
    if avail is not None and avail < FULL_BELOW_BYTES:
        return os.strerror(errno.ENOSPC) + room
    return ""


def remove_unfinished(run_dir: str | os.PathLike[str], warn: Warn = print) -> list[str]:
    """Rank 0 at the start of an attempt: remove the temp folders of saves that never completed and
    the trash of replaced ones, all left by earlier attempts (a kill mid-save, a failed save whose
    clean-up could not run). Safe then: one attempt of a run is alive at a time (the run lock), and
    this attempt has not begun to save. Returns the names removed."""
    root = checkpoints_dir(run_dir)
    removed = []
    for pattern in UNFINISHED_GLOBS:
        for entry in sorted(root.glob(pattern)):
            shutil.rmtree(entry, ignore_errors=True)
            if entry.name.startswith(".tmp-"):
                warn(f"warning: removed unfinished checkpoint {entry.name} (an earlier attempt's save "
                     "that never completed; never resumed from)")  # fmt: skip
            removed.append(entry.name)
    return removed


def find_resumable(
    run_dir: str | os.PathLike[str], warn: Warn = print, shards: bool = True
) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0 at the start of an attempt (both checkpoint writers, ``train/`` and
    :mod:`orchestrator.loop`, call it there): remove what earlier attempts' unfinished saves left
    (:func:`remove_unfinished`), then return the newest complete checkpoint whose content matches its
    digests; torn ones are skipped with a warning, corrupt ones are also marked (``CORRUPT.json``) so
    neither a later resume nor ``status`` picks them again.

    ``shards=False``: the DCP shard files (the bulk of a sharded checkpoint) are not read here; the
    caller's ranks check them as they load them, each its own (``train/``: one pass over the bytes
    on every rank at once instead of two passes, one of them on rank 0 alone), and mark the
    checkpoint corrupt themselves (:func:`mark_checkpoint_corrupt`) before choosing again."""
    remove_unfinished(run_dir, warn)
    return newest_complete((folder for _, folder in checkpoint_folders(Path(run_dir))), warn, shards)


def prune(run_dir: str | os.PathLike[str], keep_last: int, keep_tmp: AbstractSet[str] = frozenset()) -> None:
    """Rank 0: keep the newest ``keep_last`` complete checkpoints; drop stale temp folders."""
    root = checkpoints_dir(run_dir)
    complete = [(s, p) for s, p in checkpoint_folders(Path(run_dir)) if (p / MARKER).is_file()]
    for _, folder in complete[max(1, keep_last) :]:
        shutil.rmtree(folder, ignore_errors=True)
    for entry in root.glob(".tmp-step_*"):
        if entry.name not in keep_tmp:
            shutil.rmtree(entry, ignore_errors=True)
    for entry in root.glob(".trash-*"):
        shutil.rmtree(entry, ignore_errors=True)
