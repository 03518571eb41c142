"""The checks of a profile's ``container:`` key (:class:`~orchestrator.config.profile.records.Container`):
its fast path and its pydantic model, kept apart so that :mod:`.profile_schema` stays one screen of
keys per record (it only names these two). The rules themselves (``check_*``) are shared with
:mod:`orchestrator.config.container`, which renders the block."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from orchestrator.config.profile.records import Container, _check_env_names

if TYPE_CHECKING:
    from pydantic import BaseModel

#: The runtimes, in the order the documentation names them. ``none``: no container.
RUNTIMES = ("pyxis", "apptainer", "oci", "podman", "none")
#: Characters no mount path may hold: the runtimes' mount syntaxes (``SRC:DST:FLAGS``, comma-separated
#: lists for pyxis and apptainer) give them a meaning, and none of them has a way to escape one.
MOUNT_SPECIAL = (":", ",")
#: The schedulers that run a node's task in a container. The local scheduler's nodes are processes of
#: this machine, started without one: a ``container:`` block there is refused, never ignored.
CONTAINER_SCHEDULERS = ("slurm",)
NOT_OPTION = "a value that does not start with '-' (a container runtime would read it as an option)"


def check_runtime(value: str) -> str:
    if value not in RUNTIMES:
        guess = difflib.get_close_matches(value, RUNTIMES, n=1, cutoff=0.5)
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        raise ValueError(f"one of {', '.join(RUNTIMES)}{hint}")
    return value


def check_not_option(value: str) -> str:
    """A value that no runtime's argument list can read as an option (one starting with ``-``: a
    ``podman run`` flag, an ``apptainer exec`` ``--bind``). Every value that reaches a runtime's
    argument list is a path (:func:`check_path`: it starts with ``/``) or passes this check."""
    if value.startswith("-"):
        raise ValueError(NOT_OPTION)
    return value


def check_path(value: str, what: str) -> str:
    """An absolute path that every runtime's mount syntax can carry (never read as an option)."""
    if not value.startswith("/") or any(c in value for c in "\n\r\0"):
        raise ValueError(f"an absolute single-line path for {what}, got {value!r}")
    bad = [c for c in MOUNT_SPECIAL if c in value]
    if bad:
        raise ValueError(
            f"a path without {' or '.join(repr(c) for c in bad)} for {what} (container runtimes' mount "
            f"syntax gives it a meaning and cannot escape it), got {value!r}"
        )
    return value


def parse_mount(spec: str) -> tuple[str, str, bool]:
    """``SRC``, ``SRC:DST``, ``SRC:DST:ro`` or ``SRC:DST:rw`` -> (source, destination, read_only)."""
    parts = spec.split(":")
    if len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise ValueError(f"mounts like 'SRC', 'SRC:DST' or 'SRC:DST:ro', got {spec!r}")
    source = check_path(parts[0], "a mount source")
    destination = check_path(parts[1], "a mount destination") if len(parts) > 1 else source
    return source, destination, len(parts) == 3 and parts[2] == "ro"


def check_mounts(value: list[str]) -> list[str]:
    for spec in value:
        parse_mount(spec)
    return value


def check_single_line(value: str | None) -> str | None:
    if value is not None and (not value or any(c in value for c in "\n\r\0")):
        raise ValueError("a non-empty single-line string")
    return value


def check_word(value: str | None) -> str | None:
    """``image`` and ``python``: single-line, and never read as an option where they are words."""
    check_single_line(value)
    return value if value is None else check_not_option(value)


def check_scheduler(scheduler: str, container: Any) -> None:
    """A ``container`` (the block: a record or its pydantic model) on a scheduler that cannot run
    one is refused, as ``--container-image`` is, never ignored."""
    if container.runtime != "none" and scheduler not in CONTAINER_SCHEDULERS:
        raise ValueError(
            f"container: scheduler '{scheduler}' runs no container (its nodes are processes on this "
            f"machine, started without an image); remove the container: block or set "
            f"container.runtime: none"
        )


def check_container(runtime: str, image: str | None, workdir: str | None) -> None:
    if runtime != "none" and not image:
        raise ValueError(f"container.image: required when container.runtime is '{runtime}'")
    if image is not None and not _passes(check_not_option, image):
        raise ValueError(f"container.image: {NOT_OPTION}, got {image!r}")
    if runtime in ("oci",) and image is not None and not image.startswith("/"):
        raise ValueError(f"container.image: an absolute path of a root filesystem or bundle for '{runtime}'")
    if workdir is not None:
        check_path(workdir, "container.workdir")


def _passes(check: Callable[[Any], Any], value: Any) -> bool:
    try:
        check(value)
    except ValueError:
        return False
    return True


def _str(v: Any) -> bool:
    return type(v) is str


def _scalar_map(v: Any) -> bool:
    return type(v) is dict and all(
        _str(k) and (type(x) in (bool, str) or (type(x) is int and -(2**63) <= x < 2**63))
        for k, x in v.items()
    )


#: The fast path's check of each key (True: plainly valid; False: pydantic decides and words it).
FAST_CHECKS: dict[str, Callable[[Any], bool]] = {
    "runtime": lambda v: _str(v) and v in RUNTIMES,
    "image": lambda v: v is None or (_str(v) and _passes(check_word, v)),
    "mounts": lambda v: type(v) is list and all(_str(m) for m in v) and _passes(check_mounts, v),
    "workdir": lambda v: v is None or (_str(v) and _passes(lambda p: check_path(p, "workdir"), v)),
    "env": lambda v: _scalar_map(v) and _passes(_check_env_names, v),
    "python": lambda v: _str(v) and _passes(check_word, v),
}


def fast_after(values: dict[str, Any]) -> None:
    check_container(values["runtime"], values["image"], values["workdir"])


def model(base: type[BaseModel]) -> type[BaseModel]:
    """The pydantic model of ``container:``, on the schema's strict ``base``: the record's own keys,
    types and defaults, with the same rules as the fast path."""
    from pydantic import create_model, field_validator, model_validator

    hints = typing.get_type_hints(Container)
    fields: dict[str, Any] = {
        name: (hints[name], default) for name, default in Container.model_fields.items()
    }

    def _consistent(self: Any) -> Any:
        check_container(self.runtime, self.image, self.workdir)
        return self

    validators: dict[str, Any] = {
        "_runtime": field_validator("runtime")(check_runtime),
        "_mounts": field_validator("mounts")(check_mounts),
        "_lines": field_validator("image", "python")(check_word),
        "_env": field_validator("env")(_check_env_names),
        "_consistent": model_validator(mode="after")(_consistent),
    }
    return create_model("Container", __base__=base, __validators__=validators, **fields)
