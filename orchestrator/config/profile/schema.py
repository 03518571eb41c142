"""Profile validation: a fast path without pydantic, the pydantic schema, and error wording.

Why two layers: importing pydantic and building its models costs more than the rest of
``orchestrator render`` together. So a profile whose every value is plainly valid (the common
case: the shipped profiles, job.json written by us) is checked by :func:`fast_validate` without
pydantic. Anything it is not sure about -- an unknown key, a wrong type, a value out of range, a
float, a bool where an int goes -- goes to the pydantic schema (:func:`schema`, built on first
use), which decides and words the errors. pydantic runs in strict mode: YAML already carries
types, so ``nodes: "2"`` is a mistake worth reporting, not something to coerce.

The fast path only ever accepts a subset of what pydantic accepts, with the same values;
tests/config/profile/test_schema.py checks that on fuzzed documents, and that both layers list
the same keys and defaults. The ``defaults:`` block's checks and model are derived from
:data:`orchestrator.config.options.OPTIONS`, so they cannot drift from the options' declaration.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from orchestrator.config.options import OPTIONS, Option
from orchestrator.config.profile import container_keys as _container
from orchestrator.config.profile import notify_keys as _notify
from orchestrator.config.profile.login_keys import LOGIN_FAST_CHECKS, login_model
from orchestrator.config.profile.records import (
    _REQUIRED,
    _SIGNALS,
    VALIDATORS,
    ClusterProfile,
    Login,
    NodeLimits,
    PortRange,
    Preflight,
    PreTimeoutSignal,
    TrainingDefaults,
    _check_env_names,
    _check_interpreter,
    _check_node_limits,
    _check_port_range,
    _check_profile,
    _check_sbatch_keys,
    _check_single_line,
    _check_slurm_mem,
    _check_slurm_time,
    _Record,
)
from orchestrator.config.scheduler_kinds import SCHEDULER_NAMES, SchedulerName

if TYPE_CHECKING:
    from pydantic import BaseModel

_R = TypeVar("_R", bound=_Record)

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


def _valid_float(value: Any) -> bool:
    """Plainly valid: a finite float (an int, ``.inf`` or ``.nan`` goes to pydantic, then the plan check)."""
    return type(value) is float and value == value and abs(value) != float("inf")


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


def _check_budget(value: str) -> str:
    """A budget's text (``200gpu-h``): ValueError with the reason otherwise (pydantic words it)."""
    from orchestrator.config.budget import EXPECTED, parse_budget
    from orchestrator.contract.errors import UserError

    try:
        return str(parse_budget(value, "budget"))
    except UserError:
        raise ValueError(f"expected {EXPECTED}, got {value!r}") from None


_line = _optional(_all(_valid_str, _passes(_check_single_line)))


def _type_check(annotation: Any) -> Callable[[Any], bool]:
    """The fast check of a plain annotation; an unknown one is a declaration error, found at import."""
    if annotation is bool:
        return _valid_bool
    if annotation is str:
        return _valid_str
    if annotation is int:
        return _int_range(-_I64, _I64 - 1)
    if annotation is float:
        return _valid_float
    args = typing.get_args(annotation)
    if (
        typing.get_origin(annotation) in (typing.Union, types.UnionType)
        and len(args) == 2
        and type(None) in args
    ):
        return _optional(_type_check(next(a for a in args if a is not type(None))))
    raise TypeError(f"no fast check for the annotation {annotation!r}")


def _option_check(o: Option) -> Callable[[Any], bool]:
    return _choice(*o.spec.choices) if o.spec.choices else _type_check(o.type)


