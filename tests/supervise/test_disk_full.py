"""A full disk, for real: a small tmpfs mounted for the test (root only), filled to the last byte
(issue #35 item 6). Before: `resume` died with a traceback (ENOSPC in run_lock.py); `status` said only
torch.save's "basic_ios::clear: iostream error"; the failed save's `.tmp-step_*` folder stayed.

Why a node log was cut at 4096 bytes: no buffering of ours (the node log is written unbuffered); a
file on a full filesystem grows only into the blocks it already holds (tmpfs: 4 KiB pages), then
every write fails with ENOSPC. The failed save now gives its room back before its error travels on,
so the rank's traceback and the launcher's and node's last lines reach the log; where the disk stays
full, the failure report says so from the free space (``orchestrator.supervise.disk_full``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.contract.checkpoints import removed_if_unfinished, temp_folder
from orchestrator.contract.errors import UserError
from orchestrator.contract.run_dir import RUN_LOCK_FILE, check_checkpoint
from orchestrator.rundir.lock import run_lock
from orchestrator.supervise.failure_report import explain_failure
from tests.helpers.cli import REPO, job_and_run_dir, kill_tree, run_cli


@contextlib.contextmanager
def _tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs with a run directory on it, then filled until writes fail with ENOSPC."""
    with _tmpfs(tmp_path / "mnt", "size=1m,nr_inodes=16") as mnt:
        run_dir = mnt / "run"
        run_dir.mkdir()
        yield run_dir


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


def _flocked(lock_file: Path) -> bool:
    """Someone holds a flock on ``lock_file``: another open file of it cannot take one."""
    with open(lock_file, "rb") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def test_run_lock_on_a_full_disk_holds_the_lock_without_a_traceback(full_disk: Path) -> None:
    (full_disk / RUN_LOCK_FILE).touch()  # the lock file a submit created, now with no room to write in
    _fill(full_disk)
    with run_lock(full_disk, what="resume"):
        # the holder's line could not be written: the flock still locks
        assert _flocked(full_disk / RUN_LOCK_FILE)
    assert not _flocked(full_disk / RUN_LOCK_FILE)


def test_run_lock_that_cannot_create_its_file_is_a_user_error(full_disk: Path) -> None:
    _fill(full_disk)
    with (
        pytest.raises(UserError, match="cannot lock run directory .*No space left on device"),
        run_lock(full_disk, what="resume"),
    ):
        pass


