"""Copies of memory checkpoints on another node, so that a lost node does not take the only copy.

A rank's memory checkpoint lives in its node's memory (:mod:`orchestrator.rank.memory_checkpoints`), and
a node that dies takes it along: the spare that takes its place, and so every rank, went back to the
shared checkpoint, hundreds of steps back. NVIDIA's resiliency extension replicates its local
checkpoints to peer nodes for this case; here each rank sends its file, right after writing it, to the
rank of the same local rank on the node half the job's nodes away
(:func:`orchestrator.contract.memory_checkpoints.replica_peer`), which writes it into its own node's
folder under the owner's name. The ring means every node sends and receives one node's worth of
state at every save, all links at once.

At a restart every rank says what its node folder holds; the ranks take the newest step each rank's
file exists of somewhere (:func:`~orchestrator.contract.memory_checkpoints.newest_step_held`), and a
rank whose node folder lacks its own file of that step gets it from a node that holds it
(:func:`~orchestrator.contract.memory_checkpoints.transfers`): the spare gets its lost predecessor's
files from the node that kept its copies, and survivors whose node rank moved get the files of their new ranks.

The bytes go over a gloo group of their own (CPU tensors: under NCCL too), point to point, sizes
first, on a thread of their own while training goes on; the next save waits for the previous copy.
Every rank takes part in every exchange, also one whose own save failed (it sends nothing): a rank
that left the schedule would leave its peers waiting.
"""

from __future__ import annotations

import mmap
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract.memory_checkpoints import (
    KEEP_MEMORY_CKPTS,
    memory_ckpt_file,
    memory_ckpt_holdings,
    replica_owner,
    replica_peer,
    transfers,
)


def local_world_size() -> int:
    """Ranks on this node, as the launcher says (torchrun, accelerate and the direct launch all set it)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return 0


def private_folder(folder: Path, create: bool = True) -> str | None:
    """None when ``folder`` and its parent are folders of this user's alone (made so, 0700, where
    missing and ``create``), else why not. ``/dev/shm`` is writable by everyone: another user who made
    ``orchestrator-<uid>`` first could read a rank's state or plant a pickle the restore would load."""
    for path in (folder.parent, folder):
        try:
            if create:
                path.mkdir(mode=0o700, exist_ok=True)
            st = path.lstat()
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            mode = oct(st.st_mode & 0o777)
            return f"{path} is not a folder of this user's alone (uid {st.st_uid}, mode {mode})"
    return None


