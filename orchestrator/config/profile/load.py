"""Cluster profiles: finding, loading and caching them.

A profile is written once per cluster and read on every submit, so its errors must be precise:
every problem names the file, the key path, the value found and what was expected, and unknown
keys get a did-you-mean. The keys and their documentation are in
:mod:`orchestrator.config.profile.records`; how values are checked and errors worded, in
:mod:`orchestrator.config.profile.schema`. This module is where the rest of orchestrator gets them.
"""

from __future__ import annotations

import difflib
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from orchestrator.config.profile.messages import format_validation_error
from orchestrator.config.profile.records import (
    GPUS_WITHOUT_BF16,
    TIME_RE,
    ClusterProfile,
    NodeLimits,
    PortRange,
    Preflight,
    PreTimeoutSignal,
    TrainingDefaults,
)
from orchestrator.config.profile.schema import fast_validate, validate
from orchestrator.contract.errors import UserError

__all__ = [
    "GPUS_WITHOUT_BF16",
    "PARSE_CACHE_ENV",
    "TIME_RE",
    "ClusterProfile",
    "NodeLimits",
    "PortRange",
    "Preflight",
    "PreTimeoutSignal",
    "TrainingDefaults",
    "UserError",
    "available_profiles",
    "builtin_profiles_dir",
    "display_path",
    "format_validation_error",
    "load_profile",
    "parse_profile",
    "profile_search_path",
    "resolve_profile_path",
]

#: Parsed profiles (YAML text -> data) kept across runs: importing PyYAML and parsing cost about
#: a fifth of ``orchestrator render``. Only texts whose data passed the fast check are
#: kept, so the data is plain JSON and checked again on use; anything else is parsed every time.
PARSE_CACHE_ENV = "ORCHESTRATOR_CACHE_DIR"
_PARSE_CACHE_FILE = "parsed_profiles.json"
_PARSE_CACHE_ENTRIES = 32


def _cache_dir() -> Path:
    """``$ORCHESTRATOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/orchestrator``, else ``~/.cache/orchestrator``."""
    env = os.environ.get(PARSE_CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "orchestrator"


def _private(path: Path) -> bool:
    """Ours and writable by nobody else: a profile's setup lines run as shell code on the nodes,
    so a cache anyone else could write must not be read."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _load_parse_cache() -> dict[str, Any]:
    try:
        folder = _cache_dir()
        path = folder / _PARSE_CACHE_FILE
        if not (_private(folder) and _private(path)):
            return {}
        import json

        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RuntimeError):
        return {}
    return data if isinstance(data, dict) else {}


def _store_parse_cache(text: str, data: dict[str, Any]) -> None:
    """Remember ``text -> data`` (newest last, a few dozen entries); failures are ignored."""
    import json

    try:
        folder = _cache_dir()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(folder):
            return
        entries = _load_parse_cache()
        entries.pop(text, None)
        entries[text] = data
        while len(entries) > _PARSE_CACHE_ENTRIES:
            entries.pop(next(iter(entries)))
        tmp = folder / f".{_PARSE_CACHE_FILE}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(entries, fh)
        os.replace(tmp, folder / _PARSE_CACHE_FILE)
    except (OSError, ValueError, TypeError, RuntimeError):
        return


class DuplicateKeyError(ValueError):
    """A mapping names one key twice (YAML keeps the last silently)."""


def _unique_keys_loader() -> Any:
    """yaml's SafeLoader, refusing a key given twice in one mapping, naming both lines."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKeyError(
                            f"line {line}: duplicate key {key!r} (first given on line {seen[key]})"
                        )
                    seen[key] = line
                except TypeError:  # an unhashable key: the schema refuses it with its own message
                    pass
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def parse_profile(text: str, source: str) -> ClusterProfile:
    """Parse and validate profile YAML; ``source`` names it in every error."""
    cached = _load_parse_cache().get(text)
    if cached is not None:
        fast = fast_validate(ClusterProfile, cached)
        if fast is not None:
            return fast
    import yaml  # here, not at the top: commands that never load a profile skip its import

    try:
        data = yaml.load(text, Loader=_unique_keys_loader())  # noqa: S506 (a SafeLoader subclass)
    except DuplicateKeyError as exc:
        raise UserError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{source}: {where}malformed YAML: {problem}") from None
    if data is None:
        raise UserError(f"{source}: (top level): expected a mapping of profile keys, got an empty file")
    if not isinstance(data, dict):
        raise UserError(
            f"{source}: (top level): expected a mapping of profile keys, got {type(data).__name__}"
        )
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise UserError(f"{source}: (top level): expected string keys, got {bad_keys[0]!r}")
    fast = fast_validate(ClusterProfile, data)
    if fast is not None:
        _store_parse_cache(text, data)
        return fast
    from pydantic import ValidationError

    try:
        return validate(ClusterProfile, data)
    except ValidationError as exc:
        raise UserError(format_validation_error(source, exc)) from None


def builtin_profiles_dir() -> Path:
    """Where the shipped profiles are, installed or in a checkout."""
    spec = find_spec("orchestrator.cluster_profiles")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "cluster_profiles"


def profile_search_path(profiles_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """User folders first (so they override built-ins by name), built-ins last."""
    candidates: list[Path] = []
    if profiles_dir:
        candidates.append(Path(profiles_dir))
    if "ORCHESTRATOR_PROFILES" in os.environ:
        from orchestrator.config.inputs import env_folder

        candidates.append(env_folder("ORCHESTRATOR_PROFILES", "", must_be_folder=True))
    candidates.append(Path.cwd() / "cluster_profiles")
    candidates.append(builtin_profiles_dir())
    unique: list[Path] = []
    for path in candidates:
        resolved = path.resolve()
        if resolved not in unique:
            unique.append(resolved)
    return unique


def available_profiles(profiles_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Profile name -> file, the first folder on the search path winning."""
    found: dict[str, Path] = {}
    for folder in profile_search_path(profiles_dir):
        if not folder.is_dir():
            continue
        for file in sorted(folder.glob("*.yaml")):
            found.setdefault(file.stem, file)
    return found


def display_path(path: Path) -> str:
    """Path relative to the working directory when inside it (shorter errors)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def resolve_profile_path(name_or_path: str, profiles_dir: str | os.PathLike[str] | None = None) -> Path:
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise UserError(f"{name_or_path}: profile file not found")
        return path
    profiles = available_profiles(profiles_dir)
    if name_or_path not in profiles:
        guess = difflib.get_close_matches(name_or_path, list(profiles), n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        raise UserError(
            f"--profile: unknown profile '{name_or_path}'{hint}; known: {', '.join(sorted(profiles)) or 'none'}"
        )
    return profiles[name_or_path]


def load_profile(
    name_or_path: str, profiles_dir: str | os.PathLike[str] | None = None
) -> tuple[str, Path, ClusterProfile]:
    """Find a profile by name (or path) and validate it: returns (name, file, profile)."""
    path = resolve_profile_path(name_or_path, profiles_dir)
    if any(ord(ch) < 32 or ch == "\x7f" for ch in path.stem):
        # The name lands on comment lines of the sbatch script and the Accelerate config:
        # a newline there would turn the rest of the file name into shell code.
        raise UserError(
            f"{display_path(path)!r}: profile file name: expected a name without control characters"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{display_path(path)}: cannot read profile: {exc}") from None
    return path.stem, path, parse_profile(text, display_path(path))
