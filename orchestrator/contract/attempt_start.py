"""What an attempt's training started from, and the words the node log and ``status`` use for it.

A script with a checkpoint hook (``train/``, :mod:`orchestrator.loop`, :mod:`orchestrator.hf`) writes
``logs/attempt_<A>/start.json`` from rank 0 once it has restored (or found nothing to restore). A
script without one writes nothing, and then a requeued attempt trained from step 0 again: that is
said as such, never as a resume. Standard library only (the node entry and ``status`` read it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from orchestrator.contract.env import ATTEMPT_ENV, RUN_DIR_ENV
from orchestrator.contract.run_dir import (
    ATTEMPT_START_FILE,
    attempt_dir,
    attempt_dirs,
    last_complete_checkpoint,
    read_json,
    requeue_recorded_since,
    write_json_atomic,
)

#: The words for an attempt that trained again from step 0 because nothing could restore it.
NO_HOOK = "restarted from step 0: the script has no checkpoint hook"
#: The words for an attempt of a script that has a hook (another attempt wrote its record) which ended
#: before its rank 0 restored: a stop, a budget or a fault during start-up. It trained nothing.
ENDED_IN_START_UP = "ended during start-up, before it restored: it trained no step"


def write_attempt_start(
    step: int, checkpoint: str | None, hook: str, run_dir: Path | None = None, memory: bool = False
) -> None:
    """Rank 0, after restoring. The attempt comes from ``ORCHESTRATOR_ATTEMPT`` (set by the node entry);
    outside a job (no run directory or attempt in the environment) nothing is written. ``memory``:
    restored from the ranks' memory checkpoints of ``step`` (``contract/memory_checkpoints.py``), not a file
    of the run directory; ``checkpoint`` then names what a reader shows."""
    attempt = os.environ.get(ATTEMPT_ENV, "")
    root = run_dir or (Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None)
    if root is None or not attempt.isdigit():
        return
    folder = attempt_dir(root, int(attempt))
    folder.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"step": step, "checkpoint": checkpoint, "hook": hook}
    if memory:
        record.update(checkpoint=f"memory checkpoint of step {step}", memory=True)
    write_json_atomic(folder / ATTEMPT_START_FILE, record)


def read_attempt_start(run_dir: Path, attempt: int) -> dict[str, Any] | None:
    return read_json(attempt_dir(run_dir, attempt) / ATTEMPT_START_FILE)


def describe_start(run_dir: Path, attempt: int, first_attempt: int) -> str | None:
    """How ``attempt`` started, for the node log and ``status``; None for the run's first attempt
    without a hook (nothing to say: it started from scratch as it should)."""
    record = read_attempt_start(run_dir, attempt)
    if record is None:
        if attempt <= first_attempt:
            return None
        hooked = any(
            read_attempt_start(run_dir, a) is not None for a, _ in attempt_dirs(run_dir) if a != attempt
        )
        return ENDED_IN_START_UP if hooked else NO_HOOK
    step, checkpoint = record.get("step"), record.get("checkpoint")
    if record.get("memory") is True:
        return f"resumed at step {step} from the nodes' memory checkpoints ({record.get('hook', '?')} hook)"
    if checkpoint:
        return f"resumed at step {step} from {Path(str(checkpoint)).name} ({record.get('hook', '?')} hook)"
    if attempt <= first_attempt:
        return None
    return f"restarted from step 0: no complete checkpoint to resume from ({record.get('hook', '?')} hook)"


def describe_newest_start(run_dir: Path) -> str | None:
    """:func:`describe_start` for the newest attempt that has ended (its node 0 wrote an exit file) or
    has a start record: an attempt still importing its script has not said anything yet."""
    attempts = attempt_dirs(run_dir)
    if len(attempts) < 2:
        return None
    first = attempts[0][0]
    for attempt, path in reversed(attempts):
        if (path / ATTEMPT_START_FILE).exists() or any(path.glob("node_*.exit")):
            return describe_start(run_dir, attempt, first)
    return None


def signal_stop_words(run_dir: Path, attempt: int) -> tuple[str, str]:
    """The words for ``attempt``, which stopped for a requeue: its state's reason, and what a user's
    ``cancel`` says of the stop. It checkpointed on the signal when rank 0's requeue record (its last
    word, ``exit_status.json``) was written after this attempt's start record. A signal
    that came in start-up, before a script's handler or its first step (or to a script without a
    hook), stops it with nothing new saved: the words then say what a resume would continue from,
    and never claim a checkpoint."""
    start = attempt_dir(run_dir, attempt) / ATTEMPT_START_FILE
    if start.exists() and requeue_recorded_since(run_dir, start.stat().st_mtime):
        return "checkpointed on a signal and stopped", "checkpointed and stopped"
    newest = last_complete_checkpoint(run_dir)
    if newest is None:
        return "stopped on a signal before its first checkpoint: there is nothing to resume from", (
            "stopped before its first checkpoint"
        )
    return f"stopped on a signal before it checkpointed: a resume continues from {newest.path.name}", (
        "stopped before it checkpointed"
    )
