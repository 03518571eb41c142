"""A sharded load at the disk's speed: DCP's ``FileSystemReader`` with tensors read straight into place.

DCP's reader turns every stored tensor into a weights-only ``torch.load`` of its record (the bytes
go into a new storage through a Python file object), then narrows it and copies it into the model's
or the optimizer's tensor: two copies of every byte and ~0.3 ms of Python per tensor. For the
1.54 GB ``base`` checkpoint (900 tensors a rank) that made a load cost about twice a plain read of
the same files (bench/README.md, item ``ckpt_base``).

:class:`DirectReader` reads each record's small header instead (torch's own zip reader for where
the storage's bytes start; ``data.pkl`` unpickled as plain data for dtype, shape and strides) and
then ``preadv``s the bytes into the target tensor's memory, walking each file in offset order: one
sequential pass, as a plain read makes. (Reads from several threads were slower here, cold and warm.)

Whatever it cannot prove to be one contiguous byte range landing in a contiguous CPU tensor of the
same dtype goes through DCP's own code, unchanged: a transform extension, a GPU or non-contiguous
target, a non-contiguous stored tensor, a narrowing that is not one range (resharding along a dim
other than the first), a record it cannot parse. The files, the metadata, the planner and the
resharding rules stay DCP's: only how bytes travel from the file into the tensor changes.

Accelerate builds its ``FileSystemReader`` inside ``load_state``; :func:`direct_dcp_reads` swaps the
name for the duration of a load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pickle
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from torch.storage import _get_dtype_from_pickle_storage_type


@dataclasses.dataclass(frozen=True)
class _StoredTensor:
    """What a ``torch.save`` record says about its one tensor, without reading the tensor's bytes."""

    dtype: torch.dtype
    storage_bytes: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    data_offset: int
    """Where the storage's bytes start, from the start of the record."""


