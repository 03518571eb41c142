"""Cluster profiles: a typed description of one cluster, loaded from YAML.

A profile is written once per cluster and read on every submit, so its errors
must be precise: every problem names the file, the key path, the value found and
what was expected, and unknown keys get a did-you-mean. pydantic does the
checking (strict mode: YAML already carries types, so ``nodes: "2"`` is a
mistake worth reporting, not something to coerce); this module only reshapes
its errors into one line each.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.errors import UserError

#: Slurm accepts these time formats for --time; we accept the same, minus the
#: rarely used "minutes:seconds" (ambiguous with hours:minutes to a human).
#: ``\Z``, not ``$``: ``$`` also matches before a trailing newline, which would let
#: "480G\n" through onto an #SBATCH line and end the #SBATCH block there.
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+):(\d{2}):(\d{2})\Z|^(?:(\d+)-)(\d+)(?::(\d{2}))?\Z|^(\d+)\Z")
_MEM_RE = re.compile(r"^\d+[KMGT]?\Z")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_SBATCH_KEY_RE = re.compile(r"^[a-z][a-z0-9-]*\Z")
_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP")
#: GPU families without bf16 tensor cores (pre-Ampere); bf16 is refused there.
GPUS_WITHOUT_BF16 = frozenset({"v100", "p100", "t4", "k80", "p40", "p4"})

MixedPrecision = Literal["no", "fp16", "bf16"]
StrategyName = Literal["ddp", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class NodeLimits(_Strict):
    default: int = Field(1, ge=1)
    """Nodes a job gets when ``--nodes`` is not given."""
    max: int = Field(1, ge=1)
    """Most nodes one job may ask for (the partition's or the QoS's limit)."""

    @model_validator(mode="after")
    def _default_within_max(self) -> NodeLimits:
        if self.default > self.max:
            raise ValueError(f"default ({self.default}) must be <= max ({self.max})")
        return self


class PortRange(_Strict):
    start: int = Field(29500, ge=1024, le=65535)
    """First port for the rendezvous; the job id picks one inside the range so two
    jobs sharing a node never collide."""
    end: int = Field(29999, ge=1024, le=65535)
    """Last port of the range (inclusive)."""

    @model_validator(mode="after")
    def _ordered(self) -> PortRange:
        if self.end < self.start:
            raise ValueError(f"end ({self.end}) must be >= start ({self.start})")
        return self


class PreTimeoutSignal(_Strict):
    name: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = "USR2"
    """Signal Slurm sends before the time limit (``--signal=<name>@<seconds>``).
    USR2 by default: NCCL claims USR1, and TERM is what preemption sends."""
    seconds_before: int = Field(120, ge=10, le=3600)
    """How long before the time limit it arrives: enough for one step plus a checkpoint."""


class TrainingDefaults(_Strict):
    """Defaults for the strategy options; the command line overrides each."""

    strategy: StrategyName = "ddp"
    """Strategy used when ``--strategy`` is not given."""
    fsdp_version: Literal[1, 2] = 2
    """FSDP implementation: 2 (per-parameter DTensor sharding) unless the cluster needs 1."""
    mixed_precision: MixedPrecision = "no"
    """Autocast precision; bf16 needs Ampere or newer GPUs, fp16 needs a GPU."""
    wrap_cls: str | None = None
    """Layer class to wrap as one FSDP unit (TRANSFORMER_BASED_WRAP); None means size-based wrapping."""
    state_dict: Literal["sharded", "full"] = "sharded"
    """Checkpoint format: sharded (one file per rank, DCP) or gathered on rank 0."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory (FSDP only)."""
    offload: bool = False
    """Keep parameters and optimizer state on the CPU (FSDP only)."""


