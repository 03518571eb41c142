"""``--cpu-load N``: N busy processes beside the tests, for the whole session (issue 47).

A user's login host and cluster nodes are busy machines; a failure that shows only under load is a
product race until proven to be the test's. The load is bounded: the processes are this session's
children, each leaves when its parent pytest is gone (it polls its parent id), and the session kills
them at its end. ``ORCHESTRATOR_TEST_CPU_LOAD`` sets the same where the command line is fixed (CI's
``.ci/run``, ``tests/cluster/run_with_cluster.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CPU_LOAD_ENV = "ORCHESTRATOR_TEST_CPU_LOAD"

#: A busy loop that leaves when its parent (the pytest session) is gone: a crashed session leaves no
#: load behind.
BUSY_LOOP = (
    "import os, time\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent:\n"
    "    end = time.monotonic() + 0.5\n"
    "    while time.monotonic() < end:\n"
    "        pass\n"
)

_busy: list[subprocess.Popen[bytes]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-load",
        type=int,
        default=None,
        metavar="N",
        help=f"run N busy processes beside the tests for the whole session (or set {CPU_LOAD_ENV})",
    )


def load_count(config: pytest.Config) -> int:
    given = config.getoption("--cpu-load")
    if given is None:
        raw = os.environ.get(CPU_LOAD_ENV, "").strip()
        try:
            given = int(raw) if raw else 0
        except ValueError:
            raise pytest.UsageError(
                f"{CPU_LOAD_ENV}={raw!r}: expected a whole number of busy processes"
            ) from None
    if given < 0:
        raise pytest.UsageError(f"--cpu-load {given}: expected 0 or more busy processes")
    return given


def pytest_configure(config: pytest.Config) -> None:
    count = load_count(config)
    # Only the controlling session starts load (an xdist worker, if ever used, would multiply it).
    if count == 0 or hasattr(config, "workerinput"):
        return
    for _ in range(count):
        _busy.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP]))


def pytest_report_header(config: pytest.Config) -> str | None:
    return f"cpu load: {len(_busy)} busy processes beside the tests" if _busy else None


def pytest_unconfigure(config: pytest.Config) -> None:
    while _busy:
        proc = _busy.pop()
        proc.kill()
        proc.wait(timeout=30)
