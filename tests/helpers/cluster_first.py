"""The cluster's tests first on the CPU: every other test's worker shares one CPU group.

Measured (a fresh clone, the README's command on two workers, 2 cores; per-test CPU from a cpuacct
group per worker): the cluster's tests, one xdist work unit run one test at a time, were the suite's
critical path (37.5 of 43 minutes), and the cores were idle 15 % of the time, the cluster's test
waiting for Slurm, heartbeats or timers while the other worker's test waited too. A third worker
fills those waits. But with the kernel's autogroups every session weighs the same (each node's
launcher and its ranks are one), so the third worker's jobs took CPU from the cluster's: on three
workers with no group the cluster's first 25 tests took 822 s, against 705 s on two.

So the workers that run the other tests put themselves, once, into one CPU group
(``/sys/fs/cgroup/cpu/<name>``: cgroup v1's ``cpu`` controller, as on the machines this suite runs on)
whose ``cpu.shares`` are one session's: together they weigh what one of the cluster's busy nodes
weighs, and get at least a third of the cores while a 2-node cluster job keeps both busy, and all
that it leaves. Nothing is limited, only weighed; where no CPU controller can be written (not root, a
read-only ``/sys/fs/cgroup``, cgroup v2 alone, which would need a delegated subtree) nothing changes,
and the report header says so. The controlling session makes the group and removes it at its end,
moving anything left in it back first; a group left by a session that was killed is removed by the
next.
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
#: One session's weight (an autogroup, or a process in the root group without autogroups, weighs 1024).
SHARES = 1024
_PREFIX = "orchestrator-tests-"
_CLUSTER = Path(__file__).resolve().parent.parent / "cluster"

_made: list[Path] = []
_joined = False


def _remove(group: Path) -> None:
    """Move what is left in ``group`` back to its parent, then remove it (quietly: best effort)."""
    parent_procs = group.parent / "cgroup.procs"
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                parent_procs.write_text(pid)
    with contextlib.suppress(OSError):
        group.rmdir()


def _make_group() -> Path | None:
    if not (CPU_CONTROLLER / "cpu.shares").exists():
        return None
    with contextlib.suppress(OSError):
        for stale in CPU_CONTROLLER.glob(f"{_PREFIX}*"):
            owner = stale.name.removeprefix(_PREFIX)
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                _remove(stale)
    group = CPU_CONTROLLER / f"{_PREFIX}{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(str(SHARES))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None
    return group


def _controls_workers(config: pytest.Config) -> bool:
    """The controlling session of an xdist run (``-n N``): the one that makes the group; its workers
    inherit the variable that names it."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def pytest_configure(config: pytest.Config) -> None:
    if not _controls_workers(config):
        return
    group = _make_group()
    if group is not None:
        _made.append(group)
        os.environ[GROUP_ENV] = str(group)


def pytest_report_header(config: pytest.Config) -> str | None:
    if not _controls_workers(config):
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
        _remove(_made.pop())
