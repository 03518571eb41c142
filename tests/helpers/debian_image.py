"""An image nobody here built: a Debian root filesystem made by ``debootstrap`` from the package
mirror, with its own Python (another minor than this machine's, trixie's 3.13) and a venv holding
torch and accelerate from PyPI, and neither orchestrator nor submitit (issue 41, item 2).

The test image of :mod:`.container_image` is made of this machine's own files, so every path the
product mounts over exists in it and its interpreter is the host's: it hid that runc could not
create the node side's mount points in a foreign image. This one shares nothing with the host.

The build takes minutes (the mirror, then pip), so it is cached per machine under
:data:`CACHE_ROOT`, keyed by a hash of this file (the recipe); a build is made in a temporary
folder and renamed into place, so a killed build is never reused, and every step has a timeout.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE_ROOT = Path("/var/cache/orchestrator-test-debian")
SUITE = "trixie"
MIRROR = "http://deb.debian.org/debian"
#: The image's interpreter: a venv of the image's own Python.
PYTHON = "/opt/venv/bin/python"
#: What the venv holds, from PyPI (for Python 3.13 PyPI serves torch's CUDA build, which trains on CPU).
REQUIREMENTS = ("torch==2.13.0", "accelerate==1.15.0")
#: The image's marker file (its recipe hash): ranks inside see it, the host does not.
MARKER = "etc/debian-test-image"
#: The Python minor the image has (never the host's: the node side must not depend on it).
PYTHON_MINOR = "3.13"
_STEP_TIMEOUT_S = 900
_HOST_CERTS = "/etc/ssl/certs/ca-certificates.crt"


def recipe_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _run(words: list[str], what: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(words, capture_output=True, text=True, timeout=_STEP_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(
            f"building the Debian test image: {what} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )


def _remove(folder: Path) -> None:
    """Remove a build folder, after unmounting what debootstrap mounted in it (``/proc``, ``/sys``,
    perhaps the host's ``/dev``): a removal across a mount would delete the host's files."""
    inside = str(folder.resolve()) + "/"
    for _ in range(2):
        mounted = [
            line.split()[4].replace("\\040", " ")
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(inside)
        ]
        if not mounted:
            shutil.rmtree(folder, ignore_errors=True)
            return
        for point in sorted(mounted, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=60, check=False)
    raise RuntimeError(f"{folder}: still has mounts inside; not removed")


def build_debian_image(cache_root: Path = CACHE_ROOT) -> Path:
    """The image's root filesystem (built on first use, about 3 minutes, or found in the cache)."""
    key = recipe_hash()
    final = cache_root / key / "rootfs"
    if (final / MARKER).exists():
        return final
    if shutil.which("debootstrap") is None:
        _run(["apt-get", "install", "-y", "debootstrap"], "apt-get install debootstrap")
    cache_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache_root))
    root = work / "rootfs"
    try:
        _run(
            ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", SUITE,
             str(root), MIRROR],
            f"debootstrap {SUITE}",
        )  # fmt: skip
        # pip inside reaches PyPI as pip here does: this machine's name servers and certificates
        # (a proxy's own authority may be among them), both removed after.
        shutil.copy2("/etc/resolv.conf", root / "etc" / "resolv.conf")
        shutil.copy2(_HOST_CERTS, root / "tmp" / "host-certs.pem")
        clean = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
                 "PIP_CERT": "/tmp/host-certs.pem", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # fmt: skip
        chroot = shutil.which("chroot") or "/usr/sbin/chroot"
        _run([chroot, str(root), "/usr/bin/python3", "-m", "venv", "/opt/venv"], "python3 -m venv", clean)
        _run(
            [
                chroot,
                str(root),
                PYTHON,
                "-m",
                "pip",
                "install",
                "--no-cache-dir",
                "--no-input",
                *REQUIREMENTS,
            ],
            "pip install " + " ".join(REQUIREMENTS),
            clean,
        )
        (root / "tmp" / "host-certs.pem").unlink()
        (root / "etc" / "resolv.conf").write_text("")  # the runtimes mount the node's over it
        shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (root / MARKER).write_text(key + "\n")
        os.rename(work, cache_root / key)
    except BaseException:
        _remove(work)
        if not (final / MARKER).exists():  # not built meanwhile by another process
            raise
    for stale in cache_root.iterdir():  # images of older recipes
        if stale.name != key and not stale.name.startswith("."):
            _remove(stale)
    return final
