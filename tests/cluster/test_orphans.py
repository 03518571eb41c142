"""Nothing trains twice on the real Slurm cluster (issue 35, item 1): ``kill -9`` of a node entry or of
the batch step leaves no rank training, and ``resume`` refuses while a process of the run lives.

The chain on every node is ``slurmstepd`` -> node entry (``python -m submitit.core._submit``, which runs
``NodeTask``) -> launcher (``orchestrator.node.launcher_shim``, its own session) -> forked ranks. The
test cluster tracks a step's processes with ``proctrack/linuxproc``: by descent from ``slurmstepd``, so
a process whose parent died (reparented to init) is no longer the job's, and nothing Slurm does reaches
it. Only the product's parent-death signals (``orchestrator.contract.run_alive``) end it then.

The victims:

- the node entry of node 0 (the batch host, where rank 0 runs): its launcher and ranks must die with
  it; the other node's tasks are ended by srun's ``--kill-on-bad-exit``;
- the batch step: the process ``slurmstepd [<job>.batch]`` started, i.e. the batch script itself
  (it ``exec``s the step supervisor ``orchestrator.schedulers.slurm.batch_step``, which runs ``srun``
  as its child). That process is what Slurm calls the batch step and what ``scancel --batch`` signals;
  its death ends the job, and Slurm then ends every step (SIGTERM, SIGKILL after ``KillWait``). ``srun``
  itself is only its child: killing srun ends in the same job end, one hop later.

Each job is ``tests/scripts/stray_child.py`` (no torch, a train event every 0.2 s). Rank 0 of the
node-entry job leaves a child of its own behind (``--leave-child``): orphaned when rank 0 dies, out
of Slurm's sight, it is the process of the run that still lives, and ``resume`` must name it. The
batch-step job's ranks ignore SIGTERM (``--ignore-term``): they live until Slurm's SIGKILL, and
``resume`` during that window must name them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import REPO, job_and_run_dir, kill_tree, living_pids, poll, run_cli, status_row

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "stray_child.py")
#: Slurm's KillWait on the test cluster is 10 s (tests/cluster/start_cluster.sh): the grace between a
#: step's SIGTERM and its SIGKILL, the longest a rank may rightly train on once its job is ending.
GONE_WITHIN_S = 30.0


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[int]]:
    """Pids of the jobs' processes this test found: killed on teardown, with every job it submitted."""
    pids: list[int] = []
    yield pids
    for job_file in (tmp_path / "runs").glob("*/job_id"):
        subprocess.run(
            ["scancel", job_file.read_text().strip()], capture_output=True, timeout=30, check=False
        )
    for pid in pids:
        kill_tree(pid)


def _submit(env: dict[str, str], *script_args: str) -> tuple[str, Path]:
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--nodes", "2", "--procs-per-node", "1", "--", SCRIPT,
         *script_args],
        env, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return job_and_run_dir(res.stdout)


def _training(run_dir: Path) -> dict[int, dict[str, list[int]]] | None:
    """Per node rank, ``{"entry", "launcher", "ranks"}`` pids, once both nodes' ranks are forked and
    one has trained a step."""
    records = sorted(run_dir.glob("logs/attempt_0/node_*_ranks/rank_pids.json"))
    metrics = run_dir / "metrics.jsonl"
    if len(records) < 2 or not metrics.exists() or not metrics.read_text().strip():
        return None
    nodes: dict[int, dict[str, list[int]]] = {}
    for path in records:
        record = json.loads(path.read_text())
        launcher = int(record["launcher"])
        entry = psutil.Process(launcher).ppid()
        assert "submitit.core._submit" in " ".join(psutil.Process(entry).cmdline()), entry
        node = int(path.parent.name.split("_")[1])
        nodes[node] = {
            "entry": [entry],
            "launcher": [launcher],
            "ranks": [int(p) for p in record["ranks"].values()],
        }
    return nodes


def _batch_step(job_id: str) -> int:
    """The process ``slurmstepd: [<job>.batch]`` started: the batch script (the step supervisor)."""
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "slurmstepd" and f"[{job_id}.batch]" in " ".join(proc.info["cmdline"] or []):
            children = proc.children()
            assert len(children) == 1, children
            assert "orchestrator.schedulers.slurm.batch_step" in " ".join(children[0].cmdline())
            return children[0].pid
    raise AssertionError(f"no batch step of job {job_id}")


