"""The run's name: its first job's id, kept in ``<run_dir>/run_name`` and never rewritten.

A run can go on in new jobs (a requeue as a new job, an auto-resume, a ``resume``); every command
and the API take the first job's id for the whole run, and the node entry gives it to the script as
``$ORCHESTRATOR_RUN_NAME`` so that a script names its run after it (a requeue does not rename it).
Standard library only, like the rest of the contract.
"""

from __future__ import annotations

import os
from pathlib import Path

RUN_NAME_FILE = "run_name"


def name_run(run_dir: Path, job_id: str) -> None:
    """Record ``job_id`` as the run's name unless the run has one: the first submission names it,
    a requeue as a new job, an auto-resume or a ``resume`` into the same folder never renames it."""
    try:
        fd = os.open(Path(run_dir) / RUN_NAME_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as fh:
        fh.write(job_id)


def run_name(run_dir: Path, job_id: str) -> str:
    """The run's name; ``job_id`` (the asking job's own) when none is recorded yet: the first job
    may start before its submit has written the name, which is then its own id anyway."""
    try:
        return (Path(run_dir) / RUN_NAME_FILE).read_text().strip() or job_id
    except OSError:
        return job_id