class ClusterProfile(_Strict):
    """One cluster, as a job on it needs to know it."""

    description: str = ""
    """One line shown by ``orchestrator profiles list``."""
    scheduler: Literal["slurm", "local"]
    """``slurm`` submits through sbatch; ``local`` runs simulated nodes on this machine."""
    partition: str | None = None
    """Slurm partition (``--partition``); required for slurm profiles."""
    account: str | None = None
    """Slurm account to charge (``--account``)."""
    qos: str | None = None
    """Quality of service (``--qos``)."""
    time_limit: str = "01:00:00"
    """Default wall-clock limit, in Slurm's format: ``HH:MM:SS``, ``D-HH:MM:SS`` or minutes."""
    nodes: NodeLimits = NodeLimits()
    """Default and maximum node count of one job."""
    gpus_per_node: int = Field(0, ge=0, le=64)
    """GPUs on one node; 0 means a CPU cluster (gloo backend, one process per ``procs_per_node``)."""
    gpu_type: str | None = None
    """GPU model (``a100``, ``h100``, ...): used in ``--gres`` and to refuse bf16 on pre-Ampere GPUs."""
    procs_per_node: int | None = Field(None, ge=1, le=256)
    """Training processes per node; defaults to ``gpus_per_node`` (or 1 on CPU)."""
    cpus_per_task: int = Field(1, ge=1, le=1024)
    """CPUs for the one Slurm task per node (it hosts every training process of the node)."""
    mem: str | None = None
    """Memory per node in Slurm's format (``480G``); None leaves Slurm's default; ``0`` means all of it."""
    constraint: str | None = None
    """Node features (``--constraint``)."""
    exclusive: bool = False
    """Ask for whole nodes (``--exclusive``): expected for multi-GPU training."""
    extra_sbatch: dict[str, str | int | bool] = {}
    """Further ``#SBATCH --key=value`` lines (keys without dashes, e.g. ``reservation``)."""
    setup: list[str] = []
    """Shell lines run on every node before training (``module load``, ``source venv/bin/activate``).
    They are the profile author's own shell code and run as written."""
    env: dict[str, str | int | bool] = {}
    """Environment variables for training (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...); values are quoted."""
    network_interface: str | None = None
    """Interface whose address the first node advertises as the main process IP
    (e.g. ``ib0``); None uses the address its hostname resolves to."""
    rdzv_backend: Literal["c10d", "static"] = "c10d"
    """torchrun rendezvous: c10d (elastic, default) or static."""
    port_range: PortRange = PortRange()
    """Ports the rendezvous may use."""
    signal: PreTimeoutSignal = PreTimeoutSignal()
    """Pre-timeout signal: the job checkpoints and requeues itself when it arrives."""
    max_requeues: int = Field(3, ge=0, le=100)
    """How many times a job may requeue itself after preemption or time-out."""
    defaults: TrainingDefaults = TrainingDefaults()
    """Strategy options used unless the command line says otherwise."""

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not _TIME_RE.match(value):
            raise ValueError("a Slurm time such as '04:00:00', '2-00:00:00' or '90' (minutes)")
        return value

    @field_validator("partition", "account", "qos", "constraint", "gpu_type", "time_limit", "network_interface")
    @classmethod
    def _single_line(cls, value: str | None) -> str | None:
        # These end up on "#SBATCH --key=value" lines, where quoting cannot carry a newline.
        if value is not None and (not value or any(ch in value for ch in "\n\r\0")):
            raise ValueError("a non-empty single-line string (it becomes an #SBATCH option)")
        return value

    @field_validator("mem")
    @classmethod
    def _slurm_mem(cls, value: str | None) -> str | None:
        if value is not None and not _MEM_RE.match(value):
            raise ValueError("a Slurm memory size such as '480G', '64000M' or '0'")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            if not _ENV_NAME_RE.match(name):
                raise ValueError(f"environment variable names like NCCL_IB_HCA, got {name!r}")
        return value

    @field_validator("extra_sbatch")
    @classmethod
    def _sbatch_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if not _SBATCH_KEY_RE.match(key):
                raise ValueError(f"sbatch option names like 'reservation' or 'mail-type', got {key!r}")
            if isinstance(value[key], str) and any(ch in value[key] for ch in "\n\r\0"):
                raise ValueError(f"a single-line value for {key!r} (it becomes an #SBATCH option)")
            if key in _MANAGED_SBATCH_KEYS:
                raise ValueError(f"no {key!r}: it is set from the profile's own key or by the orchestrator")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ClusterProfile:
        if self.scheduler == "slurm" and not self.partition:
            raise ValueError("partition: required when scheduler is 'slurm'")
        if self.procs_per_node and self.gpus_per_node and self.procs_per_node > self.gpus_per_node:
            raise ValueError(
                f"procs_per_node: {self.procs_per_node} is more than gpus_per_node ({self.gpus_per_node})"
            )
        return self

    @property
    def default_procs_per_node(self) -> int:
        return self.procs_per_node or self.gpus_per_node or 1

    @property
    def supports_bf16(self) -> bool:
        return self.gpus_per_node == 0 or (self.gpu_type or "").lower() not in GPUS_WITHOUT_BF16

    @property
    def supports_fp16(self) -> bool:
        return self.gpus_per_node > 0


#: sbatch options the orchestrator owns; extra_sbatch may not override them.
_MANAGED_SBATCH_KEYS = frozenset(
    {
        "nodes", "ntasks-per-node", "partition", "account", "qos", "time", "gpus-per-node", "gres",
        "cpus-per-task", "mem", "constraint", "exclusive", "signal", "output", "error", "job-name",
        "open-mode", "requeue",
    }
)  # fmt: skip


# ---------------------------------------------------------------------------
# Error formatting


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
            parent_model = _model_at(ClusterProfile, loc[:-1])
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
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return current


# ---------------------------------------------------------------------------
# Loading


def parse_profile(text: str, source: str) -> ClusterProfile:
    """Parse and validate profile YAML; ``source`` names it in every error."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{source}: {where}malformed YAML: {problem}") from None
    if data is None:
        raise UserError(f"{source}: (top level): expected a mapping of profile keys, got an empty file")
    if not isinstance(data, dict):
        raise UserError(f"{source}: (top level): expected a mapping of profile keys, got {type(data).__name__}")
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise UserError(f"{source}: (top level): expected string keys, got {bad_keys[0]!r}")
    try:
        return ClusterProfile.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(source, exc)) from None


def builtin_profiles_dir() -> Path:
    """Where the shipped profiles are, installed or in a checkout."""
    spec = find_spec("orchestrator.cluster_profiles")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / "cluster_profiles"


def profile_search_path(profiles_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """User folders first (so they override built-ins by name), built-ins last."""
    candidates: list[Path] = []
    if profiles_dir:
        candidates.append(Path(profiles_dir))
    env_dir = os.environ.get("ORCHESTRATOR_PROFILES")
    if env_dir:
        candidates.append(Path(env_dir))
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
        raise UserError(f"{display_path(path)!r}: profile file name: expected a name without control characters")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{display_path(path)}: cannot read profile: {exc}") from None
    return path.stem, path, parse_profile(text, display_path(path))
