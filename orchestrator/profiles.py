"""Cluster profiles: a typed description of one cluster, loaded from YAML.

A profile is written once per cluster and read on every submit, so its errors
must be precise: every problem names the file, the key path, the value found and
what was expected, and unknown keys get a did-you-mean. pydantic does the
checking of anything doubtful (strict mode: YAML already carries types, so
``nodes: "2"`` is a mistake worth reporting, not something to coerce); this module
reshapes its errors into one line each.

Why two layers: importing pydantic and building these models costs more than the
rest of ``orchestrator render`` together (~60 ms of a ~100 ms budget, issue #7). So
the classes below are plain immutable records, and a profile whose every value is
plainly valid (the common case: the shipped profiles, job.json written by us) is
checked by :func:`_fast_validate` without pydantic. Anything it is not sure about
-- an unknown key, a wrong type, a value out of range, a float, a bool where an int
goes -- goes to the pydantic schema (:func:`_schema`, built on first use), which
decides and words the errors exactly as before. The fast path only ever accepts a
subset of what pydantic accepts, with the same values; tests/test_cli_latency_profiles.py
checks that on fuzzed documents, and tests/test_profiles.py that both layers list
the same keys and defaults.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from orchestrator.errors import UserError

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError

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
_STRATEGY_NAMES = ("ddp", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")

#: sbatch options the orchestrator owns; extra_sbatch may not override them.
_MANAGED_SBATCH_KEYS = frozenset(
    {
        "nodes", "ntasks-per-node", "partition", "account", "qos", "time", "gpus-per-node", "gres",
        "cpus-per-task", "mem", "constraint", "exclusive", "signal", "output", "error", "job-name",
        "open-mode", "requeue",
    }
)  # fmt: skip


# ---------------------------------------------------------------------------
# Checks shared by the fast path and the pydantic schema (one wording, one rule).
# Each raises ValueError with what was expected; pydantic turns that into a
# ``value_error`` whose message ``_expected`` shows as it is.


def _check_slurm_time(value: str) -> str:
    if not _TIME_RE.match(value):
        raise ValueError("a Slurm time such as '04:00:00', '2-00:00:00' or '90' (minutes)")
    return value


def _check_single_line(value: str | None) -> str | None:
    # These end up on "#SBATCH --key=value" lines, where quoting cannot carry a newline.
    if value is not None and (not value or any(ch in value for ch in "\n\r\0")):
        raise ValueError("a non-empty single-line string (it becomes an #SBATCH option)")
    return value


def _check_slurm_mem(value: str | None) -> str | None:
    if value is not None and not _MEM_RE.match(value):
        raise ValueError("a Slurm memory size such as '480G', '64000M' or '0'")
    return value


def _check_env_names(value: dict[str, Any]) -> dict[str, Any]:
    for name in value:
        if not _ENV_NAME_RE.match(name):
            raise ValueError(f"environment variable names like NCCL_IB_HCA, got {name!r}")
    return value


def _check_sbatch_keys(value: dict[str, Any]) -> dict[str, Any]:
    for key in value:
        if not _SBATCH_KEY_RE.match(key):
            raise ValueError(f"sbatch option names like 'reservation' or 'mail-type', got {key!r}")
        if isinstance(value[key], str) and any(ch in value[key] for ch in "\n\r\0"):
            raise ValueError(f"a single-line value for {key!r} (it becomes an #SBATCH option)")
        if key in _MANAGED_SBATCH_KEYS:
            raise ValueError(f"no {key!r}: it is set from the profile's own key or by the orchestrator")
    return value


def _check_node_limits(default: int, max_: int) -> None:
    if default > max_:
        raise ValueError(f"default ({default}) must be <= max ({max_})")


def _check_port_range(start: int, end: int) -> None:
    if end < start:
        raise ValueError(f"end ({end}) must be >= start ({start})")


def _check_profile(scheduler: str, partition: str | None, procs_per_node: int | None, gpus_per_node: int) -> None:
    if scheduler == "slurm" and not partition:
        raise ValueError("partition: required when scheduler is 'slurm'")
    if procs_per_node and gpus_per_node and procs_per_node > gpus_per_node:
        raise ValueError(f"procs_per_node: {procs_per_node} is more than gpus_per_node ({gpus_per_node})")


# ---------------------------------------------------------------------------
# The profile classes: immutable records (attribute access, ==, repr, model_dump,
# model_validate, model_fields), the documentation of every key.

_REQUIRED: Any = object()  # marks a key without default in ``model_fields``
_R = TypeVar("_R", bound="_Record")


class _Record:
    """Base of the profile classes: frozen values with the bit of pydantic's API the code uses.

    ``model_fields`` maps each key, in order, to its default (``_REQUIRED`` when there is none).
    Constructing one validates (like the pydantic models these replaced); the loaders build them
    through :func:`_validate`, which only falls back to pydantic when a value is doubtful.
    """

    model_fields: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        names = [n for n in cls.__dict__.get("__annotations__", {}) if not n.startswith("_")]
        cls.model_fields = {n: cls.__dict__.get(n, _REQUIRED) for n in names}

    def __init__(self, **data: Any) -> None:
        cls = type(self)
        if not data and _REQUIRED not in cls.model_fields.values():
            # All defaults (also how the class bodies below get theirs): valid by definition.
            values = {k: v.copy() if isinstance(v, (dict, list)) else v for k, v in cls.model_fields.items()}
        else:
            values = _validate(cls, data).__dict__
        self.__dict__.update(values)

    @classmethod
    def _make(cls: type[_R], values: dict[str, Any]) -> _R:
        """An instance from values already checked (no validation)."""
        obj = object.__new__(cls)
        obj.__dict__.update(values)
        return obj

    @classmethod
    def model_validate(cls: type[_R], obj: Any, *, strict: bool | None = None) -> _R:
        """Validate a mapping (pydantic's semantics; raises ``pydantic.ValidationError``)."""
        return _validate(cls, obj, strict)

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """Plain dicts/lists/scalars, every key in order (all values are JSON types already)."""
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if isinstance(value, _Record):
                value = value.model_dump(mode)
            elif isinstance(value, (dict, list)):
                value = value.copy()
            out[name] = value
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self), *self.__dict__.values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class NodeLimits(_Record):
    default: int = 1
    """Nodes a job gets when ``--nodes`` is not given (>= 1)."""
    max: int = 1
    """Most nodes one job may ask for (the partition's or the QoS's limit; >= 1, >= default)."""


