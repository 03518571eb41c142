"""Flags shared by ``render``, ``submit`` and ``sweep``: they all build a LaunchPlan, from a job's
request (:mod:`orchestrator.config.job_request`: one declaration, the flags derived from it)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from orchestrator import api
from orchestrator.config.job_request import KEYWORDS, KEYWORDS_BY_NAME, JobRequest
from orchestrator.config.job_request import positive_int as positive_int  # cli/sweep, cli/resume
from orchestrator.config.options import add_option_arguments, given_options
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan


def positive_float(text: str) -> float:
    """A number of seconds > 0 (``--poll``): checked by argparse, before anything is submitted."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser, script_required: bool = True) -> None:
    """A flag per keyword of a job's request (:mod:`orchestrator.config.job_request`), in its order:
    its ``form`` says which kind; the strategy options' flags where ``options`` stands; the script
    and its arguments last, after ``--``."""
    for k in KEYWORDS:
        spec = k.spec
        if spec.form == "value":
            default = spec.cli_default() if callable(spec.cli_default) else spec.cli_default
            kwargs: dict[str, Any] = {"default": default, "help": spec.help or None}
            if spec.type is not None:
                kwargs["type"] = spec.type
            if spec.metavar:
                kwargs["metavar"] = spec.metavar
            parser.add_argument(k.flag, **kwargs)
        elif spec.form == "switch":
            parser.add_argument(k.flag, action="store_true", help=spec.help or None)
        elif spec.form == "each":
            parser.add_argument(
                k.flag, action="append", default=[], metavar=spec.metavar, help=spec.help or None
            )
        elif spec.form == "options":
            add_option_arguments(parser)  # "option" keywords (--strategy) are among them
    (script,) = (k for k in KEYWORDS if k.spec.form == "script")
    parser.add_argument(
        "script_and_args", nargs=argparse.REMAINDER, metavar=script.spec.metavar, help=script.spec.help
    )
    parser.set_defaults(script_required=script_required)


def parse_after(text: str) -> str:
    return api.parse_after(text)


def split_script(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    rest = list(args.script_and_args or [])
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        if args.script_required:
            raise UserError("no training script: add `-- SCRIPT [ARGS...]` at the end")
        return None, []
    return rest[0], rest[1:]


def request_from_args(args: argparse.Namespace, default_script: str = "train/train.py") -> JobRequest:
    """The job request of the parsed flags: each keyword from the flag its ``form`` made."""
    script, script_args = split_script(args)
    options = given_options(args)
    values: dict[str, Any] = {}
    for k in KEYWORDS:
        if k.spec.form == "script":
            values[k.name] = script or default_script
        elif k.spec.form == "args":
            values[k.name] = script_args
        elif k.spec.form == "options":
            values[k.name] = {n: v for n, v in options.items() if n not in KEYWORDS_BY_NAME}
        else:
            values[k.name] = getattr(args, k.name)
    return JobRequest(**values)


def plan_from_args(args: argparse.Namespace, default_script: str = "train/train.py") -> LaunchPlan:
    """The plan of the parsed flags (:func:`orchestrator.api.make_plan`'s one planning path)."""
    return api.plan_request(request_from_args(args, default_script))
