"""Installed non-editable, from anywhere, the package still finds its templates and built-in profiles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import REPO


@pytest.mark.slow
def test_wheel_install_finds_templates_and_profiles(tmp_path: Path) -> None:
    target = tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    assert (target / "orchestrator" / "job_templates" / "sbatch.sh.j2").is_file()
    assert (target / "orchestrator" / "cluster_profiles" / "slurm_a100.yaml").is_file()
    assert (target / "orchestrator" / "ui" / "static" / "app.js").is_file()  # orchestrator ui's pages
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    for args in (
        ["profiles", "list"],
        ["render", "--profile", "slurm_a100", "--strategy", "hybrid_shard", "--", "t.py"],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "orchestrator", *args],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        # nothing came from the checkout (the interpreter may live there: a venv in the clone, as CI's)
        assert str(REPO) not in res.stdout.replace(sys.executable, "<python>")
    assert "parallelism_config_dp_replicate_size: 2" in res.stdout
    assert (
        "slurm_h100"
        in subprocess.run(
            [sys.executable, "-m", "orchestrator", "profiles", "list"],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )


def test_every_subpackage_is_declared_for_the_wheel() -> None:
    """pyproject lists packages explicitly: a subpackage left out works in an editable install (the
    tests') and is missing from a real one (``pip install .``: orchestrator.schedulers once was)."""
    import tomllib

    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "orchestrator").rglob("__init__.py")
        if "__pycache__" not in p.parts and p.parent.name not in ("job_templates", "cluster_profiles")
    }
    assert found <= declared, f"not in pyproject's packages: {sorted(found - declared)}"
