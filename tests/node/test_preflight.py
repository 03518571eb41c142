"""A node's part of the preflight (:mod:`orchestrator.node.preflight`) with the real podman: the image
asked about is a name after ``podman image exists``'s end of options, so a name podman would read as
a flag (``--help`` answered "exists") is never taken for a present image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.node.preflight import image_problems
from tests.helpers.podman import import_shell_image, private_podman
from tests.helpers.preconditions import require_debian_packages


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    require_debian_packages("podman", "runc")
    with private_podman(tmp_path) as env:
        for name in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF"):
            monkeypatch.setenv(name, env[name])
        import_shell_image(env, tmp_path, "localhost/present:1")
        yield


@pytest.mark.usefixtures("store")
def test_podman_image_check_reads_every_name_as_an_image() -> None:
    assert image_problems(("podman", "localhost/present:1")) == []
    for name in ("localhost/absent:1", "--help", "-h", "--version"):
        assert image_problems(("podman", name)) == [
            f"container image {name} not in this node's podman storage"
        ]
