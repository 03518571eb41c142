"""The cluster's tests first on the CPU: every other test's worker shares one CPU group.

Measured (a fresh clone, the README's command, 2 cores; per-test CPU from cpuacct groups): the
cluster's tests, one xdist work unit run one test at a time, were the suite's critical path (37.5 of
43 minutes), and the cores were idle 15 % of the time, waiting for Slurm, heartbeats and timers
while the other worker waited too. A third worker fills those waits; but every process of its tests
would then compete with the cluster's jobs one for one (with the kernel's autogroups, each rank's
session counts as one), and the critical path would grow by what the idle time gave back.

So the workers that run the other tests put themselves, once, into one CPU group
(``/sys/fs/cgroup/cpu/<name>``: cgroup v1's ``cpu`` controller, as on the machines this suite runs on)
whose ``cpu.shares`` are two sessions': together they weigh what two of the cluster's busy ranks weigh. The
cluster's jobs (slurmd's children, outside the group) keep at least half the CPU when they want it;
the other tests get all of what the cluster leaves. Nothing is limited, only weighed; where no CPU
controller can be written (not root, a read-only ``/sys/fs/cgroup``, cgroup v2 alone, which would need
a delegated subtree) nothing changes, and the report header says so. The controlling session makes the group and removes it at its end, moving
anything left in it back first.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

#: The name of the xdist variable every worker is given (the controlling session has none).
_WORKER_ENV = "PYTEST_XDIST_WORKER"
#: Where the controlling session tells its workers the group it made.
GROUP_ENV = "ORCHESTRATOR_TEST_CPU_GROUP"
#: Where cgroup v1's ``cpu`` controller is mounted.
CPU_CONTROLLER = Path("/sys/fs/cgroup/cpu")
#: Two sessions' weight (one session, or one process outside autogroups, weighs 1024).
SHARES = 2 * 1024
_CLUSTER = Path(__file__).resolve().parent.parent / "cluster"

_made: list[Path] = []
_joined = False


def _make_group() -> Path | None:
    if not (CPU_CONTROLLER / "cpu.shares").exists():
        return None
    group = CPU_CONTROLLER / f"orchestrator-tests-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(str(SHARES))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None
    return group


def pytest_configure(config: pytest.Config) -> None:
    # Only the controlling session of an xdist run makes the group (its workers inherit the variable).
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    group = _make_group()
    if group is not None:
        _made.append(group)
        os.environ[GROUP_ENV] = str(group)


def pytest_report_header(config: pytest.Config) -> str | None:
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return None
    if _made:
        return f"cpu group: the workers of tests outside tests/cluster/ share {_made[0]}"
    return "cpu group: none (no writable cpu controller): every worker weighs the same"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A worker joins the group before its first test outside the cluster folder (a worker that runs
    the cluster's unit joins only after it, when no cluster test is left)."""
    global _joined
    group = os.environ.get(GROUP_ENV)
    if _joined or not group or not os.environ.get(_WORKER_ENV) or item.path.is_relative_to(_CLUSTER):
        return
    _joined = True
    with contextlib.suppress(OSError):
        (Path(group) / "cgroup.procs").write_text(str(os.getpid()))


def pytest_unconfigure(config: pytest.Config) -> None:
    while _made:
        group = _made.pop()
        parent_procs = group.parent / "cgroup.procs"
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    parent_procs.write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()
