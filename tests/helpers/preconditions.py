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


#: Where apt's output goes (the test that needed a package says where to look when it fails).
APT_LOG = "/tmp/orchestrator-test-apt.log"
_APT_LOCK = "/run/lock/orchestrator-test-apt.lock"


def _installed(package: str) -> bool:
    import subprocess

    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    )
    return "install ok installed" in out.stdout


def require_debian_packages(*packages: str) -> None:
    """Install the Debian packages a test runs for real (chromium, podman, openssh-server, ...).

    Like the cluster's own packages (``tests/cluster/start_cluster.sh``), they come from Debian's
    registry at test time: the suite needs no step that the README does not list. Installs are
    serialised across processes (pytest workers, helpers) by a lock file; services the packages'
    postinst scripts would start are held back by a temporary ``policy-rc.d`` (the tests start
    their own). Without root, or when apt fails, the test skips (fails under CI)."""
    import fcntl
    import subprocess

    missing = [p for p in packages if not _installed(p)]
    if not missing:
        return
    require(os.geteuid() == 0, f"needs Debian packages {missing} (root installs them)")
    os.makedirs(os.path.dirname(_APT_LOCK), exist_ok=True)
    with open(_APT_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [p for p in packages if not _installed(p)]
        if not missing:
            return
        policy = "/usr/sbin/policy-rc.d"
        own_policy = not os.path.exists(policy)
        if own_policy:
            with open(policy, "w") as f:
                f.write(
                    "#!/bin/sh\n# temporary, from orchestrator tests/helpers/preconditions.py\nexit 101\n"
                )
            os.chmod(policy, 0o755)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        # An apt run outside this lock (a person, another tool) holds dpkg's own lock: wait for it.
        wait = ["-o", "DPkg::Lock::Timeout=600"]
        try:
            with open(APT_LOG, "a") as log:

                def apt(*args: str, timeout: float = 900) -> bool:
                    return subprocess.run(["apt-get", *wait, *args], stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=log, env=env, timeout=timeout, check=False).returncode == 0  # fmt: skip

                install = ["install", "-yq", "--no-install-recommends", *missing]
                ok = apt(*install)
                if not ok:  # a fresh image's package lists are often empty or stale
                    apt("update", "-q", timeout=600)
                    ok = apt(*install)
        finally:
            if own_policy:
                os.unlink(policy)
    require(ok, f"apt-get install {' '.join(missing)} failed (see {APT_LOG})")
