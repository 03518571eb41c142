"""A job's request, each keyword declared once.

A job is asked for in four places: ``orchestrator.submit``/``sweep``/``make_plan``'s keywords, the
plan flags of ``orchestrator submit``/``sweep``/``render``, the planning path that turns them into
a checked ``LaunchPlan``, and the command line a laptop sends its login host for a profile with
``login:``. Each of them derives from :class:`JobRequest` below, so a new keyword is one field
with its metadata. (They were six hand-written lists, and two had lost ``container_image``: a
remote ``submit(container_image=...)`` dropped the image without a word.)

Field metadata (``keyword(...)``):

- ``form``: how a command line writes it. ``"value"``: ``--flag VALUE``; ``"switch"``: ``--flag``
  when true; ``"each"``: ``--flag V`` once per item; ``"option"``: one of the strategy options'
  own flags (``config/options.py`` offers it with the others); ``"options"``: every strategy
  option's flag; ``"script"``/``"args"``: after ``--``. The flag is the name with dashes.
- ``check``: the one check of the API's and the CLI's value: value in, normalised value out, a
  :class:`UserError` naming the keyword (or its flag) otherwise.
- ``help``, ``metavar``, ``type`` (argparse's) and ``default`` (the flag's default; a function is
  called when the parser is built): the command line's flag.
- ``sent``: whether a login host gets it; False for ``profiles_dir``, a folder on the laptop (the
  login host names its own profile: ``login.profile``).
- ``plan``: the :func:`orchestrator.config.plan.build_plan` keyword it becomes, through
  ``to_plan`` when given. None: the planning path reads it itself (the profile it loads, the
  image it puts in that profile, the options it merges).

``PlanKeywords`` is the type checker's view of the same fields (``Unpack`` takes a TypedDict, not
a dataclass); ``tests/config/test_job_request.py`` holds it equal to the declaration.

Standard library only: imported on every start of a planning command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypedDict

from orchestrator.config import inputs
from orchestrator.config.budget import budget_text, parse_budget
from orchestrator.config.options import OPTIONS_BY_NAME
from orchestrator.contract.errors import UserError

_KEY = "orchestrator.keyword"
#: How a command line writes a keyword (see the module).
FORMS = ("value", "switch", "each", "option", "options", "script", "args")


# ---------------------------------------------------------------------------- values and checks
def positive_int(text: str) -> int:
    """argparse's type of a count (``--nodes``): an integer >= 1, refused by argparse otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def default_profile() -> str:
    """The profile of a request that names none: ``$ORCHESTRATOR_PROFILE``, else ``local``."""
    return os.environ.get("ORCHESTRATOR_PROFILE", "local")


_AFTER = re.compile(r"^([0-9A-Za-z_.-]+?)(?::(ok|any))?$")


def parse_after(text: str) -> str:
    """``JOB`` or ``JOB:ok`` -> ``afterok:JOB``; ``JOB:any`` -> ``afterany:JOB`` (Slurm's words)."""
    m = _AFTER.match(text.strip())
    if not m:
        raise UserError(f"--after {text!r}: expected JOB, JOB:ok or JOB:any (JOB: a job or sweep id)")
    return f"after{m.group(2) or 'ok'}:{m.group(1)}"


def parse_exclude(text: str | None) -> tuple[str, ...]:
    """``n1,n2`` -> ("n1", "n2"); Slurm expands bracketed host lists itself, so they pass as they are."""
    if text is None:
        return ()
    names = (
        tuple(part.strip() for part in text.split(",") if part.strip())
        if "[" not in text
        else (text.strip(),)
    )
    for name in names:
        if not all(c.isalnum() or c in "-_.[]," for c in name):
            raise UserError(f"--exclude: expected node names such as n1,n2 or n[1-2], got {text!r}")
    return names


def _time(value: object) -> str | None:
    text = inputs.optional_text("time", value)
    if text is not None:
        try:
            inputs.slurm_time_minutes(text)
        except ValueError as exc:
            raise UserError(f"--time: expected {exc}") from None
    return text


def _name(value: object) -> str | None:
    text = inputs.optional_text("name", value)
    if text is not None and (not text or any(c in text for c in "\n\r\0")):
        raise UserError(f"--name: expected a non-empty single-line name, got {text!r}")
    return text


def _options(value: object) -> dict[str, Any]:
    given = inputs.options_mapping(value)
    unknown = sorted(set(given) - set(OPTIONS_BY_NAME))
    if unknown:
        known = ", ".join(sorted(OPTIONS_BY_NAME))
        raise UserError(f"options: unknown option {unknown[0]!r} (known: {known})")
    return given


# ---------------------------------------------------------------------------- the metadata
@dataclass(frozen=True)
class KeywordSpec:
    """What a field's metadata says beyond its name, type and default (see the module)."""

    form: str
    check: Callable[[Any], Any]
    help: str = ""
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    cli_default: Any = None
    sent: bool = True
    plan: str | None = None
    to_plan: Callable[[Any], Any] | None = None