class PortRange(_Record):
    start: int = 29500
    """First port for the rendezvous (1024..65535); the job id picks one inside the range so two
    jobs sharing a node never collide."""
    end: int = 29999
    """Last port of the range (inclusive; 1024..65535, >= start)."""


class PreTimeoutSignal(_Record):
    name: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = "USR2"
    """Signal Slurm sends before the time limit (``--signal=<name>@<seconds>``).
    USR2 by default: NCCL claims USR1, and TERM is what preemption sends."""
    seconds_before: int = 120
    """How long before the time limit it arrives (10..3600): enough for one step plus a checkpoint."""


class TrainingDefaults(_Record):
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


class ClusterProfile(_Record):
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
    gpus_per_node: int = 0
    """GPUs on one node (0..64); 0 means a CPU cluster (gloo backend, one process per ``procs_per_node``)."""
    gpu_type: str | None = None
    """GPU model (``a100``, ``h100``, ...): used in ``--gres`` and to refuse bf16 on pre-Ampere GPUs."""
    procs_per_node: int | None = None
    """Training processes per node (1..256); defaults to ``gpus_per_node`` (or 1 on CPU)."""
    cpus_per_task: int = 1
    """CPUs for the one Slurm task per node (1..1024; it hosts every training process of the node)."""
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
    max_requeues: int = 3
    """How many times a job may requeue itself after preemption or time-out (0..100)."""
    defaults: TrainingDefaults = TrainingDefaults()
    """Strategy options used unless the command line says otherwise."""

    @property
    def default_procs_per_node(self) -> int:
        return self.procs_per_node or self.gpus_per_node or 1

    @property
    def supports_bf16(self) -> bool:
        return self.gpus_per_node == 0 or (self.gpu_type or "").lower() not in GPUS_WITHOUT_BF16

    @property
    def supports_fp16(self) -> bool:
        return self.gpus_per_node > 0


# ---------------------------------------------------------------------------
# Validation: the fast path for plainly valid values, pydantic for everything else.

_I64 = 2**63


def _valid_str(value: Any) -> bool:
    if type(value) is not str:
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")  # lone surrogates: pydantic's to judge
    except UnicodeEncodeError:
        return False
    return True


def _valid_bool(value: Any) -> bool:
    return type(value) is bool


def _int_range(low: int, high: int | None = None) -> Callable[[Any], bool]:
    top = _I64 - 1 if high is None else high
    return lambda value: type(value) is int and low <= value <= top