_FAST_CHECKS: dict[type[_Record], dict[str, Callable[[Any], bool]]] = {
    NodeLimits: {"default": _int_range(1), "max": _int_range(1)},
    PortRange: {"start": _int_range(1024, 65535), "end": _int_range(1024, 65535)},
    PreTimeoutSignal: {"name": _choice(*_SIGNALS), "seconds_before": _int_range(10, 3600)},
    TrainingDefaults: {o.name: _option_check(o) for o in OPTIONS},
    Preflight: {
        "enabled": _valid_bool,
        "timeout_s": _int_range(5, 3600),
        "max_latency_ms": _all(_valid_float, lambda v: v > 0),
        "min_bandwidth_mbps": _all(_valid_float, lambda v: v >= 0),
        "min_free_mb": _int_range(0),
    },
    Login: LOGIN_FAST_CHECKS,
    _container.Container: _container.FAST_CHECKS,
    _notify.Notify: _notify.FAST_CHECKS,
    ClusterProfile: {
        "description": _valid_str,
        "scheduler": _choice(*SCHEDULER_NAMES),
        "partition": _line,
        "account": _line,
        "qos": _line,
        "time_limit": _all(_valid_str, _passes(_check_slurm_time), _passes(_check_single_line)),
        "gpus_per_node": _int_range(0, 64),
        "gpu_type": _line,
        "procs_per_node": _optional(_int_range(1, 256)),
        "cpus_per_task": _int_range(1, 1024),
        "max_procs_per_node": _optional(_int_range(1, 1024)),
        "share_with_group": _valid_bool,
        "mem": _optional(_all(_valid_str, _passes(_check_slurm_mem))),
        "constraint": _line,
        "exclusive": _valid_bool,
        "extra_sbatch": _all(_scalar_map, _passes(_check_sbatch_keys)),
        "setup": _str_list,
        "python": _optional(_all(_valid_str, _passes(_check_interpreter))),
        "env": _all(_scalar_map, _passes(_check_env_names)),
        "network_interface": _line,
        "rdzv_backend": _choice("c10d", "static"),
        "launcher": _choice("direct", "torchrun"),
        "max_requeues": _int_range(0, 100),
        "requeue_as": _choice("auto", "same_job", "new_job"),
        "max_restarts": _int_range(0, 100),
        "spare_nodes": _int_range(0, 64),
        "on_node_loss": _choice("end", "shrink"),
        "hang_timeout": _optional(_int_range(1, 86400)),
        "price_per_gpu_hour": _optional(_all(_valid_float, lambda v: v >= 0)),
        "price_per_cpu_hour": _optional(_all(_valid_float, lambda v: v >= 0)),
        "budget": _optional(_all(_valid_str, _passes(_check_budget))),
    },
}


def _check_cluster(v: dict[str, Any]) -> None:
    """The profile's cross-key rules: its own, then its ``container:`` block's with its scheduler."""
    _check_profile(v["scheduler"], v["partition"], v["procs_per_node"], v["gpus_per_node"])
    _container.check_scheduler(v["scheduler"], v["container"])


_FAST_AFTER: dict[type[_Record], Callable[[dict[str, Any]], None]] = {
    _container.Container: _container.fast_after,
    NodeLimits: lambda v: _check_node_limits(v["default"], v["max"]),
    PortRange: lambda v: _check_port_range(v["start"], v["end"]),
    ClusterProfile: _check_cluster,
}


def fast_validate(cls: type[_R], data: Any) -> _R | None:
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
                    value = fast_validate(type(default), value)
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


def validate(cls: type[_R], data: Any, strict: bool | None = None) -> _R:
    """Fast path first; otherwise pydantic decides (and raises its ValidationError)."""
    fast = fast_validate(cls, data)
    if fast is not None:
        return fast
    model = schema()[cls.__name__]
    validated = model.model_validate(data) if strict is None else model.model_validate(data, strict=strict)
    return _from_model(cls, validated)