def keyword(
    default: Any = None,
    *,
    form: str,
    required: bool = False,
    check: Callable[[Any], Any],
    help: str = "",
    metavar: str | None = None,
    type: Callable[[str], Any] | None = None,
    cli_default: Any = None,
    sent: bool = True,
    plan: str | None = None,
    to_plan: Callable[[Any], Any] | None = None,
) -> Any:
    """A dataclass field carrying its :class:`KeywordSpec` (typed ``Any`` as ``field()`` is)."""
    if form not in FORMS:
        raise ValueError(f"keyword form {form!r}: expected one of {', '.join(FORMS)}")
    spec = KeywordSpec(form, check, help, metavar, type, cli_default, sent, plan, to_plan)
    if required:
        return dataclasses.field(metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


# ---------------------------------------------------------------------------- the declaration
@dataclass(frozen=True, kw_only=True)
class JobRequest:
    """One job as asked for: ``make_plan``'s keywords, as typed by the caller (None: not given, the
    profile's value applies). :meth:`checked` is the same request with every value checked."""

    script: str = keyword(
        required=True, form="script", check=partial(inputs.path_text, "script"), plan="script",
        metavar="-- SCRIPT [ARGS...]", help="training script and its arguments, after --",
    )  # fmt: skip
    """The training script (a path; the login host gets the folder it is in)."""
    args: Sequence[str] = keyword(
        (), form="args", check=partial(inputs.words, "args"), plan="script_args", to_plan=list
    )
    """The script's arguments, each one word (numbers are written as a command line shows them)."""
    profile: str | None = keyword(
        form="value", check=partial(inputs.optional_text, "profile"), cli_default=default_profile,
        help="cluster profile name or YAML path (default: local, or $ORCHESTRATOR_PROFILE)",
    )  # fmt: skip
    """A profile's name or YAML path; None: ``$ORCHESTRATOR_PROFILE``, else ``local``."""
    profiles_dir: str | None = keyword(
        form="value", check=partial(inputs.path_text, "profiles_dir", optional=True), sent=False,
        help="folder of your own profiles; overrides built-ins by name (also $ORCHESTRATOR_PROFILES, ./cluster_profiles)",
    )  # fmt: skip
    """A folder of the caller's own profiles, searched before the built-in ones."""
    nodes: int | None = keyword(
        form="value", check=partial(inputs.whole, "nodes", low=1), plan="nodes", type=positive_int,
        help="default: the profile's nodes.default",
    )  # fmt: skip
    procs_per_node: int | None = keyword(
        form="value", check=partial(inputs.whole, "procs_per_node", low=1), plan="procs_per_node",
        type=positive_int,
        help="processes per node (default: the profile's procs_per_node, else its gpus_per_node, else 1; local: 2)",
    )  # fmt: skip
    strategy: str | None = keyword(form="option", check=partial(inputs.optional_text, "strategy"))
    """``options["strategy"]``, spelled as a keyword of its own; it wins over ``options``."""
    options: Mapping[str, Any] | None = keyword(form="options", check=_options)
    """Strategy options by name (``{"mixed_precision": "bf16"}``): ``config/options.py``'s, the
    ``--`` flags of ``orchestrator submit``; a None value is not given."""
    name: str | None = keyword(
        form="value", check=_name, plan="job_name", help="job name (default: <strategy>-<nodes>n)"
    )
    time: str | None = keyword(
        form="value", check=_time, plan="time_limit", help="time limit, Slurm format (default: the profile's)"
    )
    max_requeues: int | None = keyword(
        form="value", check=partial(inputs.whole, "--max-requeues", low=0, high=100), plan="max_requeues",
        type=int, metavar="N",
        help="requeues after preemption/time limit, and auto-resumes (default: the profile's max_requeues)",
    )  # fmt: skip
    max_restarts: int | None = keyword(
        form="value", check=partial(inputs.whole, "--max-restarts", low=0, high=100), plan="max_restarts",
        type=int, metavar="N",
        help="restarts of the training step inside its allocation after a killed rank, a collective "
        "error or a hang (default: the profile's max_restarts)",
    )  # fmt: skip
    auto_resume: bool = keyword(
        False, form="switch", check=partial(inputs.flag, "auto_resume"), plan="auto_resume",
        help="after a node failure, submit a new attempt without the lost node from the last checkpoint (Slurm)",
    )  # fmt: skip
    hang_timeout: int | None = keyword(
        form="value", check=partial(inputs.whole, "--hang-timeout", low=1, high=86400, unit="seconds"),
        plan="hang_timeout", type=int, metavar="SECONDS",
        help="end the job when no rank progresses for this long, saving every rank's stacks "
        "(default: the profile's hang_timeout, else derived from step times)",
    )  # fmt: skip
    container_image: str | None = keyword(
        form="value", check=partial(inputs.optional_text, "container_image"), metavar="IMAGE",
        help="run the nodes' tasks in this image instead of the profile's container.image",
    )  # fmt: skip
    """This job's image instead of the profile's ``container.image`` (its runtime, mounts kept)."""
    exclude: str | None = keyword(
        form="value", check=partial(inputs.optional_text, "exclude"), plan="exclude_nodes",
        to_plan=parse_exclude, metavar="NODES", help="nodes not to run on (Slurm host list, comma-separated)",
    )  # fmt: skip
    after: Sequence[str] = keyword(
        (), form="each", check=partial(inputs.words, "after"), plan="after",
        to_plan=lambda texts: tuple(map(parse_after, texts)), metavar="JOB[:ok|any]",
        help="start only after JOB (a job or sweep id) COMPLETED (:ok, the default) or ended at all (:any); repeatable",
    )  # fmt: skip

    budget: str | None = keyword(
        form="value", check=budget_text, plan="budget", to_plan=lambda t: None if t is None else parse_budget(t),
        metavar="AMOUNT",
        help="the run's spending cap over all its attempts: 200gpu-h, 0.5cpu-h, or 500usd at the profile's "
        "price; the job checkpoints and stops (BUDGET) before passing it (default: the profile's budget)",
    )  # fmt: skip
    """The run's cap, as typed (``"200gpu-h"``): :mod:`orchestrator.config.budget`."""

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any], caller: str) -> JobRequest:
        """The request of ``caller``'s keywords; an unknown or missing keyword is Python's TypeError
        for that call (never dropped: a keyword no place knows would vanish on its way)."""
        for key in keywords:
            if key not in KEYWORDS_BY_NAME:
                raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}")
        for k in KEYWORDS:
            if k.required and k.name not in keywords:
                raise TypeError(f"{caller}() missing 1 required keyword-only argument: {k.name!r}")
        return cls(**keywords)

    def checked(self) -> JobRequest:
        """Every value checked and normalised (``args`` as a list of words...), in declaration order:
        the API's and the CLI's one check, before anything is loaded or created."""
        return JobRequest(**{k.name: k.spec.check(getattr(self, k.name)) for k in KEYWORDS})

    def given_options(self) -> dict[str, Any]:
        """The strategy options given, by name (None: not given); an ``"option"`` keyword (``strategy``)
        wins over the same name in ``options``."""
        given = {name: (self.options or {}).get(name) for name in OPTIONS_BY_NAME}
        for k in KEYWORDS:
            if k.spec.form == "option" and getattr(self, k.name) is not None:
                given[k.name] = getattr(self, k.name)
        return given

    def plan_inputs(self) -> dict[str, Any]:
        """The keywords of :func:`orchestrator.config.plan.build_plan` this request gives."""
        out = {}
        for k in KEYWORDS:
            if k.spec.plan is not None:
                value = getattr(self, k.name)
                out[k.spec.plan] = k.spec.to_plan(value) if k.spec.to_plan else value
        return out


