"""The Slurm scheduler query, ``status`` and ``cancel`` against the real test cluster: every answer here
is what the real ``squeue``, ``sacct`` and ``scancel`` say (the faults, a hung or missing binary, are
in tests/schedulers/test_query.py).

One set of plain ``sbatch`` jobs serves the module (a product submission is not what is under test,
and a bare job starts in ~2 s): one that ended COMPLETED, one FAILED with exit code 3, one RUNNING, one
PENDING (held), and an id Slurm never had. Measured on the test cluster (Slurm 22.05): ``squeue -j``
without ``-t`` lists pending, running and completing jobs only, so a job that has ended is answered by
sacct at once, not after MinJobAge; only ``squeue -t all`` and scontrol keep it for MinJobAge.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry, SchedulerKind
from orchestrator.runner.refresh import FINAL_AFTER_S, refresh_states
from orchestrator.schedulers.slurm.query import query_states
from tests.helpers.cli import poll, run_cli, sacct_state
from tests.helpers.slurm_cluster import sbatch, slurm, wait_for_job_state

#: A job id no test cluster reaches (ids restart at 1 with every fresh cluster).
NEVER = "9999999"


def add_jobs(
    home: Path,
    ids: list[str],
    run_root: Path,
    scheduler: SchedulerKind = "slurm",
    state: JobState = JobState.RUNNING,
) -> None:
    with Registry.open(home) as reg:
        for i, job_id in enumerate(ids):
            reg.add_job(
                job_id=job_id,
                name=f"job{i}",
                profile="slurm_test",
                scheduler=scheduler,
                strategy="fsdp2",
                nodes=1,
                procs_per_node=1,
                command=["python", "t.py"],
                run_dir=run_root / job_id,
                state=state,
            )


def squeue_nodes(job_id: str) -> str:
    """The test's own question to squeue (not the product's): where the job runs."""
    return slurm("squeue", "-h", "-j", job_id, "-o", "%N").stdout.strip()


def accounting(job_id: str) -> dict[str, str]:
    """The test's own question to sacct: the allocation's state, exit code and nodes."""
    out = slurm("sacct", "-nXP", "-j", job_id, "-o", "State,ExitCode,NodeList").stdout.strip()
    state, exit_code, nodes = out.splitlines()[-1].split("|")
    return {"state": state, "exit_code": exit_code, "node_list": nodes}


@pytest.fixture(scope="module")
def jobs(slurm_cluster: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    out = tmp_path_factory.mktemp("query_jobs")
    ids = {
        "done": sbatch("-o", str(out / "%j.out"), "--wrap", "true"),
        "failed": sbatch("-o", str(out / "%j.out"), "--wrap", "exit 3"),
        "running": sbatch("-o", str(out / "%j.out"), "--wrap", "sleep 600"),
        "held": sbatch("-o", str(out / "%j.out"), "--hold", "--wrap", "true"),
    }
    try:
        wait_for_job_state(ids["running"], "RUNNING", timeout=120)
        # slurmdbd records an end asynchronously: the ended jobs are ready once accounting has them.
        assert sacct_state(ids["done"], timeout=120) == "COMPLETED"
        assert sacct_state(ids["failed"], timeout=120) == "FAILED"
        yield ids
    finally:
        slurm("scancel", ids["running"], ids["held"], check=False)


def test_live_jobs_are_answered_by_squeue_alone(jobs: dict[str, str]) -> None:
    """A running and a pending job: one squeue call, no sacct, fresh, with squeue's details."""
    asked = [jobs["running"], jobs["held"]]
    res = query_states(asked)
    assert res.calls == {"squeue": 1, "sacct": 0} and not res.stale and res.errors == ()
    assert res.source == "squeue" and set(res.states) == set(asked)
    running, held = res.states[jobs["running"]], res.states[jobs["held"]]
    assert (running.state, running.source, running.node_list) == (
        JobState.RUNNING,
        "squeue",
        squeue_nodes(jobs["running"]),
    )
    assert running.start and running.elapsed, running
    assert (held.state, held.source, held.reason, held.node_list) == (
        JobState.PENDING,
        "squeue",
        "JobHeldUser",
        None,
    )


def test_an_id_squeue_calls_invalid_is_asked_of_sacct_without_an_error(slurm_cluster: dict) -> None:
    """The real squeue exits 1 with "Invalid job id specified" for an id it does not know: that is
    an answer, not a failure. Nobody knows the id: the last known state, stale, and no error."""
    said = slurm("squeue", "-h", "-j", NEVER, check=False)
    assert said.returncode == 1 and "Invalid job id specified" in said.stderr, said
    res = query_states([NEVER, "local-7"], fallback={NEVER: JobState.RUNNING})
    assert res.errors == () and res.calls == {"squeue": 1, "sacct": 1}
    assert (res.states[NEVER].state, res.states[NEVER].source, res.stale) == (
        JobState.RUNNING,
        "registry",
        True,
    )
    assert res.states["local-7"].state is JobState.UNKNOWN  # not a Slurm id: never asked


