"""The checks of every value a caller hands the product, shared by the Python API and the CLI.

argparse turns flags into typed values, so most of these never fire from the command line; the
API takes whatever Python hands it, and the same planning path (``runner/planning.py``) checks it
here before anything is created (a job's keywords: each one's ``check`` in ``config/job_request.py``).
A wrong type or value is a :class:`UserError` naming the keyword and what was expected: never a
TypeError from deep inside, never a value silently reinterpreted.

Sequences of strings (a script's ``args``, ``after``, a grid's values) refuse a bare string instead
of splitting it: ``args="--max-steps 5"`` was submitted as single characters, and shlex-splitting
would guess at a shell's quoting the caller never asked for. ``args`` and grid values take numbers
(``3e-4`` -> ``"0.0003"``), as a command line would show them; anything else is refused.
"""

from __future__ import annotations

import math
import os
import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.contract.errors import UserError

#: A Slurm time: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.
_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(?:(\d+):)?(\d+):(\d+)|(\d+))\Z")
#: Longest time limit taken: a year (Slurm's own limit is the partition's, usually far less).
MAX_TIME_MINUTES = 366 * 24 * 60
#: Grid names: words, as ``{NAME}`` placeholders in the script's arguments.
_GRID_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


def _kind(value: object) -> str:
    return f"{value!r} (a {type(value).__name__})"


def slurm_time_minutes(text: str) -> int:
    """Minutes of a Slurm time limit; ValueError (with what is expected) for a malformed or absurd one."""
    m = _TIME.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"a Slurm time such as '04:00:00', '2-00:00:00' or '90' (minutes), got {text!r}")
    days, d_hours, d_min, d_sec, hours, minutes, seconds, only_minutes = m.groups()
    if days is not None:
        h, mi, s = int(d_hours), int(d_min or 0), int(d_sec or 0)
        if h > 23 or mi > 59 or s > 59:
            raise ValueError(f"hours 0-23, minutes and seconds 0-59 after the days, got {text!r}")
        total = int(days) * 1440 + h * 60 + mi + (1 if s else 0)
    elif only_minutes is not None:
        total = int(only_minutes)
    else:
        mi, s = int(minutes), int(seconds)
        if (hours is not None and mi > 59) or s > 59:
            raise ValueError(f"minutes and seconds 0-59, got {text!r}")
        total = int(hours or 0) * 60 + mi + (1 if s else 0)
    if total < 1:
        raise ValueError(f"at least one minute, got {text!r}")
    if total > MAX_TIME_MINUTES:
        raise ValueError(f"at most 366 days, got {text!r}")
    return total


