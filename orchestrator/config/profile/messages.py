"""Profile validation errors in the words a profile author uses: one line per problem.

``file: key.path: expected X, got Y``, a did-you-mean for an unknown key, one line for a union's
members. Apart from the schema (``profile_schema``) so that each stays a readable size.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from orchestrator.config.profile.schema import schema

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError


def _expected(error: Mapping[str, Any]) -> str:
    """Say what a pydantic error expected, in the words a profile author uses."""
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "an integer"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        bound = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}
        limit = next(iter(ctx.values()), "?")
        return f"an integer {bound[kind]} {limit}"
    if kind in ("bool_type", "bool_parsing"):
        return "true or false"
    if kind == "string_type":
        return "a string"
    if kind == "list_type":
        return "a list"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "a mapping of keys to values"
    if kind == "literal_error":
        return f"one of {ctx.get('expected', '?')}"
    if kind == "missing":
        return "this key (it is required)"
    if kind == "value_error":
        message = str(ctx.get("error", error.get("msg", "")))
        return message
    return str(error.get("msg", kind)).lower()


def _format_loc(loc: Iterable[Any]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            text = str(item)
            if not re.fullmatch(r"[\w\-\[\]]+", text):
                text = repr(text)  # a key with a newline, space or quote would break the one-line message
            parts.append(("." if parts else "") + text)
    return "".join(parts) or "(top level)"


def format_validation_error(source: str, exc: ValidationError) -> str:
    """One line per problem: ``file: key.path: expected X, got Y``."""
    lines: list[str] = []
    union_expected: dict[str, list[str]] = {}
    union_input: dict[str, Any] = {}
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        # Unions ("str | int | bool") report one error per member: merge them into one line.
        # (Only one tag, and never on an unknown key: a user's key may be spelt "int" or "str".)
        branch = (
            error["type"] != "extra_forbidden"
            and bool(loc)
            and isinstance(loc[-1], str)
            and (loc[-1] in _UNION_TAGS or loc[-1].startswith("function-"))
        )
        if branch:
            loc = loc[:-1]
        key = _format_loc(loc)
        if branch:
            union_expected.setdefault(key, []).append(_expected(error))
            union_input[key] = error.get("input")
            continue
        if error["type"] == "extra_forbidden":
            parent_model = _model_at(schema()["ClusterProfile"], loc[:-1])
            known = sorted(parent_model.model_fields) if parent_model else []
            guess = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f" (did you mean '{guess[0]}'?)" if guess else f" (known keys: {', '.join(known)})"
            lines.append(f"{source}: {key}: unknown key{hint}")
        elif error["type"] == "missing":
            lines.append(f"{source}: {key}: missing required key")
        elif error["type"] == "value_error" and isinstance(error.get("input"), dict):
            # A check across several keys of one mapping: the message names them.
            lines.append(f"{source}: {key + ': ' if loc else ''}{_expected(error)}")
        else:
            lines.append(f"{source}: {key}: expected {_expected(error)}, got {error.get('input')!r}")
    for key, expected in union_expected.items():
        options = list(dict.fromkeys(expected))
        said = ", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0]
        lines.append(f"{source}: {key}: expected {said}, got {union_input[key]!r}")
    return "\n".join(dict.fromkeys(lines))


_UNION_TAGS = frozenset({"str", "int", "bool", "none", "float"})


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    from pydantic import BaseModel

    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return current