def test_jobs_ended_long_ago_are_not_asked_again(jobs: dict[str, str], tmp_path: Path) -> None:
    """A job recorded as ended over FINAL_AFTER_S ago keeps its recorded end (source "final", not
    stale) without squeue or sacct being asked: sacct knows the job, so asking would have made a
    sacct call and given its source. A job that ended minutes ago is still asked (Slurm could requeue
    it): recorded PREEMPTED two minutes ago, Slurm says PENDING, and that is recorded."""
    home = tmp_path / "home"
    done, held, running = jobs["done"], jobs["held"], jobs["running"]
    add_jobs(home, [done, held, running], tmp_path / "runs")
    now = time.time()
    with Registry.open(home) as reg:
        reg.record_states({done: JobState.COMPLETED}, source="sacct", at=now - FINAL_AFTER_S - 60)
        reg.set_scheduler_info({done: ("n[7-8]", "0:0", None)})  # what the record says, not Slurm
        reg.record_states({held: JobState.PREEMPTED}, source="squeue", at=now - 120)
        res = refresh_states(reg, reg.get_many([done, held, running]))
        assert reg.get(held).last_state is JobState.PENDING  # requeued after all: recorded
    one = res.states[done]
    assert (one.state, one.source, one.stale, one.node_list, one.exit_code) == (
        JobState.COMPLETED,
        "final",
        False,
        "n[7-8]",
        "0:0",
    )
    assert (res.states[held].state, res.states[held].source) == (JobState.PENDING, "squeue")
    assert res.states[running].source == "squeue"
    assert not res.stale and res.calls == {"squeue": 1, "sacct": 0}
    with Registry.open(home) as reg:  # only the final job: no scheduler asked at all
        alone = refresh_states(reg, reg.get_many([done]))
    assert alone.calls == {} and alone.states[done].source == "final"


def _metrics(run_dir: Path, steps: int, max_steps: int = 100) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for s in range(1, steps + 1):
            record = {"event": "train", "step": s, "max_steps": max_steps, "loss": 1.0 / s}
            record |= {"tokens_per_s": 25000.0, "step_time_s": 0.1, "world_size": 4, "strategy": "fsdp2"}
            fh.write(json.dumps({**record, "time": 100.0 + s}) + "\n")