class _HeaderUnpickler(pickle.Unpickler):
    """``data.pkl`` of a one-tensor ``torch.save`` record, read as data: the only globals it resolves
    are the tensor rebuild function and storage type names, and those become plain tuples and names.
    Anything else in the pickle raises, and the record goes through DCP's own (weights-only) load."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuilt
        if module == "torch" and name.endswith("Storage"):
            return name
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        tag, storage_type, key, _location, numel = pid
        if tag != "storage" or not isinstance(storage_type, str):
            raise pickle.UnpicklingError(f"persistent id {pid!r}")
        return (_get_dtype_from_pickle_storage_type(storage_type), str(key), int(numel))


def _rebuilt(storage: Any, storage_offset: int, size: Any, stride: Any, *rest: Any) -> tuple:
    return (storage, int(storage_offset), tuple(size), tuple(stride))


def _read_header(record: Any) -> _StoredTensor | None:
    """The tensor of a DCP ``torch.save`` record (a file view), or None if it is anything else."""
    zip_reader = torch._C.PyTorchFileReader(record)
    if zip_reader.get_record("byteorder") != sys.byteorder.encode():
        return None
    got = _HeaderUnpickler(io.BytesIO(zip_reader.get_record("data.pkl"))).load()
    if not (isinstance(got, tuple) and len(got) == 4 and isinstance(got[0], tuple)):
        return None
    (dtype, key, numel), storage_offset, size, stride = got
    return _StoredTensor(
        dtype,
        numel * dtype.itemsize,
        storage_offset,
        size,
        stride,
        int(zip_reader.get_record_offset(f"data/{key}")),  # type: ignore[attr-defined]
    )


def _u(buf: bytes, at: int, fmt: str) -> int:
    return int(struct.unpack_from(fmt, buf, at)[0])


def _zip64(extra: bytes, values: list[int]) -> list[int]:
    """Replace the 0xFFFFFFFF entries of ``values`` (sizes, then offset) from a zip64 extra field."""
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            field = at + 4
            for i, value in enumerate(values):
                if value == 0xFFFFFFFF:
                    values[i] = _u(extra, field, "<Q")
                    field += 8
            return values
        at += 4 + size
    return values


def record_header(fd: int, offset: int, length: int) -> tuple[Any, int] | None:
    """A ``torch.save`` record's one tensor, read from its zip directory with two ``pread``s: the
    header (:mod:`orchestrator.rank.dcp_reader`'s ``_StoredTensor`` fields) and where the storage's
    bytes start in the record. None for anything else. (torch's own zip reader, ``_read_header``,
    seeks and reads through Python callbacks: ~0.2 ms a record against ~0.02 ms.)"""
    tail_len = min(length, 8192)
    tail = os.pread(fd, tail_len, offset + length - tail_len)
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0 or len(tail) != tail_len:
        return None
    cd_size, cd_off = _u(tail, eocd + 12, "<I"), _u(tail, eocd + 16, "<I")
    if 0xFFFFFFFF in (cd_size, cd_off):
        z64 = tail.rfind(b"PK\x06\x06", 0, eocd)
        if z64 < 0:
            return None
        cd_size, cd_off = _u(tail, z64 + 40, "<Q"), _u(tail, z64 + 48, "<Q")
    at = cd_off - (length - tail_len)
    if at < 0 or at + cd_size > len(tail):
        return None
    entries: dict[str, tuple[int, int]] = {}
    while at + 46 <= len(tail) and tail[at : at + 4] == b"PK\x01\x02":
        method, csize, usize = _u(tail, at + 10, "<H"), _u(tail, at + 20, "<I"), _u(tail, at + 24, "<I")
        nlen, xlen, clen = struct.unpack_from("<HHH", tail, at + 28)
        local = _u(tail, at + 42, "<I")
        name = tail[at + 46 : at + 46 + nlen].decode()
        usize, csize, local = _zip64(tail[at + 46 + nlen : at + 46 + nlen + xlen], [usize, csize, local])
        if method != 0 or usize != csize:
            return None
        entries[name.split("/", 1)[-1]] = (local, csize)
        at += 46 + nlen + xlen + clen
    head = os.pread(fd, min(length, 4096), offset)

    def body(name: str) -> tuple[int, int] | None:
        got = entries.get(name)
        if got is None or got[0] + 30 > len(head) or head[got[0] : got[0] + 4] != b"PK\x03\x04":
            return None
        start = got[0] + 30 + _u(head, got[0] + 26, "<H") + _u(head, got[0] + 28, "<H")
        return start, got[1]

    pkl, order = body("data.pkl"), body("byteorder")
    if pkl is None or order is None or pkl[0] + pkl[1] > len(head) or order[0] + order[1] > len(head):
        return None
    if head[order[0] : order[0] + order[1]] != sys.byteorder.encode():
        return None
    got = _HeaderUnpickler(io.BytesIO(head[pkl[0] : pkl[0] + pkl[1]])).load()
    if not (isinstance(got, tuple) and len(got) == 4 and isinstance(got[0], tuple)):
        return None
    data = body(f"data/{got[0][1]}")
    if data is None or data[1] != got[0][2] * got[0][0].itemsize:
        return None
    return got, data[0]


def _byte_range(
    stored: _StoredTensor, offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[int, int] | None:
    """Start and length in bytes (from the start of the storage) of ``stored`` narrowed by
    ``offsets``/``lengths``, or None where that region is not one contiguous range."""
    sizes = stored.size
    if len(offsets) != len(sizes) or len(lengths) != len(sizes):
        return None
    expected = 1
    for dim in reversed(range(len(sizes))):  # contiguous (dims of size 1 have any stride)
        if sizes[dim] != 1 and stored.stride[dim] != expected:
            return None
        expected *= sizes[dim]
    # One range iff every dimension before the last one not taken whole has length 1.
    partial = [i for i, (n, s) in enumerate(zip(lengths, sizes, strict=True)) if n != s]
    if partial and any(lengths[i] != 1 for i in range(partial[-1])):
        return None
    first = stored.storage_offset + sum(o * st for o, st in zip(offsets, stored.stride, strict=True))
    element = stored.dtype.itemsize
    start, length = first * element, math.prod(lengths) * element
    return (start, length) if start + length <= stored.storage_bytes else None


def _read_into(fd: int, offset: int, target: torch.Tensor, path: str) -> None:
    """``target``'s bytes from ``fd`` at ``offset``; a short read is an error (a torn file)."""
    if target.numel() == 0:
        return
    read_exactly(fd, target.view(-1).view(torch.uint8).numpy().data.cast("B"), offset, path)


def read_exactly(fd: int, view: memoryview, offset: int, name: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (``preadv``, no copy); a short read is an error (a torn
    file, ``name`` in the message)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{name}: {len(view) - done} bytes missing at offset {offset + done}")
        done += got


@dataclasses.dataclass
class ReadCounts:
    """Tensors read straight into place and tensors left to DCP's own reader, over one load."""

    direct: int = 0
    through_dcp: int = 0


class DirectReader(FileSystemReader):
    """:class:`FileSystemReader` whose whole-range tensor reads go straight into the target."""

    counts: ReadCounts = ReadCounts()
    """Where this reader's requests went (a fresh one per :func:`direct_dcp_reads`)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rest: list[ReadItem] = []
        by_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            by_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in by_file.items():
            path = str(self.fs.concat_path(self.path, relative_path))
            # In the order the bytes lie in the file: one sequential pass, as a plain read makes.
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            with self.fs.create_stream(path, "rb") as stream:
                fd = stream.fileno()
                for req in reqs:
                    if not self._read_direct(stream, fd, path, req, planner):
                        rest.append(req)
        self.counts.direct += len(plan.items) - len(rest)
        self.counts.through_dcp += len(rest)
        if rest:
            super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_direct(self, stream: Any, fd: int, path: str, req: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``req`` straight into its target; False (nothing read) where DCP's path must do it."""
        info = self.storage_data[req.storage_index]
        if req.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or not target.is_contiguous():
            return False
        try:
            stored = _read_header(self._slice_file(stream, info))
        except (pickle.UnpicklingError, AttributeError, RuntimeError, ValueError, KeyError, TypeError):
            return False
        if stored is None or stored.dtype != target.dtype:
            return False
        span = _byte_range(stored, req.storage_offsets, req.lengths)
        if span is None:
            return False
        first, length = span
        start = stored.data_offset + first
        if length != target.numel() * target.element_size() or start + length > info.length:
            return False
        _read_into(fd, info.offset + start, target, path)
        planner.commit_tensor(req, target)
        return True


@contextlib.contextmanager
def direct_dcp_reads() -> Iterator[ReadCounts]:
    """Every ``FileSystemReader`` made inside (Accelerate's ``load_state`` makes its own) is a
    :class:`DirectReader`; yields their :class:`ReadCounts`. Only the name in
    ``torch.distributed.checkpoint`` is swapped, and it is restored on the way out."""
    counts = ReadCounts()
    bound = type("DirectReader", (DirectReader,), {"counts": counts})
    before = dcp.FileSystemReader
    dcp.FileSystemReader = bound  # type: ignore[misc,assignment]
    try:
        yield counts
    finally:
        dcp.FileSystemReader = before  # type: ignore[misc]
