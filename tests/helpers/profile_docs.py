"""Hypothesis generators of profile documents: valid, near-valid and arbitrary."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from orchestrator.config.options import OPTIONS
from orchestrator.config.profile.load import (
    ClusterProfile,
    NodeLimits,
    PortRange,
    PreTimeoutSignal,
    TrainingDefaults,
)

FAST = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# ------------------------------------------------------------------------------ generators

text = st.text(max_size=12)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
    st.sampled_from(
        ["slurm", "local", "ddp", "full_shard", "bf16", "fp16", "no", "01:00:00", "480G", "0", "two", ""]
    ),
)
any_value = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(text, st.integers(-5, 5), st.booleans(), st.none()), children, max_size=4),
    ),
    max_leaves=12,
)


def model_dict(model: type, extra_keys: bool = True) -> st.SearchStrategy[dict[Any, Any]]:
    """A mapping with some of the model's own keys, plausible or random values, maybe a stray key."""
    fields = list(model.model_fields)  # type: ignore[attr-defined]
    keys = st.sampled_from(fields)
    if extra_keys:
        keys = st.one_of(keys, keys.map(lambda k: k[:-1] or "x"), text)
    return st.dictionaries(keys, st.deferred(lambda: plausible | any_value), max_size=8)


small_ints = st.integers(min_value=-2, max_value=70)
plausible = st.one_of(
    small_ints,
    st.sampled_from(
        ["slurm", "local", "gpu", "a100", "v100", "h100", "USR2", "KILL", "c10d", "static", "sharded", "full"]
    ),
    st.sampled_from(
        ["01:00:00", "2-00:00:00", "90", "1-2", "25:61:61", "4:00:00", "480G", "64000M", "0", "lots"]
    ),
    st.dictionaries(
        st.sampled_from(["default", "max", "start", "end", "name", "seconds_before"]), small_ints, max_size=3
    ),
    st.dictionaries(
        st.sampled_from([o.name for o in OPTIONS]),
        st.sampled_from([*(c for o in OPTIONS for c in o.spec.choices), 3, "fp8", True, None, "Block"]),
        max_size=4,
    ),  # fmt: skip
    st.dictionaries(
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True),
        st.one_of(text, small_ints, st.booleans()),
    ),
    st.lists(text, max_size=3),
)

profile_like = st.fixed_dictionaries(
    {},
    optional={
        "scheduler": st.one_of(st.sampled_from(["slurm", "local"]), any_value),
        "partition": st.one_of(st.sampled_from(["gpu", "debug"]), any_value),
        "gpus_per_node": st.one_of(st.integers(0, 9), any_value),
        "procs_per_node": st.one_of(st.integers(1, 9), any_value),
        "nodes": st.one_of(model_dict(NodeLimits), any_value),
        "port_range": st.one_of(model_dict(PortRange), any_value),
        "signal": st.one_of(model_dict(PreTimeoutSignal), any_value),
        "defaults": st.one_of(model_dict(TrainingDefaults), any_value),
        "gpu_type": st.one_of(st.sampled_from(["a100", "v100", "h100"]), any_value),
        "python": st.one_of(st.sampled_from(["python3", "/opt/venv/bin/python", "py\nthon", ""]), any_value),
        "env": st.one_of(
            st.dictionaries(text, st.one_of(text, small_ints, st.booleans()), max_size=3), any_value
        ),
        "extra_sbatch": st.one_of(
            st.dictionaries(text, st.one_of(text, st.booleans()), max_size=2), any_value
        ),
    },
).flatmap(lambda base: model_dict(ClusterProfile).map(lambda extra: {**extra, **base}))

documents = st.one_of(profile_like, model_dict(ClusterProfile), any_value)
