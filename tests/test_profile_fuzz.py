"""Fuzzing profiles: whatever the YAML holds, the outcome is a ClusterProfile or a UserError.

Random YAML-able structures (mappings with known and random keys, values of random
types, nested) go through ``parse_profile``; any other exception is a bug. Valid
profiles go on through planning and rendering, where again only UserError may come
out. A few examples also go through the real CLI (slower): exit 0 or 2, never a
traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import UserError
from orchestrator.options import OPTIONS
from orchestrator.plan import build_plan, merge_options
from orchestrator.profiles import (
    ClusterProfile,
    NodeLimits,
    PortRange,
    PreTimeoutSignal,
    TrainingDefaults,
    parse_profile,
)
from orchestrator.render import render_accelerate_config, render_sbatch, sample_runtime

REPO = Path(__file__).resolve().parents[1]
SOURCE = "cluster_profiles/fuzz.yaml"

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


def check_outcome(text_in: str) -> ClusterProfile | None:
    """parse_profile either returns a profile or raises UserError naming the source on every line."""
    try:
        profile = parse_profile(text_in, SOURCE)
    except UserError as exc:
        message = str(exc)
        assert message, "empty error message"
        for line in message.splitlines():
            assert line.startswith(f"{SOURCE}: "), line
        return None
    assert isinstance(profile, ClusterProfile)
    return profile


def exercise(profile: ClusterProfile) -> None:
    """A valid profile: planning refuses with UserError or gives a plan that renders."""
    again = parse_profile(yaml.safe_dump(profile.model_dump(mode="json")), SOURCE)
    assert again == profile
    try:
        plan = build_plan("fuzz", profile, merge_options(profile), "train.py")
    except UserError:
        return
    for rank in range(plan.nodes):
        yaml.safe_load(render_accelerate_config(plan, sample_runtime(plan, rank)))
    if profile.scheduler == "slurm":
        render_sbatch(plan, "/RUN", "/RUN/submitit", "python3")


# ------------------------------------------------------------------------------ properties


@FAST
@given(documents)
def test_structures_give_profile_or_user_error(document: Any) -> None:
    profile = check_outcome(yaml.safe_dump(document, allow_unicode=True))
    if profile is not None:
        exercise(profile)


@settings(FAST, max_examples=100)
@given(st.text(max_size=200))
def test_raw_text_gives_profile_or_user_error(raw: str) -> None:
    check_outcome(raw)


@settings(FAST, max_examples=100)
@given(profile_like)
def test_near_valid_profiles(document: dict[str, Any]) -> None:
    """Most of these are close to valid: a good share must get through to planning."""
    document = {"scheduler": "local", **document}
    profile = check_outcome(yaml.safe_dump(document, allow_unicode=True))
    if profile is not None:
        exercise(profile)


def test_generator_reaches_valid_profiles() -> None:
    """Guard against a generator that only ever produces garbage."""
    valid = 0

    @settings(FAST, max_examples=100)
    @given(profile_like)
    def count(document: dict[str, Any]) -> None:
        nonlocal valid
        if check_outcome(yaml.safe_dump({"scheduler": "local", **document})) is not None:
            valid += 1

    count()
    assert valid > 0


# ------------------------------------------------------------------------------ through the CLI


@settings(FAST, max_examples=6)
@given(documents)
def test_cli_fuzz(tmp_path_factory: Any, document: Any) -> None:
    work = tmp_path_factory.mktemp("fuzz")
    (work / "cluster_profiles").mkdir()
    (work / "cluster_profiles" / "fuzz.yaml").write_text(
        yaml.safe_dump(document, allow_unicode=True), encoding="utf-8"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "render", "--profile", "fuzz"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 2), proc.stderr
    if proc.returncode == 2:
        lines = proc.stderr.strip().splitlines()
        assert lines and all(line.startswith(("orchestrator render: error: ", SOURCE)) for line in lines), (
            lines
        )
