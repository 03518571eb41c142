"""Sweeps and dependencies on the real Slurm cluster (issue 15), through the CLI and the Python API.

One sweep is one job array: ``--max-parallel`` is Slurm's ``%K`` throttle (asserted from sacct's start
and end times), each task has its own run directory, and a requeue is one task's alone, resumed by the
product's own loop (``tests/scripts/sweep_task.py`` trains through ``orchestrator.loop.ResumableLoop``:
the checkpoint, the attempt's start record and the metrics are the product's). ``--after``
is Slurm's ``afterok``/``afterany`` with ``--kill-on-invalid-dep``: a job whose dependency failed is
cancelled and says why. The scale case holds 100 tasks pending behind a dependency, so it costs no
training: the registry must equal squeue and sacct, in one scheduler query.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from orchestrator.contract.attempt_start import read_attempt_start
from orchestrator.contract.run_dir import attempt_dirs, last_complete_checkpoint
from orchestrator.schedulers.base import submission_token
from tests.helpers.cli import REPO, poll, run_cli, sacct_state
from tests.helpers.run_dirs import events
from tests.helpers.slurm_cluster import slurm
from tests.scripts.sweep_task import HOLDING_FILE, expected_loss

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "sweep_task.py")
ONE_NODE = ["--profile", "slurm_test", "--nodes", "1"]


def assert_resumed_by_the_product(run_dir: Path, attempt: int, step: int, last_step: int) -> None:
    """``attempt`` started from the run's last complete checkpoint, which is step ``step``, and every
    step up to ``last_step`` was trained once: the first attempts up to ``step``, the later ones after.
    The loop's start record says where it started, the checkpoint's marker which step it holds."""
    ckpt = last_complete_checkpoint(run_dir)
    assert ckpt is not None and ckpt.step == step, ckpt
    assert read_attempt_start(run_dir, attempt) == {
        "step": step,
        "checkpoint": str(ckpt.path),
        "hook": "accelerate",
    }
    trained = [e["step"] for e in events(run_dir, "train")]
    assert trained == list(range(1, last_step + 1)), trained
    (resume,) = events(run_dir, "resume")
    assert (resume["step"], resume["checkpoint"]) == (step, str(ckpt.path)), resume
    before = [e["step"] for e in events(run_dir, "train") if e["time"] < resume["time"]]
    assert before == list(range(1, step + 1)), before  # the stopped attempt's last step is the checkpoint's


def cli_json(args: list[str], env: dict[str, str]) -> Any:
    res = run_cli(args, env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def sacct_incarnations(job_id: str) -> list[dict[str, str]]:
    """Every incarnation (--duplicates: a requeued task's earlier run too) of a job or array."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "--duplicates", "-j", job_id, "-o", "JobID,State,Start,End"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    keys = ("job_id", "state", "start", "end")
    return [
        dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines() if line.count("|") == 3
    ]


def most_at_once(rows: list[dict[str, str]]) -> int:
    """Largest number of [start, end) intervals that overlap."""
    spans = [
        (datetime.fromisoformat(r["start"]), datetime.fromisoformat(r["end"]))
        for r in rows
        if r["start"][:1].isdigit() and r["end"][:1].isdigit()
    ]
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for job_id in ids:
        slurm("scancel", job_id, check=False)


def test_sweep_throttles_keeps_tasks_apart_and_requeues_one_task(
    slurm_cluster: dict, orch_env: dict, cleanup: list[str]
) -> None:
    # A grid larger than the cluster's MaxArraySize is refused with the reason, nothing made.
    huge = run_cli(
        ["sweep", *ONE_NODE, "--grid", f"seed={','.join(map(str, range(1002)))}", "--", SCRIPT, "{seed}"],
        orch_env,
    )
    assert huge.returncode == 2 and "1002 tasks, but this cluster's MaxArraySize is 1001" in huge.stderr, (
        huge.stderr
    )
    args = ["--max-parallel", "2", "--grid", "lr=0.3,0.1,0.2", "--"]
    args += [SCRIPT, "--lr", "{lr}", "--steps", "4", "--step-s", "0.3", "--hold-lr", "0.1", "--hold-at", "2"]
    dry = run_cli(["sweep", *ONE_NODE, "--dry-run", *args], orch_env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    planned = dry.stdout.split("sweep directory would be ")[1].split(")")[0]
    shown = dry.stdout.split("==> sbatch.sh <==\n")[1].split("\ntask 0: ")[0].rstrip("\n") + "\n"
    assert not Path(planned).exists() and not (Path(orch_env["ORCHESTRATOR_RUNS"])).exists()
    res = run_cli(["sweep", *ONE_NODE, *args], orch_env, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    sweep_id = res.stdout.split("submitted sweep ")[1].split()[0]
    cleanup.append(sweep_id)
    sweep_dir = Path(res.stdout.split("sweep directory ")[1].split()[0])
    tasks = [sweep_dir / f"task_{i}" for i in range(3)]
    jobs = [f"{sweep_id}_{i}" for i in range(3)]
    assert [f"task {i}: job {j}" in res.stdout for i, j in enumerate(jobs)] == [True] * 3
    # The dry run is the array's script byte for byte (but for the directory's name and the token
    # derived from it), and that is what Slurm holds.
    submitted = (sweep_dir / "sbatch.sh").read_text()
    same = shown.replace(planned, str(sweep_dir)).replace(
        submission_token(planned, 0), submission_token(sweep_dir, 0)
    )
    assert same == submitted and "#SBATCH --array=0-2%2" in submitted
    assert slurm("scontrol", "write", "batch_script", sweep_id, "-").stdout == submitted

    # Task 1 (lr 0.1) holds inside step 2 of its first attempt: requeue it alone, by the profile's signal.
    poll(lambda: (tasks[1] / HOLDING_FILE).exists(), 240, "task 1 holding in step 2")
    sent = run_cli(["cancel", jobs[1], "--signal", "USR2"], orch_env, timeout=60)
    assert sent.returncode == 0, sent.stdout + sent.stderr
    states = [sacct_state(j, timeout=300) for j in jobs]
    assert states == ["COMPLETED"] * 3, states

    # Throttle: never more than 2 tasks (any incarnation) running at once, by sacct's own times.
    rows = sacct_incarnations(sweep_id)
    assert {r["job_id"] for r in rows} == set(jobs), rows
    # At most 2; exactly 2 only when two nodes were free at once (an earlier test's jobs may still
    # hold one on a loaded machine), so the throttle Slurm holds is asserted above (%2), not a count.
    assert 1 <= most_at_once(rows) <= 2, rows

    # Each task's run directory holds its own arguments and metrics; each step's loss is the one an
    # uninterrupted run has (task 1's too: its model and optimizer came back from the checkpoint).
    for task, lr in zip(tasks, ("0.3", "0.1", "0.2"), strict=True):
        plan = json.loads((task / "job.json").read_text())
        assert plan["script_args"][:2] == ["--lr", lr]
        train = events(task, "train")
        assert {e["lr"] for e in train} == {float(lr)}
        assert [e["loss"] for e in train] == [
            pytest.approx(expected_loss(float(lr), 0, s), rel=1e-5) for s in range(1, 5)
        ]

    # Only task 1 was requeued; its second attempt started from its own last complete checkpoint
    # (step 2, where the loop agreed on the stop), and no step was trained twice or lost.
    assert [len(events(t, "resume")) for t in tasks] == [0, 1, 0]
    assert [[a for a, _ in attempt_dirs(t)] for t in tasks] == [[0], [0, 1], [0]]
    for task in (tasks[0], tasks[2]):
        assert read_attempt_start(task, 0) == {"step": 0, "checkpoint": None, "hook": "accelerate"}
        assert [e["step"] for e in events(task, "train")] == [1, 2, 3, 4]
    assert read_attempt_start(tasks[1], 0) == {"step": 0, "checkpoint": None, "hook": "accelerate"}
    assert_resumed_by_the_product(tasks[1], attempt=1, step=2, last_step=4)

    # The rollup: a line per task, the best by loss, requeue counts per task, one scheduler query.
    data = cli_json(["status", sweep_id, "--json"], orch_env)
    assert [t["job_id"] for t in data["tasks"]] == jobs
    assert [t["state"] for t in data["tasks"]] == ["COMPLETED"] * 3
    assert [t["requeues"] for t in data["tasks"]] == [0, 1, 0]
    assert [t["params"] for t in data["tasks"]] == [{"lr": "0.3"}, {"lr": "0.1"}, {"lr": "0.2"}]
    # The rows' loss is each task's last reported loss; the best is the lowest (lr 0.1).
    assert [t["loss"] for t in data["tasks"]] == [events(t, "train")[-1]["loss"] for t in tasks]
    assert [t["step"] for t in data["tasks"]] == [4, 4, 4]
    assert [t["resumes"] for t in data["tasks"]] == [0, 1, 0]
    assert [t["started_from"] for t in data["tasks"]] == [
        None,
        "resumed at step 2 from step_00000002 (accelerate hook)",
        None,
    ]
    assert data["best_task"] == 1 and data["scheduler_calls"]["squeue"] == 1
    text = run_cli(["status", sweep_id], orch_env, timeout=60).stdout
    best = f"{events(tasks[1], 'train')[-1]['loss']:.4f}"
    assert best == f"{expected_loss(0.1, 0, 4):.4f}", best
    assert f"best loss {best}: task 1 (job {jobs[1]}, lr=0.1)" in text, text
    listed = run_cli(["list", "--sweeps"], orch_env, timeout=60).stdout
    assert sweep_id in listed and "lr=0.3,0.1,0.2" in listed, listed

    # The sweep's bill (`cost SWEEP`) is the sum of its tasks', each task's the one `cost TASK --run`
    # gives (task 1: both incarnations of its requeued array task), and its allocations are sacct's.
    bill = cli_json(["cost", sweep_id, "--json"], orch_env)
    assert [t["job_id"] for t in bill["tasks"]] == jobs
    assert bill["allocated_hours"] == pytest.approx(
        sum(t["allocated_hours"] for t in bill["tasks"]), abs=1e-5
    )
    for key, hours in bill["hours"].items():
        assert hours == pytest.approx(sum(t["hours"][key] for t in bill["tasks"]), abs=1e-5), key
    for task in bill["tasks"]:
        own = cli_json(["cost", task["job_id"], "--run", "--json"], orch_env)
        assert (own["allocated_hours"], own["hours"]) == (task["allocated_hours"], task["hours"]), task
    spans = [datetime.fromisoformat(r["end"]) - datetime.fromisoformat(r["start"]) for r in rows]
    assert [len(t["attempts"]) for t in bill["tasks"]] == [1, 2, 1]
    assert sum(a["allocated_s"] for a in bill["attempts"]) == sum(d.total_seconds() for d in spans)
    lowest = min((e["loss"], i) for i, t in enumerate(tasks) for e in events(t, "train"))
    assert (bill["best"]["loss"], bill["best"]["task"]) == lowest, bill["best"]


def test_dependencies_and_a_100_task_sweep_through_the_api(
    slurm_cluster: dict, orch_env: dict, monkeypatch: pytest.MonkeyPatch, cleanup: list[str]
) -> None:
    import orchestrator
    from orchestrator.contract.job_states import JobState
    from orchestrator.schedulers.slurm.query import parse_sacct

    monkeypatch.setenv("PYTHONPATH", orch_env["PYTHONPATH"])  # the jobs run this checkout
    quick = ["--steps", "2", "--step-s", "0.1"]
    common: dict[str, Any] = {"profile": "slurm_test", "nodes": 1, "script": SCRIPT}
    ok = orchestrator.submit(**common, args=quick)
    bad = orchestrator.submit(**common, args=["--fail"])
    hold = orchestrator.submit(**common, args=["--hold-lr", "0.1", "--hold-at", "1"])  # runs until cancelled
    cleanup += [ok.job_id, bad.job_id, hold.job_id]
    after_ok = orchestrator.submit(**common, args=quick, after=[f"{ok.job_id}:ok"])
    res = run_cli(["submit", *ONE_NODE, "--after", f"{bad.job_id}:ok", "--", SCRIPT, *quick], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    after_bad = res.stdout.split("submitted job ")[1].split()[0]
    res = run_cli(["submit", *ONE_NODE, "--after", f"{bad.job_id}:any", "--", SCRIPT, *quick], orch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    after_any = res.stdout.split("submitted job ")[1].split()[0]
    cleanup.append(after_any)
    big = orchestrator.sweep(
        **common, grid={"seed": range(100)}, args=["--seed", "{seed}"], after=[hold.job_id], max_parallel=4
    )
    # A sweep whose task 0 stops at step 2 without a requeue (max_requeues 0), to be resumed later.
    small = orchestrator.sweep(
        **common,
        grid={"lr": [0.1, 0.2]},
        args=["--lr", "{lr}", "--steps", "3", "--step-s", "0.1", "--hold-lr", "0.1", "--hold-at", "2"],
        max_requeues=0,
    )
    cleanup += [after_ok.job_id, after_bad, big.sweep_id, small.sweep_id]
    task_ids = [j.job_id for j in big.jobs]
    assert task_ids == [f"{big.sweep_id}_{i}" for i in range(100)]

    # 100 tasks waiting for `hold`: each says so, the registry equals squeue, one scheduler query.
    waiting = f"waiting for job {hold.job_id} to complete"

    def all_waiting() -> dict[str, Any] | None:
        data = cli_json(["status", big.sweep_id, "--json"], orch_env)
        return data if {t["reason"] for t in data["tasks"]} == {waiting} else None

    data = poll(all_waiting, 60, "every task waiting for the hold job")
    assert len(data["tasks"]) == 100 and {t["state"] for t in data["tasks"]} == {"PENDING"}
    assert data["scheduler_calls"] == {"squeue": 1, "sacct": 0}
    queued = slurm("squeue", "-h", "-r", "-j", big.sweep_id, "-o", "%i").stdout.split()
    assert sorted(queued) == sorted(task_ids)
    rolled = big.status()  # the API's rollup is the CLI's
    assert [r.job_id for r in rolled.rows] == task_ids and rolled.result.calls["squeue"] == 1
    text = run_cli(["status", task_ids[7]], orch_env, timeout=60).stdout
    assert f"{task_ids[7]} PENDING: {waiting}" in text, text

    # afterok on a job that COMPLETED: runs, and only after it ended.
    assert after_ok.wait(timeout=240) is JobState.COMPLETED
    (first,) = sacct_incarnations(ok.job_id)
    (then,) = sacct_incarnations(after_ok.job_id)
    assert first["state"] == "COMPLETED" and then["start"] >= first["end"], (first, then)
    assert [e["step"] for e in after_ok.metrics() if e.get("event") == "train"] == [1, 2]
    assert "[orchestrator node]" in after_ok.logs()

    # afterok on a job that FAILED: cancelled by Slurm, and status says why.
    assert orchestrator.get_job(after_bad).wait(timeout=240) is JobState.CANCELLED
    assert sacct_state(bad.job_id) == "FAILED"
    reason = cli_json(["status", after_bad, "--json"], orch_env)["jobs"][0]["reason"]
    assert reason.startswith(f"dependency never satisfied: waited for job {bad.job_id} to complete"), reason
    assert f"job {bad.job_id} ended FAILED" in reason, reason
    # afterany on that FAILED job: runs all the same, once it ended.
    assert orchestrator.get_job(after_any).wait(timeout=240) is JobState.COMPLETED
    (failed,) = sacct_incarnations(bad.job_id)
    (anyway,) = sacct_incarnations(after_any)
    assert anyway["start"] >= failed["end"], (failed, anyway)

    # The sweep's dependency fails too (hold cancelled): all 100 cancelled; registry == sacct.
    assert "cancel requested" in hold.cancel()
    data = poll(
        lambda: (
            (d := cli_json(["status", big.sweep_id, "--json"], orch_env))["counts"] == {"CANCELLED": 100}
            and d
        ),
        120,
        "the sweep cancelled",
    )
    never = f"dependency never satisfied: waited for job {hold.job_id} to complete"
    assert all(t["reason"].startswith(never) for t in data["tasks"]), data["tasks"][0]
    acct = parse_sacct(
        slurm("sacct", "-X", "-n", "-P", "-j", big.sweep_id, "-o", "JobID,State,ExitCode,Reason").stdout
    )
    assert {t["job_id"]: t["state"] for t in data["tasks"]} == {j: acct[j].state.value for j in task_ids}
    assert data["scheduler_calls"]["squeue"] == 1

    # resume SWEEP --failed: only the task that FAILED is resumed, from its own checkpoint.
    poll(lambda: (small.jobs[0].run_dir / HOLDING_FILE).exists(), 120, "small task 0 holding in step 2")
    assert "sent SIGUSR2" in small.jobs[0].cancel("USR2")
    assert small.jobs[0].wait(timeout=120) is JobState.FAILED
    assert small.jobs[1].wait(timeout=120) is JobState.COMPLETED
    res = run_cli(["resume", small.sweep_id, "--failed"], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("task 0: resuming job") and "task 1" not in res.stdout, res.stdout
    resumed = orchestrator.get_job(res.stdout.split("submitted job ")[1].split()[0])
    assert resumed.run_dir == small.jobs[0].run_dir and resumed.wait(timeout=180) is JobState.COMPLETED
    newest = attempt_dirs(resumed.run_dir)[-1][0]
    assert newest > 0 and (resumed.run_dir / "checkpoints" / "step_00000002" / "COMPLETE.json").exists()
    assert_resumed_by_the_product(resumed.run_dir, attempt=newest, step=2, last_step=3)
    rows = small.status().rows
    assert [(r.continued_as, (r.run_state or r.state).value) for r in rows] == [
        (resumed.job_id, "COMPLETED"),
        (None, "COMPLETED"),
    ]
