"""Profile keys docs/profiles.md promises, each doing what its table row says (issue 33 item 7).

* ``max_procs_per_node``: a launch over it is refused at planning (exit 2, one line, nothing created);
  raising it lifts the CPU default of 256.
* ``hang_timeout``: the key reaches the batch step's watchdog, and ``--hang-timeout`` wins over it.
  (On the local profile a real hung job ends by the key: tests/supervise/test_watchdog_local.py.)
* ``preflight.min_free_mb``: the node's own check, on a real filesystem of known size (a tmpfs), counts
  the newest complete checkpoint plus the key. (The preflight's step on real Slurm nodes, and its
  report, are tests/cluster/test_preflight.py.)
* ``share_with_group``: a real local job's run directory, logs and checkpoints are 0750/0640
  (tests/runner/test_promises_local.py, with the pre-timeout signal's job).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.contract.checkpoints import finalize
from orchestrator.node.preflight import local_problems
from tests.helpers.cli import REPO, run_cli, user_profile_dir

SCRIPT = str(REPO / "examples" / "accelerate_cnn.py")


def test_max_procs_per_node_refuses_a_launch_over_it(orch_env: dict[str, str], tmp_path: Path) -> None:
    env = {
        **orch_env,
        "ORCHESTRATOR_PROFILES": str(user_profile_dir(tmp_path, "local", max_procs_per_node=1)),
    }
    res = run_cli(["submit", "--profile", "local", "--procs-per-node", "2", "--", SCRIPT], env, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "allows at most 1 (max_procs_per_node)" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "runs").exists() and run_cli(["list", "--json"], env).stdout.strip() == "[]"
    ok = run_cli(["render", "--profile", "local", "--procs-per-node", "1", "--", SCRIPT], env, timeout=60)
    assert ok.returncode == 0 and "num_processes: 1\n" in ok.stdout, ok.stdout + ok.stderr


def test_max_procs_per_node_lifts_the_cpu_default(orch_env: dict[str, str], tmp_path: Path) -> None:
    args = ["render", "--profile", "local", "--procs-per-node", "300", "--", SCRIPT]
    default = run_cli(args, orch_env, timeout=60)
    assert (
        default.returncode == 2 and "at most 256 unless the profile sets max_procs_per_node" in default.stderr
    )
    env = {
        **orch_env,
        "ORCHESTRATOR_PROFILES": str(user_profile_dir(tmp_path, "local", max_procs_per_node=512)),
    }
    raised = run_cli(args, env, timeout=60)
    assert raised.returncode == 0 and "num_processes: 300\n" in raised.stdout, raised.stdout + raised.stderr


def test_the_hang_timeout_key_reaches_the_watchdog_and_the_flag_wins(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**orch_env, "ORCHESTRATOR_PROFILES": str(user_profile_dir(tmp_path, hang_timeout=123))}
    render = ["render", "--profile", "slurm_test", "--nodes", "1"]
    by_key = run_cli([*render, "--", SCRIPT], env, timeout=60)
    assert by_key.returncode == 0, by_key.stderr
    assert (
        "orchestrator.schedulers.slurm.batch_step" in by_key.stdout
        and " --hang-timeout 123 " in by_key.stdout
    )
    by_flag = run_cli([*render, "--hang-timeout", "45", "--", SCRIPT], env, timeout=60)
    assert by_flag.returncode == 0, by_flag.stderr
    assert " --hang-timeout 45 " in by_flag.stdout and "123" not in by_flag.stdout
    unset = run_cli([*render, "--", SCRIPT], orch_env, timeout=60)
    assert unset.returncode == 0 and "--hang-timeout" not in unset.stdout, unset.stdout


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A run directory on an 8 MiB tmpfs (root: the suite runs as root; the mount must succeed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, f"mounting a tmpfs failed: {res.stderr}"
    try:
        yield mnt / "run"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30, check=False)


def test_preflight_min_free_mb_counts_the_newest_checkpoint(small_disk: Path) -> None:
    run_dir, folder = small_disk, small_disk / "preflight"
    folder.mkdir(parents=True)
    assert local_problems(run_dir, folder, 0, min_free_mb=4, gpus=0) == []
    tmp = run_dir / "checkpoints" / ".tmp-step_00000010"
    tmp.mkdir(parents=True)
    (tmp / "model.bin").write_bytes(b"\1" * (3 << 20))
    finalize(tmp, run_dir / "checkpoints" / "step_00000010", {"step": 10})
    # 8 MiB disk, 3 MiB used: 5 free. The next save needs 3 MiB, so 4 more is 7: refused; 2 more is 5: fits.
    (problem,) = local_problems(run_dir, folder, 0, min_free_mb=4, gpus=0)
    assert problem.startswith("5 MiB free in ") and "7 MiB needed" in problem and "min_free_mb" in problem, (
        problem
    )
    assert local_problems(run_dir, folder, 0, min_free_mb=1, gpus=0) == []
