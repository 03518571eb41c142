"""podman as the tests run it on this machine: its configuration here, a store of a test's own, and
a tiny image of this machine's shell. (Not in :mod:`.container_image`: that module's text is the test
image's recipe hash, so an edit there rebuilds the image every running test shares.)"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def podman_conf(folder: Path) -> Path:
    """This sandbox's podman needs runc (crun refuses hybrid cgroups) and rlimits it may set (no
    CAP_SYS_RESOURCE: podman's defaults raise them). Given through CONTAINERS_CONF, which sbatch
    exports to a job: the product's podman line stays what a user's cluster runs."""
    soft_files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    procs = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 8192)
    conf = folder / "containers.conf"
    conf.write_text(
        f'[containers]\ndefault_ulimits = ["nofile={soft_files}:{soft_files}", "nproc={procs}:{procs}"]\n'
        '[engine]\nruntime = "runc"\n'
    )
    return conf


@contextmanager
def private_podman(folder: Path) -> Iterator[dict[str, str]]:
    """An environment for podman with :func:`podman_conf` and an image store of its own under
    ``folder`` (vfs): what a test imports is never in the machine's store, nor another test's. Its
    run root is a short folder of /tmp, removed after: under pytest's ``tmp_path`` each ``podman run``
    stalled 20 s (the container's attach socket path is longer than a socket path may be)."""
    store = folder / "podman-store"
    storage = folder / "storage.conf"
    runroot = Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp"))
    storage.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{store}"\nrunroot = "{runroot}"\n')
    try:
        yield {
            **os.environ,
            "CONTAINERS_CONF": str(podman_conf(folder)),
            "CONTAINERS_STORAGE_CONF": str(storage),
        }
    finally:
        shutil.rmtree(runroot, ignore_errors=True)


def import_shell_image(env: dict[str, str], folder: Path, *names: str) -> None:
    """A podman image of a shell, ``env`` and ``grep`` with their libraries (copied from this machine),
    imported into ``env``'s store under each of ``names``."""
    root = folder / "shell-image"
    for tool in ("/bin/sh", "/usr/bin/env", "/bin/grep"):
        found = subprocess.run(["ldd", tool], capture_output=True, text=True, timeout=30).stdout
        for path in [tool, *re.findall(r"(/\S+) \(0x", found)]:
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), target)
    tar = folder / "shell-image.tar"
    subprocess.run(["tar", "-C", str(root), "-cf", str(tar), "."], check=True, timeout=60)
    for name in names:
        done = subprocess.run(
            ["podman", "import", str(tar), name], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
