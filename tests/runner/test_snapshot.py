"""``submit --snapshot`` (orchestrator/runner/snapshot.py): links copied as links and never followed,
the run directory's modes whatever the source's, git-aware, bounded, and a refusal that leaves
nothing behind (issue #35 item 5, issue #27 item 11)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from orchestrator.contract.errors import UserError
from orchestrator.registry.store import Registry
from orchestrator.runner.snapshot import copy_snapshot, plan_snapshot
from tests.helpers.cli import job_and_run_dir, run_cli

SCRIPT = "import sys\nprint('snapshot ran', sys.argv[1:])\n"


def _project(tmp_path: Path) -> Path:
    src = tmp_path / "proj"
    src.mkdir()
    (src / "train_me.py").write_text(SCRIPT)
    (src / "lib").mkdir()
    (src / "lib" / "util.py").write_text("X = 1\n")
    return src


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            if not p.is_symlink():
                out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    out["."] = stat.S_IMODE(root.stat().st_mode)
    return out


def test_links_are_copied_as_links_and_never_followed(tmp_path: Path) -> None:
    src = _project(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy me")
    (src / "leak").symlink_to(secret)
    (src / "outside_dir").symlink_to(tmp_path)  # a folder out of the tree: never entered
    (src / "inside").symlink_to("lib/util.py")
    (src / "loop_a").symlink_to("loop_b")
    (src / "loop_b").symlink_to("loop_a")
    (src / "self_dir").symlink_to(".")  # a loop through a folder
    target = tmp_path / "run" / "snapshot"
    target.parent.mkdir()
    copy_snapshot(plan_snapshot(src / "train_me.py"), target)
    assert os.readlink(target / "leak") == str(secret)
    assert os.readlink(target / "inside") == "lib/util.py"
    assert (target / "inside").read_text() == "X = 1\n"
    assert os.readlink(target / "loop_a") == "loop_b" and os.readlink(target / "self_dir") == "."
    copied = [p for p in target.rglob("*") if not p.is_symlink() and p.is_file()]
    assert all("do not copy me" not in p.read_text() for p in copied)
    assert not any(
        p.is_symlink()
        for p in target.iterdir()
        if p.name not in {"leak", "outside_dir", "inside", "loop_a", "loop_b", "self_dir"}
    )


def test_modes_are_owner_only_whatever_the_source(tmp_path: Path) -> None:
    src = _project(tmp_path)
    os.chmod(src, 0o1777)
    os.chmod(src / "lib", 0o777)
    os.chmod(src / "lib" / "util.py", 0o666)
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    target = tmp_path / "snapshot"
    copy_snapshot(plan_snapshot(src / "train_me.py"), target)
    modes = _modes(target)
    assert modes == {".": 0o700, "lib": 0o700, "lib/util.py": 0o600, "train_me.py": 0o600, "run.sh": 0o700}
    shared = tmp_path / "shared"
    copy_snapshot(plan_snapshot(src / "train_me.py"), shared, share_with_group=True)
    assert _modes(shared)["lib/util.py"] == 0o640 and _modes(shared)["."] == 0o750


def test_outside_git_run_dirs_checkpoints_and_caches_are_left_out(tmp_path: Path) -> None:
    src = _project(tmp_path)
    for folder in ("checkpoints/step_00000010", "out/checkpoint-50", ".tmp-step_3", "__pycache__", ".venv/lib",
                   "wandb/run-1", "old_run/logs"):  # fmt: skip
        (src / folder).mkdir(parents=True)
        (src / folder / "f.bin").write_bytes(b"x" * 10)
    (src / "old_run" / "job.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"x")
    snap = plan_snapshot(src / "train_me.py")
    assert not snap.from_git
    assert sorted(snap.files) == ["lib/util.py", "train_me.py"]


def test_in_a_git_checkout_only_tracked_files_and_the_script(tmp_path: Path) -> None:
    src = _project(tmp_path)
    git = ["git", "-C", str(src), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=30)
    subprocess.run([*git, "add", "lib/util.py"], check=True, timeout=30)
    subprocess.run([*git, "commit", "-qm", "x"], check=True, timeout=30)
    (src / "notes.txt").write_text("untracked")
    (src / "lib" / "util.py").write_text("X = 2\n")  # the working tree's bytes, not HEAD's
    snap = plan_snapshot(src / "train_me.py")
    assert snap.from_git and sorted(snap.files) == ["lib/util.py", "train_me.py"]
    copy_snapshot(snap, tmp_path / "snapshot")
    assert (tmp_path / "snapshot" / "lib" / "util.py").read_text() == "X = 2\n"


def test_too_large_a_folder_is_refused_naming_the_largest_file(tmp_path: Path) -> None:
    src = _project(tmp_path)
    (src / "data.csv").write_bytes(b"x" * 3000)
    with pytest.raises(UserError, match=r"over the .* limit \(largest: data.csv"):
        plan_snapshot(src / "train_me.py", max_bytes=2000)


@pytest.mark.usefixtures("reap_local_jobs")
def test_cli_symlink_loop_and_outside_link_on_a_real_local_job(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """The symlink loop that gave a 3 KB Python list and an interrupted submission now submits
    (links are links); the outside link stays a link in the run directory."""
    src = _project(tmp_path)
    (src / "loop_a").symlink_to("loop_b")
    (src / "loop_b").symlink_to("loop_a")
    (src / "loopdir").symlink_to(src)
    (src / "shadow").symlink_to("/etc/shadow")
    os.chmod(src, 0o1777)
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "1", "--snapshot",
         "--", str(src / "train_me.py"), "hello"],
        orch_env,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    _, run_dir = job_and_run_dir(res.stdout)
    snap = run_dir / "snapshot"
    assert os.readlink(snap / "shadow") == "/etc/shadow" and os.readlink(snap / "loopdir") == "."
    assert stat.S_IMODE(snap.stat().st_mode) == 0o700
    assert stat.S_IMODE((snap / "train_me.py").stat().st_mode) == 0o600
    registry = Registry.open(Path(orch_env["ORCHESTRATOR_HOME"]))
    assert not registry.has_pending_submissions()


def test_cli_refusal_leaves_no_run_directory_and_no_open_submission(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    src = _project(tmp_path)
    (src / "big.bin.txt").write_bytes(b"\0" * (65 << 20))
    res = run_cli(
        ["submit", "--profile", "local", "--snapshot", "--", str(src / "train_me.py")], orch_env, timeout=60
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert "big.bin.txt" in res.stderr and "without --snapshot" in res.stderr
    runs = Path(orch_env["ORCHESTRATOR_RUNS"])
    assert not runs.exists() or not any(runs.iterdir())
    assert not Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])).has_pending_submissions()


def test_a_script_in_a_package_keeps_its_folder(tmp_path: Path) -> None:
    """``train/train.py`` with ``train/__init__.py``: the folder holding the package is the snapshot's,
    the script keeps its place in it (``from train import x`` finds ``train/``), and a refusal says why
    that folder was taken."""
    (tmp_path / "proj" / "train" / "inner").mkdir(parents=True)
    for name in ("train/__init__.py", "train/inner/__init__.py", "train/inner/run.py", "README"):
        (tmp_path / "proj" / name).write_text("")
    snap = plan_snapshot(tmp_path / "proj" / "train" / "inner" / "run.py")
    assert snap.source == (tmp_path / "proj").resolve() and snap.script == "train/inner/run.py"
    assert {"train/__init__.py", "train/inner/run.py", "README"} <= set(snap.files)
    copy_snapshot(snap, tmp_path / "snapshot")
    assert (tmp_path / "snapshot" / "train" / "inner" / "run.py").is_file()
    (tmp_path / "proj" / "data.csv").write_bytes(b"x" * 3000)
    with pytest.raises(UserError, match=r"holding the package train/, which has __init__.py\) come to"):
        plan_snapshot(tmp_path / "proj" / "train" / "inner" / "run.py", max_bytes=2000)
