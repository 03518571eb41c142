"""``orchestrator doctor`` in the Python API: check a profile's nodes before the first job
(:mod:`orchestrator.runner.doctor`). Re-exported as ``orchestrator.api.doctor``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.api import door
from orchestrator.config import inputs

if TYPE_CHECKING:
    from orchestrator.runner.doctor import DoctorResult


def doctor(
    profile: str,
    *,
    nodes: int | None = None,
    profiles_dir: Path | str | None = None,
) -> DoctorResult:
    """Run the doctor's short step on ``nodes`` nodes (default: the profile's ``nodes.default``);
    the result's ``ok`` says whether a job would run, ``diagnosis.rows`` each check with its fix."""
    from orchestrator.remote.routing import version
    from orchestrator.runner.doctor import run_doctor

    with door.door("doctor"):
        inputs.text("profile", profile, "a profile name or a YAML path (a non-empty string)")
        inputs.whole("nodes", nodes, 1)
        inputs.path_text("profiles_dir", profiles_dir, optional=True)
    return run_doctor(profile, version(), nodes, None if profiles_dir is None else str(profiles_dir))
