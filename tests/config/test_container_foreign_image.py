"""The image nobody here built (``tests/helpers/debian_image.py``: Debian by debootstrap, its own
Python, torch and accelerate from PyPI), built or found in the machine's cache early in the suite, on
the worker that does not run the cluster's tests (marker ``warms_cache``, ordered by
``tests/conftest.py``): the cluster's OCI test then finds it built instead of waiting ~3 minutes for
it on the cluster's worker. What it checks is what that test relies on the image for."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers.container_image import debian_image_once, forbidden_in_image
from tests.helpers.debian_image import PYTHON, PYTHON_MINOR, REQUIREMENTS

pytestmark = [pytest.mark.slow, pytest.mark.warms_cache]


def test_the_foreign_image_has_its_own_python_torch_and_accelerate_and_no_orchestrator() -> None:
    root = debian_image_once()
    assert forbidden_in_image(root) == [], "the image must not contain orchestrator or submitit"
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    version = subprocess.run(
        [chroot, str(root), PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/root"},
    )
    assert version.returncode == 0, version.stderr
    assert (
        version.stdout.strip() == PYTHON_MINOR != f"{sys.version_info[0]}.{sys.version_info[1]}"
    )  # not the host's
    site = root / "opt" / "venv" / "lib" / f"python{PYTHON_MINOR}" / "site-packages"
    for requirement in REQUIREMENTS:
        name, version_pin = requirement.split("==")
        assert list(site.glob(f"{name}-{version_pin}*.dist-info")), (
            requirement,
            sorted(site.glob("*.dist-info"))[:20],
        )
