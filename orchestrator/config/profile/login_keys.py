"""The checks of a profile's ``login:`` key (:class:`~orchestrator.config.profile.records.Login`):
its fast path and its pydantic model, kept apart so that :mod:`.profile_schema` stays one screen of
keys per record (it only names these two)."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from orchestrator.config.profile.records import Login, _check_login_host, _check_single_line

if TYPE_CHECKING:
    from pydantic import BaseModel

#: (least, most) of the integer keys.
_BOUNDS = {"port": (1, 65535), "connect_timeout": (1, 300)}


def _passes(check: Callable[[str], Any], value: Any) -> bool:
    if type(value) is not str:
        return False
    try:
        check(value)
    except ValueError:
        return False
    return True


def _int_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v <= high


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_word = _optional(lambda v: _passes(_check_login_host, v))
_line = _optional(lambda v: _passes(_check_single_line, v))

#: The fast path's check of each key (True: plainly valid; False: pydantic decides and words it).
LOGIN_FAST_CHECKS: dict[str, Callable[[Any], bool]] = {
    "host": _word,
    "user": _word,
    "port": _optional(_int_in(*_BOUNDS["port"])),
    "ssh_config": _line,
    "connect_timeout": _int_in(*_BOUNDS["connect_timeout"]),
    "python": lambda v: v is not None and _line(v),
    "profile": _line,
    "home": _line,
    "runs": _line,
}


def login_model(base: type[BaseModel]) -> type[BaseModel]:
    """The pydantic model of ``login:``, on the schema's strict ``base``: the record's own keys,
    types and defaults, with the same rules as the fast path."""
    from pydantic import Field, create_model, field_validator

    hints = typing.get_type_hints(Login)
    fields: dict[str, Any] = {
        name: (
            hints[name],
            Field(default, ge=_BOUNDS[name][0], le=_BOUNDS[name][1]) if name in _BOUNDS else default,
        )
        for name, default in Login.model_fields.items()
    }
    validators = {
        "words": field_validator("host", "user")(_check_login_host),
        "lines": field_validator("ssh_config", "profile", "home", "runs", "python")(_check_single_line),
    }
    return create_model("Login", __base__=base, __validators__=validators, **fields)
