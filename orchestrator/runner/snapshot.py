"""``submit --snapshot``: the script's folder copied into the run directory, so later edits do not
change a queued job.

What is copied: the script's folder, or, when that folder is a package (it has ``__init__.py``),
the folder holding its outermost package, so ``train/train.py``'s ``from train import x`` finds
``train/`` in the copy as it did in the source. In a git checkout, the files git tracks under that
folder (as they are in the working tree) and the script itself; elsewhere, the folder without run directories,
checkpoints, caches and virtual environments. Symbolic links are copied as links, never followed:
a link into the folder stays relative, a link out of it points at the same absolute path it named
(nothing outside the folder is read or copied, and a link loop is just two links). Modes are the
run directory's (0700/0600, or 0750/0640 with ``share_with_group``), whatever the source's. More
than :data:`MAX_BYTES` is refused before anything is created, naming the largest files.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from orchestrator.contract.errors import UserError
from orchestrator.contract.permissions import run_dir_mode

#: Most bytes a snapshot may copy: source code, not data or checkpoints.
MAX_BYTES = 64 << 20
#: Folders never copied outside a git checkout: run directories, checkpoints, caches, environments.
SKIPPED_DIRS = frozenset(
    {
        ".git", "__pycache__", "runs", "outputs", "checkpoints", "wandb", "lightning_logs", "mlruns",
        ".cache", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", ".venv", "venv",
        "node_modules", ".tox", ".hypothesis",
    }
)  # fmt: skip
_SKIPPED_DIR_PREFIXES = ("checkpoint-", "step_", ".tmp-step_", "global_step")
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".egg-info", ".safetensors", ".pt", ".pth", ".ckpt", ".bin")
#: A folder holding one of these is a run directory (ours, or some other tool's).
_RUN_DIR_MARKERS = ("job.json", "local_state.json", "COMPLETE.json")


@dataclass(frozen=True)
class Snapshot:
    source: Path
    files: tuple[str, ...]
    """Paths relative to ``source``: regular files and symbolic links."""
    total_bytes: int
    from_git: bool
    script: str = ""
    """The script's path relative to ``source`` (``train/train.py`` when its folder is a package)."""


def _skipped_dir(folder: Path, name: str) -> bool:
    if name in SKIPPED_DIRS or name.startswith(_SKIPPED_DIR_PREFIXES) or name.endswith(_SKIPPED_SUFFIXES):
        return True
    return any((folder / name / marker).exists() for marker in _RUN_DIR_MARKERS)


def _git_files(source: Path) -> list[str] | None:
    """The tracked paths under ``source`` (relative to it), or None when it is no git checkout."""
    try:
        res = subprocess.run(
            ["git", "-C", str(source), "ls-files", "-z", "--cached"],  # relative to source, under it
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    names = [os.fsdecode(n) for n in res.stdout.split(b"\0") if n]
    # A folder git tracks nothing in (an untracked folder of some enclosing checkout, a home
    # directory kept in git) is no checkout of the script's project: walked instead.
    return sorted(set(names)) or None


def _walk(source: Path) -> list[str]:
    out: list[str] = []
    for folder, dirs, files in os.walk(source, followlinks=False, onerror=None):
        base = Path(folder)
        keep = []
        for d in sorted(dirs):
            if (base / d).is_symlink():
                out.append(str((base / d).relative_to(source)))  # copied as a link, never entered
            elif not _skipped_dir(base, d):
                keep.append(d)
        dirs[:] = keep
        out += [
            str((base / f).relative_to(source)) for f in sorted(files) if not f.endswith(_SKIPPED_SUFFIXES)
        ]
    return out


def plan_snapshot(script: str | Path, max_bytes: int = MAX_BYTES) -> Snapshot:
    """What ``--snapshot`` of ``script`` would copy; refuses (UserError) more than ``max_bytes``."""
    script = Path(script).absolute()
    source = script.parent.resolve()
    while (source / "__init__.py").is_file() and source.parent != source:  # keep the package's folder
        source = source.parent
    relative = str(script.parent.resolve().relative_to(source) / script.name)
    tracked = _git_files(source)
    names = tracked if tracked is not None else _walk(source)
    if relative not in names:
        names = [*names, relative]  # a new, untracked script still runs from its snapshot
    files: list[str] = []
    sizes: list[tuple[int, str]] = []
    for name in names:
        try:
            st = (source / name).lstat()
        except OSError:
            continue  # tracked but deleted in the working tree
        if stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode):
            files.append(name)
            if stat.S_ISREG(st.st_mode):
                sizes.append((st.st_size, name))
    total = sum(size for size, _ in sizes)
    if total > max_bytes:
        largest = ", ".join(f"{n} ({s / 2**20:.1f} MiB)" for s, n in sorted(sizes, reverse=True)[:3])
        what = "files git tracks under" if tracked is not None else "files in"
        why = ""
        if source != script.parent.resolve():  # climbed out of a package: say why that folder
            why = f" (the folder holding the package {relative.split('/', 1)[0]}/, which has __init__.py)"
        raise UserError(
            f"--snapshot: the {what} {source}{why} come to {total / 2**20:.1f} MiB, over the "
            f"{max_bytes / 2**20:.0f} MiB limit (largest: {largest}); move data and checkpoints out of "
            "the script's folder, or submit without --snapshot"
        )
    return Snapshot(source, tuple(files), total, tracked is not None, relative)


def _link_target(link: Path, source: Path) -> str:
    """Where the copy of ``link`` points: the same relative path when it stays in ``source``, else
    the absolute path it named (not resolved further: a loop stays a loop, never followed)."""
    target = os.readlink(link)
    absolute = Path(os.path.normpath(link.parent / target))
    try:
        absolute.relative_to(source)
    except ValueError:
        return str(absolute)
    return target if not os.path.isabs(target) else os.path.relpath(absolute, link.parent)


def copy_snapshot(snap: Snapshot, target: Path, share_with_group: bool = False) -> None:
    """Copy ``snap`` into ``target`` (created), with the run directory's modes; a failure is a
    UserError naming the file."""
    dir_mode = run_dir_mode(share_with_group)
    file_mode = dir_mode & 0o666
    try:
        target.mkdir(mode=dir_mode)
        os.chmod(target, dir_mode)
        for name in snap.files:
            src, dst = snap.source / name, target / name
            for parent in reversed(dst.relative_to(target).parents[:-1]):
                folder = target / parent
                if not folder.exists():
                    folder.mkdir(mode=dir_mode)
                    os.chmod(folder, dir_mode)
            if src.is_symlink():
                os.symlink(_link_target(src, snap.source), dst)
                continue
            executable = os.stat(src).st_mode & stat.S_IXUSR
            with open(src, "rb") as fin:
                fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, file_mode)
                with os.fdopen(fd, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
            os.chmod(dst, dir_mode if executable else file_mode)
    except OSError as exc:
        where = exc.filename or target
        raise UserError(f"--snapshot: cannot copy {where}: {exc.strerror or exc}") from None