def remove_torn_files(folder: Path) -> None:
    """Remove the temp files of writers that are gone (``.<name>.<pid>.tmp``: a rank killed mid-save or
    mid-copy): a restart in place keeps the folder, and each one can be a shard's size of memory."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        parts = name.rsplit(".", 2)
        if not (name.startswith(".") and len(parts) == 3 and parts[2] == "tmp" and parts[1].isdigit()):
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            (folder / name).unlink(missing_ok=True)
        except OSError:  # alive, another user's: not ours to touch
            pass


@dataclass
class ReplicaLink:
    """This rank's side of the ring: whom it sends its files to, whose it keeps."""

    rank: int
    world: int
    local_world: int
    folder: Path
    peer: int
    owner: int
    group: Any = field(default=None, repr=False)
    received_bytes: int = 0
    """The size of the newest copy received, for the log."""
    copy_seconds: float = 0.0
    """How long the newest exchange took, off the training thread."""
    _copying: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def between_nodes(cls, accelerator: Any, folder: Path) -> ReplicaLink | None:
        """A link where the job has more than one node and torch.distributed runs, else None. Collective
        where it is not None (a gloo group is made), and the same answer on every rank."""
        rank, world, local = (
            int(accelerator.process_index),
            int(accelerator.num_processes),
            local_world_size(),
        )
        peer, owner = replica_peer(rank, world, local), replica_owner(rank, world, local)
        if peer is None or owner is None:
            return None
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        group, why = None, None
        try:  # a group of its own: the copies run beside training's collectives, on another thread
            group = dist.new_group(backend="gloo")
        except Exception as exc:  # noqa: BLE001 (no copies is a loss of speed, not of training)
            why = f"{type(exc).__name__}: {exc}"
        answers: list[Any] = [None] * world
        dist.all_gather_object(answers, why)  # all link or none: a rank alone would leave its peer waiting
        failed = next((a for a in answers if a is not None), None)
        if failed is not None:
            if rank == 0:
                print(
                    f"[orchestrator] memory checkpoints stay on their node (no gloo group: {failed})",
                    file=sys.stderr,
                )
            return None
        return cls(rank, world, local, folder, peer, owner, group)

    # ------------------------------------------------------------------ at every save
    def exchange(self, step: int, mine: Path | None) -> None:
        """Start sending this rank's file of ``step`` (None: its save failed, nothing to send) to
        :attr:`peer` and keeping what :attr:`owner` sends, on a thread of its own: the copy crosses the
        network while training goes on. The previous exchange is waited for first (one at a time, in
        the same order on every rank). A copy that arrives whole is renamed into place, so a node lost
        mid-copy leaves the copy of the step before."""
        self.wait()
        out = _mapped(mine)
        self._copying = threading.Thread(
            target=self._exchange, args=(step, out), name=f"memory-ckpt-copy-{step}", daemon=True
        )
        self._copying.start()

    def wait(self) -> None:
        """Until the exchange under way, if any, has ended."""
        if self._copying is not None:
            self._copying.join()
            self._copying = None

    def _exchange(self, step: int, out: Any) -> None:
        started = time.monotonic()
        try:
            received = self._swap([(self.peer, out)], [self.owner])
        except Exception as exc:  # noqa: BLE001 (a peer gone mid-copy: training's collectives say so)
            print(f"[orchestrator] memory checkpoint copy of step {step} failed: {exc}", file=sys.stderr)
            return
        data = received.get(self.owner)
        self.received_bytes = 0 if data is None else int(data.numel())
        if data is not None:
            self._keep(self.owner, step, data)
        self.copy_seconds = time.monotonic() - started

    def _keep(self, owner: int, step: int, data: Any) -> None:
        final = memory_ckpt_file(self.folder, self.world, owner, step)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            unsafe = private_folder(self.folder)
            if unsafe:
                raise OSError(unsafe)
            with open(tmp, "wb") as f:
                f.write(memoryview(data.numpy()))
            os.replace(tmp, final)
        except OSError as exc:
            print(f"[orchestrator] rank {owner}'s memory checkpoint copy not kept: {exc}", file=sys.stderr)
        finally:
            tmp.unlink(missing_ok=True)
        held = memory_ckpt_holdings(self.folder, self.world).get(owner, [])
        for old in held[KEEP_MEMORY_CKPTS:]:
            memory_ckpt_file(self.folder, self.world, owner, old).unlink(missing_ok=True)

    # ------------------------------------------------------------------ at a restart
    def fetch(self, holdings_by_rank: list[dict[int, list[int]]], step: int) -> None:
        """Collective: every rank whose node folder lacks its own file of ``step`` gets it from a rank
        whose node holds it (:func:`~orchestrator.contract.memory_checkpoints.transfers`; the same plan
        on every rank)."""
        moves = transfers(holdings_by_rank, step)
        sends = [
            (to, _mapped(memory_ckpt_file(self.folder, self.world, to, step)))
            for fr, to in moves
            if fr == self.rank
        ]
        receives = [fr for fr, to in moves if to == self.rank]
        for sender, data in self._swap(sends, receives).items():
            if data is not None:
                self._keep(self.rank, step, data)
            else:
                print(
                    f"[orchestrator] rank {sender} could not send rank {self.rank}'s memory checkpoint",
                    file=sys.stderr,
                )

    def tidy(self) -> None:
        """Remove the files of ranks this node neither runs nor keeps copies of (after a spare's swap the
        survivors' folders hold their old ranks' files): by the node's first rank, after the restore."""
        if self.rank % self.local_world:
            return
        ours = set(range(self.rank, self.rank + self.local_world))
        kept = ours | {replica_owner(r, self.world, self.local_world) for r in ours}
        for owner, steps in memory_ckpt_holdings(self.folder, self.world).items():
            if owner not in kept:
                for step in steps:
                    memory_ckpt_file(self.folder, self.world, owner, step).unlink(missing_ok=True)

    # ------------------------------------------------------------------ the wire
    def _swap(self, sends: list[tuple[int, Any]], receives: list[int]) -> dict[int, Any]:
        """Point to point: sizes first (0: nothing), then the bytes. Returns each sender's bytes (a
        uint8 tensor) or None."""
        import torch
        import torch.distributed as dist

        sizes_out = [
            torch.tensor([0 if data is None else data.numel()], dtype=torch.int64) for _, data in sends
        ]
        sizes_in = {fr: torch.zeros(1, dtype=torch.int64) for fr in receives}
        ops = [dist.P2POp(dist.isend, s, to, self.group) for (to, _), s in zip(sends, sizes_out, strict=True)]
        ops += [dist.P2POp(dist.irecv, t, fr, self.group) for fr, t in sizes_in.items()]
        _wait(dist, ops)
        got: dict[int, Any] = {fr: None for fr in receives}
        ops = [
            dist.P2POp(dist.isend, data, to, self.group)
            for to, data in sends
            if data is not None and data.numel()
        ]
        for fr, size in sizes_in.items():
            if int(size.item()) > 0:
                got[fr] = torch.empty(int(size.item()), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, got[fr], fr, self.group))
        _wait(dist, ops)
        return got


def _wait(dist: Any, ops: list[Any]) -> None:
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def _mapped(path: Path | None) -> Any:
    """A file's bytes as a uint8 tensor over its pages (copy on write: none made), or None where there
    is no such file."""
    if path is None:
        return None
    import torch

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return None
            pages = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except OSError:
        return None
    return torch.frombuffer(pages, dtype=torch.uint8)