def test_a_failed_save_removes_its_folder_and_names_the_full_disk(
    full_disk: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    tmp = temp_folder(full_disk, 10, "abcd1234")
    tmp.mkdir(parents=True)
    with (
        pytest.raises(OSError, match="No space left on device"),
        removed_if_unfinished(tmp),
        open(tmp / "optimizer.bin", "wb") as fh,  # a writer's real ENOSPC
    ):
        while True:
            fh.write(b"\1" * 65536)
    assert not tmp.exists()  # its room given back
    assert (
        "checkpoint step_00000010 not saved: No space left on device (0 bytes free" in capfd.readouterr().err
    )


def test_a_full_filesystem_is_named_when_no_log_could_say_it(full_disk: Path) -> None:
    """A log cut by the full disk holds no ENOSPC line: the free space tells."""
    attempt = full_disk / "logs" / "attempt_0"
    attempt.mkdir(parents=True)
    (attempt / "node_0.log").write_text(
        "[default0]:[rank0]: Traceback (most recent call last):\n"
        '[default0]:[rank0]:   File "torch/serialization.py", line 1312, in _save\n'
        "[default0]:[rank0]: RuntimeError: basic_ios::clear: iostream error\n"
    )
    (attempt / "node_0.exit").write_text("1")
    _fill(full_disk)
    why = explain_failure(full_disk, "local-1")
    assert why is not None and why.disk is not None, why
    assert why.summary().startswith(
        "node 0 rank 0 failed: the run directory's filesystem is full; its logs may be cut (0 B of 1.0 MiB free"
    ), why.summary()


# ------------------------------------------------------------------------- a real local job
#: The tiny preset's DDP checkpoint takes ~10.1 MiB (model.safetensors 3.4 + optimizer.bin 6.9): on
#: 16 MiB the step-5 checkpoint fits and the step-10 one cannot (the first is kept: keep_last 2).
SMALL_DISK = "size=16m"
TRAIN = ["--", str(REPO / "train" / "train.py"), "--preset", "tiny", "--data", "synthetic", "--max-steps", "10",
         "--ckpt-every", "5"]  # fmt: skip


@pytest.fixture
def small_disk_env(tmp_path: Path, orch_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """Run directories on a 16 MiB tmpfs, the registry off it (a user's home is on another disk);
    every local job started is killed before the unmount."""
    with _tmpfs(tmp_path / "small", SMALL_DISK) as mnt:
        env = {**orch_env, "ORCHESTRATOR_RUNS": str(mnt / "runs")}
        try:
            yield env
        finally:
            for pids in (mnt / "runs").glob("*/local_pids.json"):
                for pid in json.loads(pids.read_text()).values():
                    kill_tree(int(pid))


def test_local_job_on_a_full_disk_fails_named_clean_and_resumes(small_disk_env: dict[str, str]) -> None:
    env = small_disk_env
    res = run_cli(["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--strategy", "ddp",
                   "--wait", "--poll", "0.3", *TRAIN], env, timeout=120)  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    ckpts = run_dir / "checkpoints"
    assert check_checkpoint(ckpts / "step_00000005")[0] is not None, "the first checkpoint must fit"
    assert not (ckpts / "step_00000010").exists()
    assert "No space left on device" in res.stdout, res.stdout

    # The failure names the full disk, not only torch.save's "basic_ios::clear: iostream error".
    job = json.loads(run_cli(["status", "--json", job_id], env, timeout=60).stdout)["jobs"][0]
    assert job["state"] == "FAILED", job
    assert (
        job["reason"].startswith("node 0 rank 0 failed: ") and "No space left on device" in job["reason"]
    ), job
    mnt = run_dir.parents[1]
    assert f"MiB of 16.0 MiB free on {mnt} after the failure" in job["reason"], job["reason"]
    # The failed save gave its room back: no temp folder, and the important lines reached the node log
    # (the rank's traceback, the launcher's and the node's own last line) instead of stopping at 4 KiB.
    assert not list(ckpts.glob(".tmp-*")), list(ckpts.iterdir())
    log = (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    assert "basic_ios::clear: iostream error" in log and "rank 0 (local 0) exited with code 1" in log, log
    # The node's exit line, then (max_restarts: the launcher was kept) node 0's word: not restarted.
    last = log.splitlines()[-3:]
    assert last[0].startswith("[orchestrator node] host=") and " exit=1 " in last[0], last
    assert last[1:] == [
        "[orchestrator node] launcher kept: waiting for the word to start the ranks again",
        "[orchestrator node] not restarted in place: the disk is full",
    ], last

    # Room again. A temp folder as a kill mid-save leaves it (no clean-up runs): gone once the next
    # attempt starts, and never resumed from; the newest complete checkpoint is.
    subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True, timeout=30)
    killed = ckpts / ".tmp-step_00000010-deadbeef"
    killed.mkdir()
    (killed / "optimizer.bin").write_bytes(b"\0" * 4096)
    res = run_cli(["resume", job_id, "--wait", "--poll", "0.3"], env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    start = json.loads((run_dir / "logs" / "attempt_1" / "start.json").read_text())
    assert start["step"] == 5 and start["checkpoint"].endswith("step_00000005"), start
    assert not killed.exists() and not list(ckpts.glob(".tmp-*"))
    assert (
        "removed unfinished checkpoint .tmp-step_00000010-deadbeef"
        in (run_dir / "logs" / "attempt_1" / "node_0.log").read_text()
    )
    assert check_checkpoint(ckpts / "step_00000010")[0] is not None


def test_a_rank_log_the_disk_refuses_never_stops_the_launchers_relay(full_disk: Path) -> None:
    """The node launcher relays each rank's output to its log and the node log; on a full disk the
    log's write raised ENOSPC out of the relay and the launcher stopped supervising its ranks (seen in
    a 2-node run's node_1.log). What the disk refuses is lost; the relay and the close go on."""
    import io
    import selectors

    from orchestrator.node.direct_launch import _Rank

    log = open(full_disk / "rank_0.log", "ab")  # noqa: SIM115 (closed by _Rank.close)
    _fill(full_disk)
    read_end, write_end = os.pipe()
    rank = _Rank(0, 0, os.getpid(), read_end, log)
    out = io.BytesIO()
    rank.relay(b"x" * 100_000 + b"\nthe last line\npartial", out)
    assert out.getvalue().endswith(b"[default0]:the last line\n")
    sel = selectors.DefaultSelector()
    sel.register(read_end, selectors.EVENT_READ)
    rank.close(out, sel)
    os.close(write_end)
    assert out.getvalue().endswith(b"[default0]:partial\n") and not rank.open
