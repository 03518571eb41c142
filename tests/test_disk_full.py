"""A full disk, for real: a small tmpfs mounted for the test (root only), filled to the last byte
(issue #35 item 6: `resume` died with a traceback, ENOSPC in run_lock.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.contract.errors import UserError
from orchestrator.contract.run_dir import RUN_LOCK_FILE
from orchestrator.core.run_lock import run_lock


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs with a run directory on it, then filled until writes fail with ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=16", "tmpfs", str(mnt)],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        run_dir = mnt / "run"
        run_dir.mkdir()
        yield run_dir
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill(folder: Path) -> None:
    with contextlib.suppress(OSError), open(folder / "filler", "wb") as fh:
        while True:
            fh.write(b"\0" * 65536)
            fh.flush()
    i = 0
    with contextlib.suppress(OSError):  # and every inode
        while True:
            (folder / f"f{i}").touch()
            i += 1


def test_run_lock_on_a_full_disk_holds_the_lock_without_a_traceback(full_disk: Path) -> None:
    (full_disk / RUN_LOCK_FILE).touch()  # the lock file a submit created, now with no room to write in
    _fill(full_disk)
    with run_lock(full_disk, what="resume"):
        pass  # the holder's line could not be written: the flock still locks


def test_run_lock_that_cannot_create_its_file_is_a_user_error(full_disk: Path) -> None:
    _fill(full_disk)
    with (
        pytest.raises(UserError, match="cannot lock run directory .*No space left on device"),
        run_lock(full_disk, what="resume"),
    ):
        pass
