"""The checks of a profile's ``notify:`` key (:class:`~orchestrator.config.profile.records.Notify`):
its fast path and its pydantic model, kept apart so that :mod:`.profile_schema` stays one screen of
keys per record (it only names these two). The values name where the webhook URL is read (an
environment variable, a file), never the URL: a profile is no place for a secret."""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from orchestrator.config.profile.records import Notify

if TYPE_CHECKING:
    from pydantic import BaseModel

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
#: (least, most) of ``timeout_s``.
TIMEOUT_BOUNDS = (1, 600)


def check_env_name(value: str | None) -> str | None:
    if value is not None and not _ENV_NAME.match(value):
        raise ValueError(
            f"the name of an environment variable holding the URL, like SLACK_WEBHOOK, got {value!r}"
        )
    return value


def check_line(value: str | None) -> str | None:
    if value is not None and (not value.strip() or any(c in value for c in "\n\r\0")):
        raise ValueError(f"a non-empty single-line string, got {value!r}")
    if value is not None and value.lstrip().lower().startswith(("http://", "https://")):
        raise ValueError(
            "a file path or command, not a URL: the webhook URL is a secret, name it with webhook_env "
            "or webhook_file"
        )
    return value


def check_file(value: str | None) -> str | None:
    """A webhook file is read where the event is sent (the batch step on a node, a local job's node 0):
    a relative path would be read from whichever folder that process has, so only absolute or ``~/``."""
    value = check_line(value)
    if value is not None and not value.strip().startswith(("/", "~")):
        raise ValueError(
            f"a path from / or ~/ (it is read on the nodes, whose current folder is not yours), got {value!r}"
        )
    return value


def _passes(check: Callable[[Any], Any], value: Any) -> bool:
    if value is not None and type(value) is not str:
        return False
    try:
        check(value)
    except ValueError:
        return False
    return True


#: The fast path's check of each key (True: plainly valid; False: pydantic decides and words it).
FAST_CHECKS: dict[str, Callable[[Any], bool]] = {
    "webhook_env": lambda v: _passes(check_env_name, v),
    "webhook_file": lambda v: _passes(check_file, v),
    "command": lambda v: _passes(check_line, v),
    "timeout_s": lambda v: type(v) is int and TIMEOUT_BOUNDS[0] <= v <= TIMEOUT_BOUNDS[1],
}


def model(base: type[BaseModel]) -> type[BaseModel]:
    """The pydantic model of ``notify:``, on the schema's strict ``base``: the record's own keys,
    types and defaults, with the same rules as the fast path."""
    from pydantic import Field, create_model, field_validator

    hints = typing.get_type_hints(Notify)
    fields: dict[str, Any] = {name: (hints[name], default) for name, default in Notify.model_fields.items()}
    fields["timeout_s"] = (
        int,
        Field(Notify.model_fields["timeout_s"], ge=TIMEOUT_BOUNDS[0], le=TIMEOUT_BOUNDS[1]),
    )
    validators: dict[str, Any] = {
        "_env": field_validator("webhook_env")(check_env_name),
        "_file": field_validator("webhook_file")(check_file),
        "_lines": field_validator("command")(check_line),
    }
    return create_model("Notify", __base__=base, __validators__=validators, **fields)
