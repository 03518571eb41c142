"""The API's door: every public function and handle method checks each argument here first, with
the CLI's checks (:mod:`orchestrator.config.inputs`), before it opens a registry or touches a run.

A refused argument is a :class:`UserError` that names the call and the argument (``cost: target:
expected a job id, a run directory or a sweep id (a string), got None``), and nothing is created: no
registry, no folder, no file. A ``home`` given to a call that only reads must hold a registry
already: a mistyped folder is refused with a sentence, never answered from a new empty registry.

Importing this module imports no registry, scheduler or torch (``import orchestrator.api`` stays light).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config import inputs
from orchestrator.config.budget import budget_text
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from orchestrator.registry.store import Registry

JOB_ID = "a job id (a non-empty string)"
SWEEP_ID = "a sweep id (a non-empty string)"
COST_TARGET = "a job id, a run directory or a sweep id (a string)"
EXPORT_RUN = "a job id or a run directory (a string), or None with checkpoint="

#: What a resume may change, and each one's check (``resume --nodes`` ... as the CLI checks them).
RESUME_CHECKS = {
    "nodes": lambda v: inputs.whole("nodes", v, 1),
    "procs_per_node": lambda v: inputs.whole("procs_per_node", v, 1),
    "strategy": lambda v: inputs.optional_text("strategy", v),
    "profile": lambda v: inputs.optional_text("profile", v),
    "profiles_dir": lambda v: inputs.path_text("profiles_dir", v, optional=True),
    "budget": budget_text,
}


@contextmanager
def door(caller: str) -> Iterator[None]:
    """Checks of ``caller``'s arguments: a refusal names the call (``cost: timeout_s: ...``)."""
    try:
        yield
    except UserError as exc:
        raise UserError(f"{caller}: {exc}") from None


def home(value: object) -> Path | None:
    """None (``$ORCHESTRATOR_HOME``), or a folder (str or path) that holds a registry: a call that
    reads never creates one (:func:`orchestrator.config.inputs.registry_home`)."""
    from orchestrator.registry.store import REGISTRY_FILENAME

    return inputs.registry_home("home", value, REGISTRY_FILENAME)


def registry(value: object) -> Registry | None:
    if value is None:
        return None
    from orchestrator.registry.store import Registry

    return inputs.instance("registry", value, Registry, "an open Registry (api.open_registry()) or None")


def resume_overrides(caller: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The changes of a resume, each checked; an unknown one is Python's TypeError for the call
    (as ``submit``'s unknown keyword is), raised before anything is looked up."""
    for key in overrides:
        if key not in RESUME_CHECKS:
            raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}")
    return {key: RESUME_CHECKS[key](value) for key, value in overrides.items()}


def checked_home(caller: str, value: object) -> Path | None:
    """:func:`home` of ``caller`` (its refusal names the call)."""
    with door(caller):
        return home(value)


def checked(caller: str, registry_: object, home_: object) -> tuple[Registry | None, Path | None]:
    """The ``registry`` and ``home`` arguments of a call that reads, checked."""
    with door(caller):
        return registry(registry_), home(home_)


@contextmanager
def using(registry_: Registry | None, home_: Path | None = None) -> Iterator[Registry]:
    """``registry_`` as it is, or the one under ``home_`` (checked: :func:`home`) opened for the
    call and closed after it; only the default home's is made when missing."""
    if registry_ is not None:
        yield registry_
        return
    from orchestrator.registry.store import Registry

    with Registry.open(home_, create=home_ is None) as opened:
        yield opened
