"""Which command lines go to a login host: cheap enough to ask on every command.

``submit``/``sweep``/``resume`` with ``--profile P`` where P has ``login.host``; else
``$ORCHESTRATOR_LOGIN`` (a profile name: every command goes there, ``status`` and ``list``
included); else a job id this laptop submitted through a login host (:mod:`.book`). On the login
host itself (``ORCHESTRATOR_ON_LOGIN_HOST``, set by the agent) nothing is routed, so a profile
folder the two share never loops.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orchestrator.contract.errors import UserError
from orchestrator.remote import book
from orchestrator.version import __version__

if TYPE_CHECKING:
    from orchestrator.config.profile.records import ClusterProfile

#: Environment variable naming the profile whose login host every command goes to.
LOGIN_ENV = "ORCHESTRATOR_LOGIN"
#: Commands that name their profile with ``--profile``.
_PROFILED = ("submit", "sweep", "resume")
#: Commands whose first positional word is a job (or sweep) id.
_BY_JOB = ("status", "logs", "wait", "cancel", "resume", "stacks", "plot")
#: Commands about this machine or the login host itself: never carried there.
_HERE = ("remote", "profiles", "strategies")
#: Set by the agent for the command it runs on the login host.
ON_LOGIN_HOST = "ORCHESTRATOR_ON_LOGIN_HOST"


def _flag(argv: Sequence[str], name: str) -> str | None:
    words = list(argv[: argv.index("--")] if "--" in argv else argv)
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def login_profile(name: str, profiles_dir: str | None = None) -> ClusterProfile | None:
    """The profile ``name`` when it has a login host; None otherwise (or when it does not load:
    the command then reports that itself)."""
    from orchestrator.config.profile.load import load_profile

    try:
        _, _, profile = load_profile(name, profiles_dir)
    except UserError:
        return None
    return profile if profile.login.host else None


def route(argv: Sequence[str]) -> str | None:
    """The profile whose login host runs this command line, or None to run it here."""
    if os.environ.get(ON_LOGIN_HOST) or not argv or argv[0] in _HERE:
        return None
    command = argv[0]
    if command in _PROFILED:
        name = _flag(argv, "--profile")
        if name and login_profile(name, _flag(argv, "--profiles-dir")):
            return name
    env = os.environ.get(LOGIN_ENV)
    if env:
        if not login_profile(env):
            raise UserError(f"${LOGIN_ENV}={env}: no profile of that name with a login.host")
        return env
    if command in _BY_JOB:
        words = [w for w in argv[1:] if not w.startswith("-")]
        return next((p for w in words if (p := book.profile_of(w))), None)
    return None


def version() -> str:
    """This orchestrator's version (:mod:`orchestrator.version`, a leaf: no cycle through the package)."""
    return __version__