def optional_text(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise UserError(f"{name}: expected a string, got {_kind(value)}")
    return value


def path_text(name: str, value: object, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or "\0" in value:
        raise UserError(f"{name}: expected a path (a non-empty string), got {_kind(value)}")
    return value


def whole(
    name: str,
    value: object,
    low: int,
    high: int | None = None,
    optional: bool = True,
    unit: str = "an integer",
) -> int | None:
    """An int in ``low..high``; a bool, float or string is refused (``nodes=1.5``, ``nodes="2"``).
    ``unit``: what the message calls it (``seconds`` for a timeout)."""
    if value is None and optional:
        return None
    what = f"{unit} from {low} to {high}" if high is not None else f"{unit} >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name}: expected {what}, got {_kind(value)}")
    if value < low or (high is not None and value > high):
        raise UserError(f"{name}: expected {what}, got {value}")
    return value


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{name}: expected True or False, got {_kind(value)}")
    return value


def seconds(name: str, value: object, optional: bool = True) -> float | None:
    """A finite number of seconds > 0 (``wait(timeout=...)``, ``--poll``): ``"5"``, nan and inf refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{name}: expected a number of seconds > 0, got {_kind(value)}")
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{name}: expected a finite number of seconds > 0, got {value}")
    return float(value)


def text(name: str, value: object, what: str = "a non-empty string", optional: bool = False) -> str | None:
    """A non-empty string without a NUL byte (a job id, a sweep id, a metric's name); a list, a
    number or None (unless ``optional``) is refused with ``what`` was expected."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise UserError(f"{name}: expected {what}, got {_kind(value)}")
    return value


def path_or_id(name: str, value: object, what: str) -> str:
    """A job id, a sweep id or a run directory (a string or an ``os.PathLike``), as text."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return text(name, value, what) or ""


def texts(name: str, value: object, what: str = "job ids") -> list[str]:
    """A list or tuple of non-empty strings (job ids); a bare string is refused, not iterated."""
    if isinstance(value, str | bytes):
        raise UserError(f"{name}: expected a list of {what}, not the string {value!r} (write [{value!r}])")
    if not isinstance(value, list | tuple):
        raise UserError(f"{name}: expected a list of {what}, got {_kind(value)}")
    return [text(f"{name}[{i}]", item, "a non-empty string") or "" for i, item in enumerate(value)]


def number(name: str, value: object, optional: bool = True) -> float | None:
    """A finite number (a time stamp): ``"5"``, a bool, nan and inf refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserError(f"{name}: expected a finite number, got {_kind(value)}")
    return float(value)


def choice(name: str, value: object, choices: Any) -> str:
    """One of ``choices`` (a format, a dtype, a metric), as the CLI's ``choices=`` keeps it."""
    if not isinstance(value, str) or value not in choices:
        raise UserError(f"{name}: expected one of {', '.join(map(str, choices))}, got {_kind(value)}")
    return value


def stream(name: str, value: object) -> Any:
    """None (the default stream) or a text stream to write lines to (an object with ``write``)."""
    if value is not None and not callable(getattr(value, "write", None)):
        raise UserError(f"{name}: expected a text stream (an object with write()), got {_kind(value)}")
    return value


def mapping(name: str, value: object, optional: bool = True) -> dict[str, Any] | None:
    """None (unless not ``optional``) or a mapping with string keys."""
    if value is None and optional:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise UserError(f"{name}: expected a mapping with string keys, got {_kind(value)}")
    return dict(value)


def instance(name: str, value: object, kind: type, what: str, optional: bool = False) -> Any:
    """An object of ``kind`` (a plan, a registry...), or None when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, kind):
        raise UserError(f"{name}: expected {what}, got {_kind(value)}")
    return value


def _word(name: str, value: object) -> str:
    """One command-line word: a string, or a number written as a command line shows it."""
    if isinstance(value, str):
        if "\0" in value:
            raise UserError(f"{name}: a string with a NUL byte cannot be a command-line word")
        return value
    if isinstance(value, os.PathLike):
        return str(os.fspath(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    raise UserError(f"{name}: expected strings (or numbers), got {_kind(value)}")


def words(name: str, value: object) -> list[str]:
    """A list or tuple of command-line words. A bare string is refused, not split (see the module)."""
    if isinstance(value, str | bytes):
        hint = "; split it yourself (shlex.split) if it is a command line" if name == "args" else ""
        raise UserError(f"{name}: expected a list of strings, not the string {value!r}{hint}")
    if not isinstance(value, list | tuple):
        raise UserError(f"{name}: expected a list of strings, got {_kind(value)}")
    return [_word(f"{name}[{i}]", item) for i, item in enumerate(value)]


def options_mapping(value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise UserError(f"options: expected a mapping of option names to values, got {_kind(value)}")
    return dict(value)


def grid(value: object) -> dict[str, list[str]]:
    """``{"lr": [1e-3, 3e-4]}`` -> ``{"lr": ["0.001", "0.0003"]}``: names are words, values a
    non-empty list of distinct strings or numbers (a value may hold a comma: it is never re-split)."""
    if not isinstance(value, Mapping) or not value:
        raise UserError(
            f"grid: expected a non-empty mapping such as {{'lr': [1e-3, 3e-4]}}, got {_kind(value)}"
        )
    out: dict[str, list[str]] = {}
    for key, values in value.items():
        if not isinstance(key, str) or not _GRID_NAME.match(key):
            raise UserError(f"grid: expected names that are words such as lr, got {key!r}")
        if isinstance(values, str | bytes):
            raise UserError(
                f"grid[{key!r}]: expected a list of values, got the string {values!r} (write [{values!r}])"
            )
        if isinstance(values, range):  # grid={"seed": range(100)}: a sequence of numbers like any other
            values = list(values)
        texts = words(f"grid[{key!r}]", values)
        if not texts:
            raise UserError(f"grid[{key!r}]: expected a non-empty list of values")
        if any(not t for t in texts):
            raise UserError(f"grid[{key!r}]: an empty value")
        if len(set(texts)) != len(texts):
            raise UserError(f"grid[{key!r}]: a value is listed twice")
        out[key] = texts
    return out


def signal_value(value: object) -> signal.Signals | None:
    """None (cancel), or a signal to send: a name (``"USR1"``, ``"SIGTERM"``), a number or a
    ``signal.Signals``. 0 (no signal: "is it alive?") and unknown numbers are refused, as ``cancel
    --signal 0`` is."""
    if value is None:
        return None
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise UserError(f"signal: expected a signal name or number (e.g. TERM, USR1, 10), got {_kind(value)}")
    text = str(value).strip().upper()
    try:
        if text.isdigit():
            sig = signal.Signals(int(text))
        else:
            sig = signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise UserError(f"--signal {value!r}: not a signal name or number (e.g. TERM, USR1, 10)") from None
    return sig


def registry_home(name: str, value: object, filename: str) -> Path | None:
    """None (the default home), or a folder that holds the registry file ``filename`` already: a call
    that only reads never makes one in a mistyped folder (it answered from a new empty registry)."""
    text = path_text(name, value, optional=True)
    if text is None:
        return None
    home = Path(text).expanduser()
    if not (home / filename).is_file():
        where = f"holds no registry ({filename})" if home.exists() else "does not exist"
        raise UserError(
            f"{name}: {home} {where}; name the folder of an existing registry "
            "($ORCHESTRATOR_HOME, default ~/.orchestrator); nothing was created there"
        )
    return home


def env_folder(name: str, default: str | os.PathLike[str], must_be_folder: bool = False) -> Path:
    """The folder an ``ORCHESTRATOR_*`` variable names, or ``default`` when it is unset.

    Set but empty (``ORCHESTRATOR_RUNS=``) is refused, not read as unset or as ``.``: it put run
    directories into the working directory itself, and read ``~/.orchestrator`` as the registry
    where the user meant another one. ``must_be_folder``: a folder that is only read (the
    profiles): naming a file there is a mistake, refused; a folder not made yet is skipped."""
    value = os.environ.get(name)
    if value is None:
        return Path(default)
    if not value.strip() or "\0" in value:
        raise UserError(f"${name} is set but empty; unset it or name a folder")
    path = Path(value).expanduser()
    if must_be_folder and path.exists() and not path.is_dir():
        raise UserError(f"${name}={value}: is not a folder; it names a folder of profiles (*.yaml)")
    return path


def max_parallel(value: object) -> int | None:
    return whole("max_parallel", value, 1)