@lru_cache(maxsize=1)
def schema() -> dict[str, type[BaseModel]]:
    """The pydantic models, built on first use: the authority on validity and error wording.

    Same keys, order and defaults as the records of :mod:`orchestrator.config.profile.records`
    (tests/config/profile/test_schema.py compares them); documentation lives on the records.
    """
    from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

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

    class Preflight(_Strict):
        enabled: bool = True
        timeout_s: int = Field(60, ge=5, le=3600)
        max_latency_ms: float = Field(20.0, gt=0)
        min_bandwidth_mbps: float = Field(1000.0, ge=0)
        min_free_mb: int = Field(1024, ge=0)

    LoginModel, ContainerModel = login_model(_Strict), _container.model(_Strict)
    NotifyModel = _notify.model(_Strict)

    option_fields: dict[str, Any] = {o.name: (_option_annotation(o), o.default) for o in OPTIONS}
    TrainingDefaults = create_model("TrainingDefaults", __base__=_Strict, **option_fields)

    class ClusterProfile(_Strict):
        description: str = ""
        scheduler: SchedulerName
        partition: str | None = None
        account: str | None = None
        qos: str | None = None
        time_limit: str = "01:00:00"
        nodes: NodeLimits = NodeLimits()
        gpus_per_node: int = Field(0, ge=0, le=64)
        gpu_type: str | None = None
        procs_per_node: int | None = Field(None, ge=1, le=256)
        cpus_per_task: int = Field(1, ge=1, le=1024)
        max_procs_per_node: int | None = Field(None, ge=1, le=1024)
        share_with_group: bool = False
        mem: str | None = None
        constraint: str | None = None
        exclusive: bool = False
        extra_sbatch: dict[str, str | int | bool] = {}
        setup: list[str] = []
        python: str | None = None
        env: dict[str, str | int | bool] = {}
        network_interface: str | None = None
        rdzv_backend: Literal["c10d", "static"] = "c10d"
        launcher: Literal["direct", "torchrun"] = "direct"
        port_range: PortRange = PortRange()
        signal: PreTimeoutSignal = PreTimeoutSignal()
        max_requeues: int = Field(3, ge=0, le=100)
        requeue_as: Literal["auto", "same_job", "new_job"] = "auto"
        max_restarts: int = Field(3, ge=0, le=100)
        spare_nodes: int = Field(0, ge=0, le=64)
        on_node_loss: Literal["end", "shrink"] = "end"
        hang_timeout: int | None = Field(None, ge=1, le=86400)
        price_per_gpu_hour: float | None = Field(None, ge=0, allow_inf_nan=False)
        price_per_cpu_hour: float | None = Field(None, ge=0, allow_inf_nan=False)
        budget: str | None = None
        preflight: Preflight = Preflight()
        defaults: TrainingDefaults = TrainingDefaults()
        login: LoginModel = LoginModel()  # type: ignore[valid-type]
        container: ContainerModel = ContainerModel()  # type: ignore[valid-type]
        notify: NotifyModel = NotifyModel()  # type: ignore[valid-type]

        @field_validator("time_limit")
        @classmethod
        def _slurm_time(cls, value: str) -> str:
            return _check_slurm_time(value)

        @field_validator(
            "partition", "account", "qos", "constraint", "gpu_type", "time_limit", "network_interface"
        )
        @classmethod
        def _single_line(cls, value: str | None) -> str | None:
            return _check_single_line(value)

        @field_validator("budget")
        @classmethod
        def _budget(cls, value: str | None) -> str | None:
            return None if value is None else _check_budget(value)

        @field_validator("python")
        @classmethod
        def _interpreter(cls, value: str | None) -> str | None:
            return _check_interpreter(value)

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
            _container.check_scheduler(self.scheduler, self.container)
            return self

    models: list[type[BaseModel]] = [
        NodeLimits,
        PortRange,
        PreTimeoutSignal,
        Preflight,
        *(LoginModel, ContainerModel, NotifyModel),
        TrainingDefaults,
        ClusterProfile,
    ]
    return {m.__name__: m for m in models}


def _option_annotation(o: Option) -> Any:
    """``Literal[choices]`` where the option has choices (pydantic words it "one of ..."), else its type."""
    return cast(Any, Literal)[o.spec.choices] if o.spec.choices else o.type


VALIDATORS[:] = [validate]  # the records validate through this module (see records.VALIDATORS)
