"""Preconditions a test cannot run without: a skip on a developer's machine, a failure in CI.

A test that quietly skips in CI makes the suite thinner without anyone noticing (a cluster started
in the wrong mode, a missing package). So every skip goes through :func:`require`, which fails
instead when ``CI`` is set (``.ci/run`` exports ``CI=1``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(condition: bool, reason: str) -> None:
    """Skip the test without ``condition`` (fail it in CI)."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"{reason} - CI is set, so this is a failure, not a skip", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_modules(*names: str) -> None:
    for name in names:
        require(importlib.util.find_spec(name) is not None, f"needs the {name} package")
