"""The run directory's permissions: owner-only (0700 directories, 0600 files) unless the profile's
``share_with_group`` opens them to the group (0750 / 0640); see :mod:`orchestrator.contract.run_dir`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def run_umask(share_with_group: bool = False) -> int:
    """The umask a run directory is made (and its job runs) under: owner-only unless shared."""
    return 0o027 if share_with_group else 0o077


def run_dir_mode(share_with_group: bool = False) -> int:
    return 0o777 & ~run_umask(share_with_group)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """Run the block under ``mask``; processes it starts (sbatch, local nodes) inherit it."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)
