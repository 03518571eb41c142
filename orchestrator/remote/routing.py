"""Which command lines go to a login host: cheap enough to ask on every command.

``submit``/``sweep``/``resume`` with ``--profile P`` where P has ``login.host`` (loaded from
``--profiles-dir`` when given); else ``$ORCHESTRATOR_LOGIN`` (a profile name: every command goes
there, ``status`` and ``list`` included); else a job id this laptop submitted through a login host
(:mod:`.book`): every command that names a job follows it there (:func:`job_target`; an id this
laptop's own registry has too is refused, naming both). On the login host itself
(``ORCHESTRATOR_ON_LOGIN_HOST``, set by the agent) nothing is routed, so a profile folder the two
share never loops. Every command of the CLI is in one of the tuples below
(``tests/remote/test_every_command.py`` checks it against ``cli.main.COMMANDS``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orchestrator.contract.errors import UserError
from orchestrator.remote import book
from orchestrator.remote.book import Target
from orchestrator.version import __version__

if TYPE_CHECKING:
    from orchestrator.config.profile.records import ClusterProfile

#: Environment variable naming the profile whose login host every command goes to.
LOGIN_ENV = "ORCHESTRATOR_LOGIN"
#: ``$ORCHESTRATOR_LOGIN`` set to this: every command runs here, on this laptop's registry, and none
#: follows the book (how to name the laptop's job where a login host gave the same id).
HERE_VALUE = "-"
#: Commands that name their profile with ``--profile`` (or as their first word: :data:`PROFILE_WORD`).
PROFILED = ("submit", "sweep", "resume", "doctor")
#: Of those, the ones whose first positional word is the profile (``doctor PROFILE``), and their
#: options that take a value (skipped when looking for it).
PROFILE_WORD = ("doctor",)
VALUE_OPTIONS = ("--nodes", "--profiles-dir")
#: Commands whose positional words name jobs (or sweeps): they follow the job to its login host.
BY_JOB = ("status", "logs", "wait", "cancel", "resume", "stacks", "plot", "cost", "export")
#: Commands that name no job: here, or on ``$ORCHESTRATOR_LOGIN``'s login host (``ui``: its
#: dashboard, forwarded to this machine by :mod:`.client`).
NO_JOB = ("list", "render", "ui")
#: Commands about this machine or the login host itself: never carried there.
HERE = ("remote", "profiles", "strategies")

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


def profile_word_index(argv: Sequence[str]) -> int | None:
    """Where a :data:`PROFILE_WORD` command line names its profile (None: another command, or none)."""
    if not argv or argv[0] not in PROFILE_WORD:
        return None
    for i in range(1, len(argv)):
        if argv[i] == "--":
            return None
        if not argv[i].startswith("-") and argv[i - 1] not in VALUE_OPTIONS:
            return i
    return None


def _first_word(argv: Sequence[str]) -> str | None:
    i = profile_word_index(argv)
    return None if i is None else argv[i]


def login_profile(name: str, profiles_dir: str | None = None) -> ClusterProfile | None:
    """The profile ``name`` when it has a login host; None otherwise (or when it does not load:
    the command then reports that itself)."""
    try:
        return load_login(Target(name, profiles_dir))
    except UserError:
        return None


def load_login(target: Target) -> ClusterProfile:
    """The profile of ``target``, which must load and have ``login.host``; else a :class:`UserError`
    saying what is wrong with it (its file and key, or that it names no login host)."""
    from orchestrator.config.profile.load import load_profile

    _, path, profile = load_profile(target.name, target.profiles_dir)
    if not profile.login.host:
        raise UserError(f"profile {target.name} ({path}): no login.host")
    return profile


def target(name: str, profiles_dir: str | None) -> Target:
    """``name`` with the folder its file is in, absolute, so that a later command finds the same file
    from any folder (the book keeps it): ``--profiles-dir``'s, or the one the search found it in
    (``./cluster_profiles`` is the submitting folder's). A name that is a path keeps the folder given."""
    from orchestrator.config.profile.load import resolve_profile_path

    folder = None if profiles_dir is None else os.path.abspath(os.path.expanduser(profiles_dir))
    if os.sep not in name and not name.endswith((".yaml", ".yml")):
        try:
            path = resolve_profile_path(name, folder)
        except UserError:
            return Target(name, folder)
        if path.stem == name:
            folder = str(path.parent.resolve())
    return Target(name, folder)


def route(argv: Sequence[str]) -> Target | None:
    """The profile whose login host runs this command line, or None to run it here."""
    if os.environ.get(ON_LOGIN_HOST) or not argv or argv[0] in HERE:
        return None
    command = argv[0]
    if command in PROFILED:
        name = _first_word(argv) if command in PROFILE_WORD else _flag(argv, "--profile")
        where = _flag(argv, "--profiles-dir")
        if name and login_profile(name, where):
            return target(name, where)
    env = os.environ.get(LOGIN_ENV)
    if env == HERE_VALUE:
        return None
    if env:
        try:
            load_login(Target(env))
        except UserError as exc:
            raise UserError(f"${LOGIN_ENV}={env}: {exc}") from None
        return target(env, None)
    if command in BY_JOB:
        words = [w for w in argv[1:] if not w.startswith("-")]
        return next((p for w in words if (p := job_target(w))), None)
    return None


def job_route(job_id: str) -> Target | None:
    """Where a call of the Python API naming ``job_id`` runs: the login host a command naming it goes
    to (:func:`route`: ``$ORCHESTRATOR_LOGIN``, else the book), None: here."""
    return route(["status", job_id])


def job_target(job_id: str) -> Target | None:
    """The login host the book says gave ``job_id``; None when it gave none. An id this laptop's own
    registry has too is a :class:`UserError` naming both and how to say which is meant.

    Why refuse and not pick one: the two count on their own (the local scheduler counts ``local-1``,
    ``local-2``... in each registry; a cluster counts its own numbers), so the same id names two
    different jobs, and either pick answers about, or cancels, a job the user did not mean without a
    word. Why
    not book the login host's ids under another name: the id is the one the login host printed and
    uses in its run directory, its logs and under ``$ORCHESTRATOR_LOGIN``; a second name would be a
    second fact to keep and to type."""
    found = book.profile_of(job_id)
    if found is None or not _in_this_registry(job_id):
        return found
    raise UserError(
        f"job {job_id}: this laptop's registry has a job of that id, and so does the login host of "
        f"{found.name} (submitted through it); say which: {LOGIN_ENV}={found.name} for the login host's, "
        f"{LOGIN_ENV}={HERE_VALUE} for this laptop's"
    )


def _in_this_registry(job_id: str) -> bool:
    """Whether this machine's registry (``$ORCHESTRATOR_HOME``) has ``job_id``; none there: False."""
    from orchestrator.registry.store import REGISTRY_FILENAME, Registry, default_home

    if not (default_home() / REGISTRY_FILENAME).is_file():
        return False
    with Registry.open(create=False) as registry:
        try:
            registry.get(job_id)
        except UserError:
            return False
    return True


def version() -> str:
    """This orchestrator's version (:mod:`orchestrator.version`, a leaf: no cycle through the package)."""
    return __version__
