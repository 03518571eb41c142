"""Checkpoints a library writes outside the run directory, recorded in it (standard library only).

A Hugging Face ``Trainer`` writes ``checkpoint-N`` folders into its ``output_dir``. Rank 0 of the hook
(:mod:`orchestrator.hf`) records that folder in the run directory's ``checkpoint_dirs.json``, and the
step it is about to save there, so that the login side (``resume``, ``status``, preflight, auto-resume)
finds the run's checkpoints by the one rule of :func:`orchestrator.contract.run_dir.check_checkpoint`,
and so that a torn folder of this run is told from another run's. A marker names the run that wrote it
(:func:`run_identity`); only this run's folders count.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from orchestrator.contract.jsonfiles import read_json, write_json_atomic

CHECKPOINT_DIRS_FILE = "checkpoint_dirs.json"
#: Transformers' checkpoint folders in a Trainer's output_dir.
HOOK_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def run_identity(run_dir: str | os.PathLike[str]) -> str:
    """How a checkpoint marker names the run that wrote it: the run directory's resolved path."""
    return str(Path(run_dir).resolve())


def hook_checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The folders outside the run directory where this run's hook recorded checkpoints go
    (``checkpoint_dirs.json``)."""
    data = read_json(Path(run_dir) / CHECKPOINT_DIRS_FILE) or {}
    dirs = data.get("dirs")
    return [Path(d) for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else []


def record_hook_checkpoint_dir(
    run_dir: Path, folder: Path, hook: str, saving: int | None = None, saved: int | None = None
) -> None:
    """Rank 0 of a hook: ``folder`` holds this run's checkpoints; ``saving``: the step whose folder is
    about to be written there (a torn one is still this run's), ``saved``: the step now marked."""
    path = Path(run_dir) / CHECKPOINT_DIRS_FILE
    data = read_json(path) or {}
    key = str(Path(folder).resolve())
    dirs = [d for d in data.get("dirs", []) if isinstance(d, str)]
    if key not in dirs:
        dirs.append(key)
    recorded = data.get("saving")
    pending: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    steps = {int(s) for s in pending.get(key, []) if isinstance(s, int)}
    if saving is not None:
        steps.add(saving)
    if saved is not None:
        steps.discard(saved)
    pending[key] = sorted(steps)
    write_json_atomic(path, {"dirs": dirs, "saving": pending, "hook": hook})


def hook_steps_being_saved(run_dir: Path, folder: Path) -> set[int]:
    """Steps of ``folder`` this run began to save and has not marked complete (torn, or in progress)."""
    data = read_json(Path(run_dir) / CHECKPOINT_DIRS_FILE) or {}
    saving = data.get("saving")
    steps = saving.get(str(Path(folder).resolve()), []) if isinstance(saving, dict) else []
    return {s for s in steps if isinstance(s, int)} if isinstance(steps, list) else set()


def hook_checkpoint_folders(folder: Path) -> list[tuple[int, Path]]:
    """``[(step, folder)]`` of the ``checkpoint-N`` folders in ``folder``, newest first (not checked)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    found = [
        (int(m.group(1)), Path(e.path))
        for e in entries
        if (m := HOOK_CHECKPOINT_RE.match(e.name)) and e.is_dir()
    ]
    return sorted(found, reverse=True)
