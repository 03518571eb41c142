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
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.plan import build_plan, merge_options
from orchestrator.config.profile.load import (
    ClusterProfile,
    parse_profile,
)
from orchestrator.config.render import render_accelerate_config, render_sbatch, sample_runtime
from orchestrator.contract.errors import UserError
from tests.helpers.cli import REPO
from tests.helpers.profile_docs import FAST, documents, profile_like

SOURCE = "cluster_profiles/fuzz.yaml"


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
    """Guard against a generator that only ever produces garbage, and against a parser that refuses
    what it should accept: valid profiles that set more than the scheduler, across many keys.

    ``valid > 0`` alone held for any parser that accepts ``{scheduler: local}``, the first example
    Hypothesis tries. Derandomized, so the count is the same on every run (16 documents, 11 keys
    when written); the floors leave room for a changed generator."""
    valid = 0
    keys: set[str] = set()

    @settings(FAST, max_examples=200, derandomize=True)
    @given(profile_like)
    def count(document: dict[str, Any]) -> None:
        nonlocal valid
        profile = check_outcome(yaml.safe_dump({"scheduler": "local", **document}))
        beyond = {str(k) for k in document} - {"scheduler"}
        if profile is not None and beyond:
            exercise(profile)
            valid += 1
            keys.update(beyond)

    count()
    assert valid >= 8, (valid, sorted(keys))
    assert len(keys) >= 6, sorted(keys)


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