def _choice(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: any(type(value) is type(a) and value == a for a in allowed)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _passes(check: Callable[[Any], Any]) -> Callable[[Any], bool]:
    def ok(value: Any) -> bool:
        try:
            check(value)
        except ValueError:
            return False
        return True

    return ok


def _all(*checks: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: all(check(value) for check in checks)


def _str_list(value: Any) -> bool:
    return type(value) is list and all(_valid_str(item) for item in value)


def _scalar_map(value: Any) -> bool:
    """``dict[str, str | int | bool]`` with plain types only (floats, None, big ints: pydantic's call)."""
    return type(value) is dict and all(
        _valid_str(k) and (type(v) is bool or (type(v) is int and -_I64 <= v < _I64) or _valid_str(v))
        for k, v in value.items()
    )


_line = _optional(_all(_valid_str, _passes(_check_single_line)))

_FAST_CHECKS: dict[type[_Record], dict[str, Callable[[Any], bool]]] = {
    NodeLimits: {"default": _int_range(1), "max": _int_range(1)},
    PortRange: {"start": _int_range(1024, 65535), "end": _int_range(1024, 65535)},
    PreTimeoutSignal: {"name": _choice(*_SIGNALS), "seconds_before": _int_range(10, 3600)},
    TrainingDefaults: {
        "strategy": _choice(*_STRATEGY_NAMES),
        "fsdp_version": _choice(1, 2),
        "mixed_precision": _choice("no", "fp16", "bf16"),
        "wrap_cls": _optional(_valid_str),
        "state_dict": _choice("sharded", "full"),
        "activation_checkpointing": _valid_bool,
        "offload": _valid_bool,
    },
    ClusterProfile: {
        "description": _valid_str,
        "scheduler": _choice("slurm", "local"),
        "partition": _line,
        "account": _line,
        "qos": _line,
        "time_limit": _all(_valid_str, _passes(_check_slurm_time), _passes(_check_single_line)),
        "gpus_per_node": _int_range(0, 64),
        "gpu_type": _line,
        "procs_per_node": _optional(_int_range(1, 256)),
        "cpus_per_task": _int_range(1, 1024),
        "mem": _optional(_all(_valid_str, _passes(_check_slurm_mem))),
        "constraint": _line,
        "exclusive": _valid_bool,
        "extra_sbatch": _all(_scalar_map, _passes(_check_sbatch_keys)),
        "setup": _str_list,
        "env": _all(_scalar_map, _passes(_check_env_names)),
        "network_interface": _line,
        "rdzv_backend": _choice("c10d", "static"),
        "max_requeues": _int_range(0, 100),
    },
}

_FAST_AFTER: dict[type[_Record], Callable[[dict[str, Any]], None]] = {
    NodeLimits: lambda v: _check_node_limits(v["default"], v["max"]),
    PortRange: lambda v: _check_port_range(v["start"], v["end"]),
    ClusterProfile: lambda v: _check_profile(v["scheduler"], v["partition"], v["procs_per_node"], v["gpus_per_node"]),
}


def _fast_validate(cls: type[_R], data: Any) -> _R | None:
    """``cls`` from ``data`` if every key is known and every value plainly valid, else None.

    None means "ask pydantic", never "invalid": anything unusual is left to the schema, so this
    may only be stricter than pydantic, never laxer, and gives the values pydantic would.
    """
    if type(data) is not dict:
        return None
    fields = cls.model_fields
    if any(key not in fields for key in data):
        return None
    checks = _FAST_CHECKS[cls]
    values: dict[str, Any] = {}
    for name, default in fields.items():
        if name in data:
            value = data[name]
            if isinstance(default, _Record):
                if type(value) is not type(default):
                    value = _fast_validate(type(default), value)
                    if value is None:
                        return None
            elif not checks[name](value):
                return None
            elif type(value) is dict or type(value) is list:
                value = value.copy()
        elif default is _REQUIRED:
            return None
        else:
            value = default.copy() if isinstance(default, (dict, list)) else default
        values[name] = value
    after = _FAST_AFTER.get(cls)
    if after is not None:
        try:
            after(values)
        except ValueError:
            return None
    return cls._make(values)


def _from_model(cls: type[_R], model: BaseModel) -> _R:
    """The record holding exactly the values of a validated pydantic model."""
    values: dict[str, Any] = {}
    for name, default in cls.model_fields.items():
        value = getattr(model, name)
        if isinstance(default, _Record):
            value = _from_model(type(default), value)
        elif isinstance(value, (dict, list)):
            value = value.copy()
        values[name] = value
    return cls._make(values)


def _validate(cls: type[_R], data: Any, strict: bool | None = None) -> _R:
    """Fast path first; otherwise pydantic decides (and raises its ValidationError)."""
    fast = _fast_validate(cls, data)
    if fast is not None:
        return fast
    model = _schema()[cls.__name__]
    validated = model.model_validate(data) if strict is None else model.model_validate(data, strict=strict)
    return _from_model(cls, validated)


@lru_cache(maxsize=1)
def _schema() -> dict[str, type[BaseModel]]:
    """The pydantic models, built on first use: the authority on validity and error wording.

    Same keys, order and defaults as the records above (tests/test_profiles.py compares them);
    documentation lives on the records.
    """
    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

    class _Strict(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    class NodeLimits(_Strict):
        default: int = Field(1, ge=1)
        max: int = Field(1, ge=1)

        @model_validator(mode="after")
        def _default_within_max(self) -> Any:
            _check_node_limits(self.default, self.max)
            return self

    class PortRange(_Strict):
        start: int = Field(29500, ge=1024, le=65535)
        end: int = Field(29999, ge=1024, le=65535)

        @model_validator(mode="after")
        def _ordered(self) -> Any:
            _check_port_range(self.start, self.end)
            return self

    class PreTimeoutSignal(_Strict):
        name: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = "USR2"
        seconds_before: int = Field(120, ge=10, le=3600)

    class TrainingDefaults(_Strict):
        strategy: StrategyName = "ddp"
        fsdp_version: Literal[1, 2] = 2
        mixed_precision: MixedPrecision = "no"
        wrap_cls: str | None = None
        state_dict: Literal["sharded", "full"] = "sharded"
        activation_checkpointing: bool = False
        offload: bool = False

    class ClusterProfile(_Strict):
        description: str = ""
        scheduler: Literal["slurm", "local"]
        partition: str | None = None
        account: str | None = None
        qos: str | None = None
        time_limit: str = "01:00:00"
        nodes: NodeLimits = NodeLimits()
        gpus_per_node: int = Field(0, ge=0, le=64)
        gpu_type: str | None = None
        procs_per_node: int | None = Field(None, ge=1, le=256)
        cpus_per_task: int = Field(1, ge=1, le=1024)
        mem: str | None = None
        constraint: str | None = None
        exclusive: bool = False
        extra_sbatch: dict[str, str | int | bool] = {}
        setup: list[str] = []
        env: dict[str, str | int | bool] = {}
        network_interface: str | None = None
        rdzv_backend: Literal["c10d", "static"] = "c10d"
        port_range: PortRange = PortRange()
        signal: PreTimeoutSignal = PreTimeoutSignal()
        max_requeues: int = Field(3, ge=0, le=100)
        defaults: TrainingDefaults = TrainingDefaults()

        @field_validator("time_limit")
        @classmethod
        def _slurm_time(cls, value: str) -> str:
            return _check_slurm_time(value)

        @field_validator("partition", "account", "qos", "constraint", "gpu_type", "time_limit", "network_interface")
        @classmethod
        def _single_line(cls, value: str | None) -> str | None:
            return _check_single_line(value)

        @field_validator("mem")
        @classmethod
        def _slurm_mem(cls, value: str | None) -> str | None:
            return _check_slurm_mem(value)

        @field_validator("env")
        @classmethod
        def _env_names(cls, value: dict[str, Any]) -> dict[str, Any]:
            return _check_env_names(value)

        @field_validator("extra_sbatch")
        @classmethod
        def _sbatch_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
            return _check_sbatch_keys(value)

        @model_validator(mode="after")
        def _consistent(self) -> Any:
            _check_profile(self.scheduler, self.partition, self.procs_per_node, self.gpus_per_node)
            return self

    models: list[type[BaseModel]] = [NodeLimits, PortRange, PreTimeoutSignal, TrainingDefaults, ClusterProfile]
    return {m.__name__: m for m in models}


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
            parent_model = _model_at(_schema()["ClusterProfile"], loc[:-1])
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


# ---------------------------------------------------------------------------
# Loading


#: Parsed profiles (YAML text -> data) kept across runs: importing PyYAML and parsing cost about
#: a fifth of ``orchestrator render`` (issue #7). Only texts whose data passed the fast check are
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


def parse_profile(text: str, source: str) -> ClusterProfile:
    """Parse and validate profile YAML; ``source`` names it in every error."""
    cached = _load_parse_cache().get(text)
    if cached is not None:
        fast = _fast_validate(ClusterProfile, cached)
        if fast is not None:
            return fast
    import yaml  # here, not at the top: commands that never load a profile skip its import

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
    fast = _fast_validate(ClusterProfile, data)
    if fast is not None:
        _store_parse_cache(text, data)
        return fast
    from pydantic import ValidationError

    try:
        return _validate(ClusterProfile, data)
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
