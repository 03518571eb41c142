"""The podman line :mod:`orchestrator.config.container` renders, run by the real podman (no cluster):
an image by name stands after podman's end of options (``--``), so a value that got past every check
would be read as an image, never as a flag; a root filesystem folder runs without one (podman 4.3
would run ``--`` as the command there). Each run has a store of its own (``private_podman``)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import container
from tests.helpers.container_image import MARKER, build_image
from tests.helpers.container_plans import plan_with
from tests.helpers.podman import import_shell_image, private_podman
from tests.helpers.preconditions import require_debian_packages

#: What the node command is replaced with: says it ran, and whether it holds every capability.
PROBE = "env sh -c 'echo probe-ran; grep CapEff /proc/self/status'"


@pytest.fixture
def podman(tmp_path: Path) -> Iterator[dict[str, str]]:
    require_debian_packages("podman", "runc")
    with private_podman(tmp_path) as env:
        yield env


def _run(line: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=120)


def test_an_image_by_name_follows_the_end_of_podmans_options(podman: dict[str, str], tmp_path: Path) -> None:
    import_shell_image(podman, tmp_path, "localhost/shell:1")
    (tmp_path / "run").mkdir()
    line = container.wrap_command(
        plan_with("podman", image="localhost/shell:1"), str(tmp_path / "run"), PROBE
    )
    assert " -- localhost/shell:1 env " in line, line
    done = _run(line, podman)
    assert done.returncode == 0 and "probe-ran" in done.stdout, done.stdout + done.stderr


def test_an_option_like_image_let_through_is_an_image_name_to_podman(
    podman: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check bypassed (``runtime_argument`` made to let anything through): ``--privileged`` in
    the image's place. Without the end of options podman took it as its flag and the command's first
    word (``env``, an image anyone can tag) as the image, and ran the probe privileged."""
    import_shell_image(podman, tmp_path, "localhost/env:latest")
    (tmp_path / "run").mkdir()
    monkeypatch.setattr(container, "runtime_argument", lambda value, key: value)
    line = container.wrap_command(plan_with("podman", image="--privileged"), str(tmp_path / "run"), PROBE)
    done = _run(line, podman)
    assert done.returncode == 125 and "probe-ran" not in done.stdout, done.stdout + done.stderr
    assert "invalid reference format" in done.stderr, done.stderr


def test_a_root_filesystem_folder_runs_without_an_end_of_options(
    podman: dict[str, str], tmp_path: Path
) -> None:
    rootfs = build_image()
    (tmp_path / "run").mkdir()
    probe = f"env sh -c 'echo probe-ran; cat /{MARKER}'"
    line = container.wrap_command(plan_with("podman", image=str(rootfs)), str(tmp_path / "run"), probe)
    assert f"--rootfs {rootfs}:O env " in line, line
    done = _run(line, podman)
    assert done.returncode == 0 and "probe-ran" in done.stdout, done.stdout + done.stderr
    assert (rootfs / MARKER).read_text() in done.stdout
