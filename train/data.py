"""Training data: every batch is a pure function of (seed, sample index).

A *sample index* is global: optimizer step ``s`` (with ``samples_before`` samples
already consumed), micro-step ``m``, rank ``r`` and row ``j`` read sample
``samples_before + (m * world + r) * batch + j``. Each sample comes from a
``torch.Generator`` seeded from (seed, split, index) alone, so

* every strategy at the same world size sees exactly the same samples,
* a resumed run continues with exactly the samples the uninterrupted run would
  have read (the data position, ``samples_seen``, is in the checkpoint),
* a run resumed at another world size carries on from the same global position
  (no sample read twice or skipped), even though the rows land on other ranks.

Sources: ``text`` (default) is the Python standard library's own ``.py`` files
read as bytes (vocab 256), split into train/val by a hash of the file path;
``synthetic`` is noisy arithmetic byte sequences, quick to learn, for tests.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

VOCAB_SIZE = 256
_MASK63 = (1 << 63) - 1
_SPLIT_SALT = {"train": 0x5EED_0001, "val": 0x5EED_0002}


def sample_seed(seed: int, split: str, index: int) -> int:
    """A 63-bit seed from (seed, split, index) (splitmix64 finaliser: neighbours differ everywhere)."""
    z = (seed * 0x9E3779B97F4A7C15 + _SPLIT_SALT[split] * 0xBF58476D1CE4E5B9 + index) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


def stdlib_files() -> list[tuple[str, Path]]:
    """The standard library's .py files (no site-packages), as (relative path, path), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    return found


def is_val_file(relpath: str) -> bool:
    """About 1 file in 20 is validation, decided by the path alone (stable across machines)."""
    return zlib.crc32(relpath.encode()) % 20 == 0


class Source(Protocol):
    """What :class:`Batcher` draws from: :class:`TextSource` or :class:`SyntheticSource`."""

    def sample(self, gen: torch.Generator, split: str, seq_len: int) -> torch.Tensor: ...


class TextSource:
    """Random windows of the standard library's source bytes."""

    name = "text"

    def __init__(self) -> None:
        train, val = bytearray(), bytearray()
        for rel, path in stdlib_files():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            (val if is_val_file(rel) else train).extend(data + b"\n\n")
        if len(val) < 10_000 or len(train) < 100_000:
            raise RuntimeError("text data: too little standard-library source found; use --data synthetic")
        self.splits = {
            "train": torch.frombuffer(train, dtype=torch.uint8),
            "val": torch.frombuffer(val, dtype=torch.uint8),
        }

    def sample(self, gen: torch.Generator, split: str, seq_len: int) -> torch.Tensor:
        data = self.splits[split]
        start = int(torch.randint(0, data.numel() - seq_len - 1, (1,), generator=gen))
        return data[start : start + seq_len + 1].long()


class SyntheticSource:
    """x[t] = (a + k*t) mod 256 with 10% of the tokens replaced by noise: learnable in a few steps."""

    name = "synthetic"

    def sample(self, gen: torch.Generator, split: str, seq_len: int) -> torch.Tensor:
        a = torch.randint(0, VOCAB_SIZE, (1,), generator=gen)
        k = torch.randint(1, 17, (1,), generator=gen)
        seq = (a + k * torch.arange(seq_len + 1)) % VOCAB_SIZE
        noise = torch.randint(0, VOCAB_SIZE, (seq_len + 1,), generator=gen)
        mask = torch.rand(seq_len + 1, generator=gen) < 0.1
        return torch.where(mask, noise, seq).long()


def make_source(kind: str) -> Source:
    if kind == "text":
        return TextSource()
    if kind == "synthetic":
        return SyntheticSource()
    raise ValueError(f"--data: expected text or synthetic, got {kind!r}")


@dataclass
class Batcher:
    source: Source
    seed: int
    seq_len: int
    batch_size: int
    """Per process."""
    world_size: int
    rank: int
    grad_accum: int = 1

    @property
    def global_batch(self) -> int:
        """Samples consumed by one optimizer step, all ranks and micro-steps together."""
        return self.batch_size * self.world_size * self.grad_accum

    def indices(self, samples_before: int, micro: int) -> list[int]:
        first = samples_before + (micro * self.world_size + self.rank) * self.batch_size
        return list(range(first, first + self.batch_size))

    def rows(self, split: str, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator()
        rows = []
        for index in indices:
            gen.manual_seed(sample_seed(self.seed, split, index))
            rows.append(self.source.sample(gen, split, self.seq_len))
        batch = torch.stack(rows)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def train_batch(self, samples_before: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows("train", self.indices(samples_before, micro))

    def val_batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch ``i`` of this rank: the same fixed samples at every step."""
        return self.rows("val", self.indices(i * self.world_size * self.batch_size, 0))