def _all_gone(ranks: list[int], entries: list[int]) -> None:
    """Wait, bounded, until no launcher, rank or node entry of the job is alive."""
    poll(
        lambda: not living_pids(ranks + entries),
        GONE_WITHIN_S,
        "every launcher and rank gone",
        interval=0.2,
        diagnostics=lambda: (
            f"alive: {living_pids(ranks + entries)} of ranks/launchers {ranks}, entries {entries}"
        ),
    )


def _refused_naming(env: dict[str, str], job_id: str, run_pids: list[int]) -> list[int]:
    """``resume`` exits 2 saying a process of the run still runs; the pids it names, all the run's."""
    res = run_cli(["resume", job_id], env, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "a resume now would train" in res.stderr and "Traceback" not in res.stderr, res.stderr
    match = re.search(r"pid ([\d, ]+)", res.stderr)
    assert match, f"the refusal names no pid: {res.stderr}"
    named = [int(p) for p in re.findall(r"\d+", match.group(1))]
    assert named and set(named) <= set(run_pids), (named, run_pids, res.stderr)
    return named


def _resumable_once_gone(env: dict[str, str], job_id: str) -> None:
    """Once nothing of the run lives, the job reads ended and ``resume`` no longer refuses for a live
    process: it says the right thing for this run (no checkpoint was ever written)."""
    row = poll(
        lambda: (r := status_row(env, job_id))["terminal"] and r, 60, f"job {job_id} ended", interval=0.5
    )
    assert row["state"] == "FAILED", row
    res = run_cli(["resume", job_id], env, timeout=60)
    assert "still runs" not in res.stderr and "a resume now would train" not in res.stderr, res.stderr
    assert res.returncode == 2 and "no complete checkpoint" in res.stderr, res.stdout + res.stderr


def test_kill_9_of_a_node_entry_takes_its_ranks_and_resume_names_what_lives(
    slurm_cluster: dict, orch_env: dict[str, str], started: list[int]
) -> None:
    job_id, run_dir = _submit(orch_env, "--leave-child")
    nodes = poll(lambda: _training(run_dir) or {}, 120, "both nodes training")
    stray = int(
        poll(lambda: (run_dir / "stray.pid").exists() and (run_dir / "stray.pid").read_text(), 30, "stray")
    )
    ranks = [p for n in nodes.values() for p in n["launcher"] + n["ranks"]]
    entries = [p for n in nodes.values() for p in n["entry"]]
    started.extend([stray, *entries, *ranks])
    os.kill(nodes[0]["entry"][0], signal.SIGKILL)
    killed_at = time.monotonic()
    _all_gone(ranks, entries)
    print(f"[orphans] node entry killed: every rank gone after {time.monotonic() - killed_at:.1f} s")
    assert living_pids([stray]) == [stray]  # rank 0's own child, orphaned out of Slurm's sight

    # The batch step ends the job a moment after the ranks are gone (it decides on a restart first):
    # until Slurm reports the end, status says RUNNING with no reason; while the job is COMPLETING
    # (its epilog and KillWait, long under load), RUNNING with Slurm's own ("NonZeroExitCode").
    def ended_in_slurm() -> dict | None:
        row = status_row(orch_env, job_id)
        return row if row.get("reason") and row.get("raw_state") != "COMPLETING" else None

    row = poll(ended_in_slurm, 60, "Slurm's end of the job in status")
    assert not row["terminal"] and f"pid {stray}" in (row.get("reason") or ""), row
    assert _refused_naming(orch_env, job_id, [stray]) == [stray]
    kill_tree(stray)
    _resumable_once_gone(orch_env, job_id)


def test_kill_9_of_the_batch_step_leaves_no_rank_and_resume_refuses_meanwhile(
    slurm_cluster: dict, orch_env: dict[str, str], started: list[int]
) -> None:
    job_id, run_dir = _submit(orch_env, "--ignore-term")
    nodes = poll(lambda: _training(run_dir) or {}, 120, "both nodes training")
    ranks = [p for n in nodes.values() for p in n["launcher"] + n["ranks"]]
    entries = [p for n in nodes.values() for p in n["entry"]]
    started.extend([*entries, *ranks])
    batch = _batch_step(job_id)
    os.kill(batch, signal.SIGKILL)
    killed_at = time.monotonic()
    # The ranks ignore SIGTERM: they live until Slurm's SIGKILL, KillWait (10 s) after the job's end.
    assert living_pids(ranks), "the ranks died at once: no window to test the refusal in"
    _refused_naming(orch_env, job_id, ranks + entries)
    _all_gone(ranks, entries)
    print(f"[orphans] batch step killed: every rank gone after {time.monotonic() - killed_at:.1f} s")
    _resumable_once_gone(orch_env, job_id)
