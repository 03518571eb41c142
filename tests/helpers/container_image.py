"""A test container image built offline from this machine's own files: a root filesystem with a
Python, torch and accelerate, and WITHOUT orchestrator and submitit (what a user's image has).

Files are hard links (``os.link``) to the machine's own, so a build costs metadata only (no bytes
are copied) and the rootfs needs no registry. Hard links share inodes with the host's files: the
image is mounted read-only by every test that runs it. The build is cached under
:data:`CACHE_ROOT` keyed by a hash of its recipe (this file, the interpreter, the package versions);
a build is made in a temporary folder and renamed into place, so a killed build is never reused.

What goes in: the shared libraries (``/usr/lib/<triplet>``, ``/usr/lib64``), ``/usr/bin`` (a shell,
``env``), a few files of ``/etc``, the interpreter's installation (``sys.base_prefix``, minus its
``site-packages`` and test folders) and, as its ``site-packages``, exactly the files the installed
distributions of torch, accelerate and their dependencies list (``importlib.metadata``): never a
package they do not need, so never orchestrator or submitit. ``/etc/container-test-image`` is the
image's marker file (its recipe hash), which ranks inside can see and the host cannot.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

CACHE_ROOT = Path("/var/cache/orchestrator-test-image")
MARKER = "etc/container-test-image"
#: What the image must offer: the training stack, not the orchestration stack.
ROOT_DISTRIBUTIONS = ("torch", "accelerate", "numpy")
#: Never in the image, whatever depends on them.
FORBIDDEN = ("orchestrator", "submitit")
_ETC_FILES = ("passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "host.conf")
_SKIP_IN_PREFIX = {"site-packages", "test", "idlelib", "tkinter", "__pycache__", "ensurepip"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure() -> list[metadata.Distribution]:
    """The installed distributions torch and accelerate need, following their ``Requires-Dist``
    (markers evaluated for this interpreter, extras ignored)."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = list(ROOT_DISTRIBUTIONS)
    while todo:
        name = _normalise(todo.pop())
        if name in seen or name in FORBIDDEN:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen.values(), key=lambda d: _normalise(d.metadata["Name"]))


def recipe_hash() -> str:
    parts = [Path(__file__).read_text(), sys.base_prefix, sys.version]
    parts += [f"{d.metadata['Name']}=={d.version}" for d in _closure()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _link_tree(src: Path, dst: Path, skip: set[str] | None = None) -> None:
    """Hard-link every file of ``src`` into ``dst`` (links copied as links)."""
    skip = skip or set()
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in skip]
        rel = Path(root).relative_to(src)
        target = dst / rel
        target.mkdir(parents=True, exist_ok=True)
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            _link_one(Path(root) / name, target / name)


def _link_one(src: Path, dst: Path) -> None:
    if dst.exists() or dst.is_symlink():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_file():
        try:
            os.link(src, dst)
        except OSError:  # another filesystem: copy
            shutil.copy2(src, dst)


def image_python() -> str:
    """The interpreter's path inside the image: the same path as this machine's base interpreter."""
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")


def build_image(cache_root: Path = CACHE_ROOT) -> Path:
    """The image's root filesystem (built, or found in the cache)."""
    key = recipe_hash()
    final = cache_root / key / "rootfs"
    if (final / MARKER).exists():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache_root))
    root = work / "rootfs"
    triplet = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    for sub in ("usr/bin", f"usr/lib/{triplet}", "usr/lib64", "usr/share/zoneinfo"):
        if Path("/", sub).is_dir():
            _link_tree(Path("/", sub), root / sub, {"__pycache__", "dist-packages", "site-packages"})
    for name, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/bin")):
        os.symlink(target, root / name)
    for name in _ETC_FILES:
        if Path("/etc", name).exists():
            _link_one(Path("/etc", name), root / "etc" / name)
    for d in ("tmp", "proc", "sys", "dev", "root", "run", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    prefix = Path(sys.base_prefix)
    _link_tree(prefix, root / prefix.relative_to("/"), _SKIP_IN_PREFIX)
    purelib = Path(sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"])
    site = root / purelib.relative_to("/")
    for dist in _closure():
        base = Path(str(dist.locate_file("")))
        for f in dist.files or []:
            src = Path(os.path.normpath(str(dist.locate_file(f))))
            if src.is_relative_to(base) and (src.is_file() or src.is_symlink()):
                _link_one(src, site / src.relative_to(base))
    for name in ("hosts", "resolv.conf", "hostname"):  # every image has them (runtimes mount over them)
        (root / "etc" / name).touch()
    (root / MARKER).write_text(key + "\n")
    try:
        os.rename(work, cache_root / key)
    except OSError:  # built meanwhile by another process: use theirs
        shutil.rmtree(work, ignore_errors=True)
    for stale in cache_root.iterdir():  # images of older recipes (hard links: inodes, little space)
        if stale.name != key and not stale.name.startswith("."):
            shutil.rmtree(stale, ignore_errors=True)
    return final


def forbidden_in_image(rootfs: Path) -> list[str]:
    """Paths in the image named after a forbidden package (orchestrator, submitit): must be none."""
    found = []
    for root, dirs, files in os.walk(rootfs):
        for name in dirs + files:
            if any(name.lower().startswith(f) for f in FORBIDDEN):
                found.append(str(Path(root, name).relative_to(rootfs)))
    return found


def debian_image_once(timeout_s: float = 1500) -> Path:
    """:func:`tests.helpers.debian_image.build_debian_image`, one builder at a time on this machine:
    the suite's two workers both want it (an early test warms it on one worker while the cluster's
    tests run on the other), and two debootstraps into one cache would both download 5 GB. The lock
    is a file beside the cache (not in debian_image.py: its text is the cache key)."""
    import fcntl
    import time

    from tests.helpers.debian_image import CACHE_ROOT, build_debian_image

    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(CACHE_ROOT.parent / "orchestrator-test-debian.lock", "w") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another build of the Debian image held the lock {timeout_s:.0f} s"
                    ) from None
                time.sleep(1)
        return build_debian_image()