class _PlanKeywordsRequired(TypedDict):
    script: str


class PlanKeywords(_PlanKeywordsRequired, total=False):
    """:class:`JobRequest`'s fields for the type checker: ``make_plan``'s keywords, which ``submit``
    and ``sweep`` take too (``**plan: Unpack[PlanKeywords]``)."""

    args: Sequence[str]
    profile: str | None
    profiles_dir: str | None
    nodes: int | None
    procs_per_node: int | None
    strategy: str | None
    options: Mapping[str, Any] | None
    name: str | None
    time: str | None
    max_requeues: int | None
    max_restarts: int | None
    auto_resume: bool
    hang_timeout: int | None
    container_image: str | None
    exclude: str | None
    after: Sequence[str]
    budget: str | None


# ---------------------------------------------------------------------------- resolved
@dataclass(frozen=True)
class Keyword:
    """One declared keyword, resolved: what each derivation reads."""

    name: str
    default: Any
    spec: KeywordSpec

    @property
    def flag(self) -> str:
        """The command-line flag, also the prefix of the messages about it."""
        return "--" + self.name.replace("_", "-")

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def _declared() -> tuple[Keyword, ...]:
    found = []
    for f in dataclasses.fields(JobRequest):
        spec = f.metadata.get(_KEY)
        if not isinstance(spec, KeywordSpec):
            raise TypeError(f"JobRequest.{f.name}: declare it with keyword(...)")
        if spec.form == "option" and f.name not in OPTIONS_BY_NAME:
            raise TypeError(f"JobRequest.{f.name}: form 'option' names no option of config/options.py")
        found.append(Keyword(f.name, f.default, spec))
    return tuple(found)


#: Every keyword, in declaration order (the order of the flags in ``submit --help``).
KEYWORDS: tuple[Keyword, ...] = _declared()
KEYWORDS_BY_NAME: dict[str, Keyword] = {k.name: k for k in KEYWORDS}
