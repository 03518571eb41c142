"""Planning a sweep: a grid in, one LaunchPlan per grid point out. Pure functions only.

``--grid lr=1e-3,3e-4 --grid seed=0,1`` is the product of its axes, in the order given (the last
axis varies fastest, like nested loops). Each grid point fills the ``{name}`` placeholders of the
script's arguments; an axis no argument uses, or a placeholder no axis fills, is refused: either
would run tasks that differ in nothing, or a script given a literal ``{seed}``.
"""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.config.plan import LaunchPlan
from orchestrator.contract.errors import UserError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Tasks a sweep may hold at all (a scheduler may allow fewer: Slurm's MaxArraySize).
MAX_TASKS = 100_000


def parse_grid(specs: Sequence[str]) -> dict[str, list[str]]:
    """``["lr=1e-3,3e-4", "seed=0,1"]`` -> ``{"lr": ["1e-3", "3e-4"], "seed": ["0", "1"]}``."""
    grid: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip()
        if not sep or not _NAME.match(name):
            raise UserError(f"--grid {spec!r}: expected NAME=V1,V2,... with NAME a word such as lr")
        items = [v.strip() for v in values.split(",")]
        if not values.strip() or any(not v for v in items):
            raise UserError(f"--grid {spec!r}: expected NAME=V1,V2,... with no empty value")
        if name in grid:
            raise UserError(f"--grid {name}: given twice; put every value in one --grid {name}=...")
        if len(set(items)) != len(items):
            raise UserError(f"--grid {spec!r}: a value is listed twice")
        grid[name] = items
    return grid


def grid_from_yaml(path: Path) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """A sweep file: ``grid: {lr: [1e-3, 3e-4], seed: [0, 1]}`` and optionally ``max_parallel: K``.
    Returns the grid (values as the text the script receives) and the other keys."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"--file {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"--file {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--file {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("grid"), dict) or not data["grid"]:
        raise UserError(f"--file {path}: expected a mapping with a non-empty 'grid: {{NAME: [values]}}'")
    unknown = sorted(set(data) - {"grid", "max_parallel"})
    if unknown:
        raise UserError(f"--file {path}: unknown key(s) {', '.join(unknown)} (known: grid, max_parallel)")
    specs = []
    for name, values in data["grid"].items():
        if not isinstance(values, list) or not values or any(isinstance(v, (dict, list)) for v in values):
            raise UserError(f"--file {path}: grid.{name}: expected a non-empty list of values")
        specs.append(f"{name}=" + ",".join(_text(v) for v in values))
    rest = {k: v for k, v in data.items() if k != "grid"}
    if "max_parallel" in rest and (not isinstance(rest["max_parallel"], int) or rest["max_parallel"] < 1):
        raise UserError(f"--file {path}: max_parallel: expected an integer >= 1")
    return parse_grid(specs), rest


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def grid_points(grid: Mapping[str, Sequence[str]]) -> list[dict[str, str]]:
    names = list(grid)
    points = [dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())]
    if len(points) > MAX_TASKS:
        raise UserError(f"--grid: {len(points)} tasks; a sweep holds at most {MAX_TASKS}")
    return points


def placeholders(args: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for arg in args:
        try:
            found.update(f for _, f, _, _ in string.Formatter().parse(arg) if f is not None)
        except ValueError as exc:
            raise UserError(
                f"script argument {arg!r}: {exc} (write {{{{ and }}}} for literal braces)"
            ) from None
    return found


def fill(args: Sequence[str], point: Mapping[str, str]) -> list[str]:
    return [arg.format_map(point) for arg in args]


def sweep_plans(
    base: LaunchPlan, grid: Mapping[str, Sequence[str]]
) -> list[tuple[dict[str, str], LaunchPlan]]:
    """One plan per grid point: ``base`` with its script arguments filled in."""
    used = placeholders(base.script_args)
    missing = sorted(used - set(grid))
    if missing:
        raise UserError(
            f"script argument placeholder {{{missing[0]}}} has no --grid {missing[0]}=...; "
            f"the grid has {', '.join(grid) or 'nothing'}"
        )
    unused = [name for name in grid if name not in used]
    if unused:
        raise UserError(
            f"--grid {unused[0]}: no script argument uses {{{unused[0]}}}, so its tasks would differ in nothing"
        )
    return [(point, replace(base, script_args=fill(base.script_args, point))) for point in grid_points(grid)]
