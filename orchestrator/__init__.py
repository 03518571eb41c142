"""orchestrator: Accelerate training scripts from one machine to many Slurm nodes.

Importing the package imports neither torch nor accelerate (CLI start-up speed). The Python API
(:mod:`orchestrator.api`: ``orchestrator.submit``, ``orchestrator.sweep``, ``orchestrator.get_job``...)
is loaded on first use of one of its names.
"""

from __future__ import annotations

from typing import Any

#: Names of orchestrator.api reachable as orchestrator.<name>.
_API = frozenset(
    {"Job", "Sweep", "cancel", "dry_run", "get_job", "get_sweep", "make_plan", "resume", "submit", "sweep"}
)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # declared once, in the leaf orchestrator.version
        from orchestrator.version import __version__

        return __version__
    if name == "UserError":  # a user's mistake: one line, exit 2 (the README's API example)
        from orchestrator.contract.errors import UserError

        return UserError
    if name in _API:
        from orchestrator import api

        return getattr(api, name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
