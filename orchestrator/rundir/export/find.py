"""Which checkpoint ``export`` reads: the run's one checkpoint vocabulary, read-only (no torch).

The rule for "complete" is :func:`orchestrator.contract.run_dir.check_checkpoint` (the marker and
every listed file's size), then the marker's sha256 digests
(:func:`orchestrator.contract.checkpoints.check_checkpoint_content`): an export is a copy that leaves
the cluster, so its bytes are checked once, as a restore checks them. Unlike a restore, nothing is
written into the run directory (no ``CORRUPT.json``): an export may run as another user, on a
read-only mount.

Candidates are the run's ``checkpoints/step_*`` folders and the ``checkpoint-N`` folders its Trainer
hook recorded (``checkpoint_dirs.json``) whose marker names this run; a torn hook folder counts as
this run's when the hook recorded that it began saving that step there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract.checkpoints import check_checkpoint_content
from orchestrator.contract.errors import UserError
from orchestrator.contract.hook_checkpoints import hook_steps_being_saved, run_identity
from orchestrator.contract.jsonfiles import read_json
from orchestrator.contract.run_dir import (
    COMPLETE_MARKER,
    all_checkpoint_folders,
    check_checkpoint,
)


@dataclass(frozen=True)
class Chosen:
    """The checkpoint an export reads, and the lines saying which newer ones were skipped."""

    path: Path
    step: int
    marker: dict[str, Any]
    skipped: list[str] = field(default_factory=list)


def why_incomplete(folder: Path) -> tuple[dict[str, Any] | None, str]:
    """``(marker, "")`` when ``folder`` is complete and its bytes match the marker's digests."""
    marker, why = check_checkpoint(folder)
    if marker is None:
        return None, why
    bad = check_checkpoint_content(folder, marker)
    if bad:
        return None, f"its content does not match {COMPLETE_MARKER}: {bad}"
    return marker, ""


def _candidates(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's checkpoint folders, newest first: its own, and its hook's that are this run's."""
    own = run_identity(run_dir)
    found = []
    for step, path, in_run_dir in all_checkpoint_folders(run_dir):
        if not in_run_dir:
            writer = (read_json(path / COMPLETE_MARKER) or {}).get("run")
            ours = writer == own or (writer is None and step in hook_steps_being_saved(run_dir, path.parent))
            if not ours:
                continue
        found.append((step, path))
    return found


def choose_checkpoint(
    run_dir: Path | None,
    step: int | None = None,
    checkpoint: Path | None = None,
    say: Callable[[str], None] | None = None,
) -> Chosen:
    """The checkpoint to export: ``checkpoint`` itself, the run's checkpoint of ``step``, or the newest
    complete one (each newer torn one named in :attr:`Chosen.skipped`). Refuses (``UserError``) a
    folder that is not complete, whichever way it was named: an export never reads a torn save."""
    if checkpoint is not None:
        folder = Path(checkpoint)
        if not folder.is_dir():
            raise UserError(f"--checkpoint {folder}: no such folder")
        marker, why = why_incomplete(folder)
        if marker is None:
            raise UserError(f"--checkpoint {folder}: not a complete checkpoint ({why})")
        return Chosen(folder, int(marker["step"]), marker)
    if run_dir is None:
        raise UserError("name a RUN|JOB (a job id or a run directory) or give --checkpoint PATH")
    candidates = _candidates(run_dir)
    if step is not None:
        same = [path for s, path in candidates if s == step]
        if not same:
            steps = ", ".join(str(s) for s, _ in candidates) or "none"
            raise UserError(f"--step {step}: run {run_dir} has no checkpoint of that step (steps: {steps})")
        reasons = []
        for folder in same:
            marker, why = why_incomplete(folder)
            if marker is not None:
                return Chosen(folder, step, marker)
            reasons.append(f"{folder}: {why}")
        raise UserError(
            f"--step {step}: checkpoint not complete, refusing to export it ({'; '.join(reasons)})"
        )
    skipped: list[str] = []
    for s, folder in candidates:
        marker, why = why_incomplete(folder)
        if marker is not None:
            return Chosen(folder, s, marker, skipped)
        line = f"skipping checkpoint {folder} (step {s}): {why}"
        skipped.append(line)
        if say is not None:
            say(line)
    where = ", ".join(str(p) for _, p in candidates) or f"{run_dir}/checkpoints"
    raise UserError(f"run {run_dir}: no complete checkpoint to export (looked at {where})")
