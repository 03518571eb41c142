"""Static checks as tests: mypy (config in pyproject.toml) and ruff over the whole project."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.cli import REPO


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_mypy_clean() -> None:
    res = _run(["mypy", "orchestrator", "train", "bench"])
    assert res.returncode == 0, f"mypy reported problems:\n{res.stdout}\n{res.stderr}"


def test_ruff_clean() -> None:
    res = _run(["ruff", "check", "orchestrator", "train", "tests", "bench"])
    assert res.returncode == 0, f"ruff reported problems:\n{res.stdout}\n{res.stderr}"


def test_ruff_format_clean() -> None:
    """The tree was formatted once; new code keeps it so (pre-commit runs `ruff format`)."""
    res = _run(["ruff", "format", "--check", "orchestrator", "train", "tests", "bench"])
    assert res.returncode == 0, (
        f"ruff format would change files (run `ruff format .`):\n{res.stdout}\n{res.stderr}"
    )