def test_status_table_marks_what_slurm_could_not_answer_stale(
    jobs: dict[str, str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    home, runs = Path(orch_env["ORCHESTRATOR_HOME"]), tmp_path / "runs"
    running = jobs["running"]
    add_jobs(home, [running, NEVER], runs)
    _metrics(runs / running, 40)
    res = run_cli(["status"], orch_env, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0].split() == [
        "JOB",
        "NAME",
        "STATE",
        "STRATEGY",
        "NODES",
        "STEP",
        "LOSS",
        "TOK/S",
        "ETA",
        "CKPT",
        "REQUEUES",
    ]
    row = next(ln for ln in lines if ln.startswith(f"{running} "))
    never = next(ln for ln in lines if ln.startswith(f"{NEVER} "))
    assert "RUNNING" in row and "(stale)" not in row, row
    assert "40/100" in row and "25.0k" in row and "1m00s" in row, row
    assert "RUNNING (stale)" in never, never  # neither squeue nor sacct knows it: the registry's word
    assert "Traceback" not in res.stderr and "error" not in res.stderr.lower(), res.stderr


def test_cancel_signals_then_cancels_a_real_job(
    slurm_cluster: dict, orch_env: dict[str, str], tmp_path: Path
) -> None:
    """``cancel --signal usr1`` reaches the job's step; plain ``cancel`` ends it CANCELLED and records
    who asked. Signalling a job Slurm does not know is refused by scancel ("Invalid job id
    specified", exit 1), and cancel says so (exit 1). (A plain ``scancel`` of an unknown id says
    nothing and exits 0 on Slurm 22.05: measured, so there is no refusal to pass on.)"""
    ready, flag = tmp_path / "ready", tmp_path / "usr1"
    step = f"trap 'echo usr1 >> {flag}' USR1; echo ok > {ready}; while :; do sleep 0.2; done"
    job = sbatch("-o", str(tmp_path / "%j.out"), "--wrap", f"srun bash -c {shlex.quote(step)}")
    try:
        home = Path(orch_env["ORCHESTRATOR_HOME"])
        add_jobs(home, [job, NEVER], tmp_path / "runs")
        poll(ready.exists, 120, "the job's step to install its USR1 trap")
        sent = run_cli(["cancel", job, "--signal", "usr1"], orch_env, timeout=60)
        assert sent.returncode == 0 and f"sent SIGUSR1 to job {job}" in sent.stdout, sent.stdout + sent.stderr
        poll(lambda: flag.exists() and flag.read_text() == "usr1\n", 60, "USR1 in the job's step")
        assert wait_for_job_state(job, "RUNNING", timeout=5) == "RUNNING"  # a signal is not a cancel
        done = run_cli(["cancel", job], orch_env, timeout=60)
        assert done.returncode == 0 and f"cancel requested for job {job}" in done.stdout, (
            done.stdout + done.stderr
        )
        assert wait_for_job_state(job, "CANCELLED", timeout=60) == "CANCELLED"
        with Registry.open(home) as reg:
            assert (reg.get(job).end_reason or "").startswith("cancel requested by")
        unknown = run_cli(["cancel", NEVER, "--signal", "usr1"], orch_env, timeout=60)
        assert unknown.returncode == 1 and "Invalid job id" in unknown.stderr, unknown.stdout + unknown.stderr
        assert "Traceback" not in unknown.stderr
    finally:
        slurm("scancel", job, check=False)


def test_ended_jobs_are_read_from_sacct_with_their_details(
    jobs: dict[str, str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    """squeue does not list the ended jobs (the test asks it too), so sacct answers for them, with the
    exit code and nodes, in one call; squeue answers for the live one; nobody for an unknown id.
    ``refresh`` records each change once, and ``status`` shows the sacct row."""
    done, failed, running = jobs["done"], jobs["failed"], jobs["running"]
    said = slurm("squeue", "-h", "-j", f"{running},{done},{failed}", "-o", "%i")
    assert said.stdout.split() == [running], said.stdout
    home = tmp_path / "home"
    add_jobs(home, [running, done, failed, NEVER], tmp_path / "runs")
    add_jobs(home, ["local-1"], tmp_path / "runs", scheduler="local")
    (tmp_path / "runs" / "local-1").mkdir(parents=True)
    (tmp_path / "runs" / "local-1" / "local_state.json").write_text(json.dumps({"state": "COMPLETED"}))

    with Registry.open(home) as reg:
        res = query_states([running, done, failed, NEVER, "local-7"], registry=reg)
    assert res.calls == {"squeue": 1, "sacct": 1} and res.errors == ()
    assert (res.states[running].state, res.states[running].source) == (JobState.RUNNING, "squeue")
    for job_id, state, code in ((done, JobState.COMPLETED, "0:0"), (failed, JobState.FAILED, "3:0")):
        got, acct = res.states[job_id], accounting(job_id)
        assert (got.state, got.source, got.stale, got.exit_code) == (state, "sacct", False, code), got
        assert got.node_list == acct["node_list"] and got.node_list, (got, acct)
        assert got.end and got.elapsed, got
    assert (res.states[NEVER].state, res.states[NEVER].source) == (JobState.RUNNING, "registry")
    assert res.states["local-7"].state is JobState.UNKNOWN
    assert res.stale and res.source == "registry"

    with Registry.open(home) as reg:
        for _ in range(3):  # repeated polls do not grow the history
            seen = refresh_states(reg, reg.list_jobs())
        assert (
            seen.states["local-1"].source == "run_dir" and reg.get("local-1").last_state is JobState.COMPLETED
        )
        j_failed, j_running = reg.get(failed), reg.get(running)
        assert (j_failed.last_state, j_failed.exit_code) == (JobState.FAILED, "3:0")
        assert j_failed.node_list == accounting(failed)["node_list"]
        assert [(h.state, h.source) for h in reg.history(failed)] == [
            (JobState.RUNNING, "submit"),
            (JobState.FAILED, "sacct"),
        ]
        assert (j_running.last_state, j_running.node_list) == (JobState.RUNNING, squeue_nodes(running))
        assert len(reg.history(running)) == 1

    status = run_cli(["status", done, "--json"], orch_env, timeout=60)  # the same registry (home)
    assert status.returncode == 0, status.stdout + status.stderr
    data = json.loads(status.stdout)
    row = data["jobs"][0]
    assert (row["source"], row["state"], row["stale"], row["exit_code"]) == (
        "sacct",
        "COMPLETED",
        False,
        "0:0",
    )
    assert row["node_list"] == accounting(done)["node_list"], row
    assert data["scheduler_calls"] == {"squeue": 1, "sacct": 1} and data["errors"] == []
