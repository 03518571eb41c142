"""Registry: schema, permissions, WAL, history-on-change, corruption handling, real concurrency."""

from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.contract.errors import UserError
from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import MIGRATIONS, SCHEMA_VERSION, Registry
from tests.helpers.cli import run_cli


def _add(reg: Registry, job_id: str, **kw: object) -> None:
    args: dict[str, object] = dict(
        job_id=job_id,
        name=f"n-{job_id}",
        profile="local",
        scheduler="local",
        strategy="ddp",
        nodes=2,
        procs_per_node=2,
        command=["python", "train.py", "--lr", "1e-3"],
        run_dir=f"/tmp/runs/{job_id}",
    )
    args.update(kw)
    reg.add_job(**args)  # type: ignore[arg-type]


def test_creates_private_dir_and_file_in_wal_mode(tmp_path: Path) -> None:
    home = tmp_path / "h" / "nested"
    with Registry.open(home) as reg:
        _add(reg, "local-1")
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    db = home / "registry.db"
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()
    for side in ("registry.db-wal", "registry.db-shm"):
        if (home / side).exists():
            assert stat.S_IMODE((home / side).stat().st_mode) & 0o077 == 0, side


def test_home_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "envhome"))
    with Registry.open() as reg:
        assert reg.path == tmp_path / "envhome" / "registry.db"
    assert reg.path.exists()


def test_roundtrip_typed_fields(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg:
        _add(reg, "4242", scheduler="slurm", nodes=4, procs_per_node=8, max_requeues=3, submitted_at=1000.0)
        job = reg.get("4242")
    assert job.scheduler == "slurm"
    assert (job.nodes, job.procs_per_node, job.world_size, job.max_requeues) == (4, 8, 32, 3)
    assert job.command == ["python", "train.py", "--lr", "1e-3"]
    assert job.run_dir == Path("/tmp/runs/4242")
    assert job.last_state is JobState.PENDING
    assert job.submitted_at == 1000.0 and job.last_state_at == 1000.0
    assert job.end_reason is None
    assert json.loads(json.dumps(job.to_json()))["last_state"] == "PENDING"


def test_unknown_id_is_a_user_error(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg, pytest.raises(UserError) as err:
        reg.get("nope")
    assert str(err.value) == "unknown job id 'nope' (see `orchestrator list`)"
    assert err.value.exit_code == 2


def test_duplicate_id_refused(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg:
        _add(reg, "7")
        with pytest.raises(UserError, match="already in the registry"):
            _add(reg, "7", name="other")
        assert reg.get("7").name == "n-7"


def test_bad_scheduler_refused(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg, pytest.raises(UserError, match="scheduler must be"):
        _add(reg, "1", scheduler="pbs")


def test_history_grows_only_on_change(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg:
        _add(reg, "1", submitted_at=10.0)
        assert reg.record_state("1", JobState.PENDING, "squeue", at=11.0) is False
        assert reg.record_state("1", JobState.RUNNING, "squeue", at=12.0) is True
        for t in range(13, 40):
            assert reg.record_state("1", JobState.RUNNING, "squeue", at=float(t)) is False
        assert reg.record_state("1", JobState.COMPLETED, "sacct", at=50.0) is True
        hist = reg.history("1")
        job = reg.get("1")
    assert [(h.state, h.at, h.source) for h in hist] == [
        (JobState.PENDING, 10.0, "submit"),
        (JobState.RUNNING, 12.0, "squeue"),
        (JobState.COMPLETED, 50.0, "sacct"),
    ]
    assert job.last_state is JobState.COMPLETED and job.last_state_at == 50.0


def test_record_state_unknown_job(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg, pytest.raises(UserError, match="unknown job id 'x'"):
        reg.record_state("x", JobState.RUNNING, "squeue")


def test_record_states_batch(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg:
        for i in range(5):
            _add(reg, str(i))
        changed = reg.record_states(
            {"0": JobState.RUNNING, "1": JobState.PENDING, "2": JobState.FAILED}, "squeue"
        )
        assert sorted(changed) == ["0", "2"]
        assert len(reg.history("1")) == 1 and len(reg.history("2")) == 2


def test_list_filters(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg:
        _add(reg, "a", submitted_at=100.0)
        _add(reg, "b", submitted_at=200.0)
        _add(reg, "c", submitted_at=300.0)
        reg.record_state("b", JobState.RUNNING, "squeue")
        reg.record_state("c", JobState.FAILED, "sacct")
        assert [j.job_id for j in reg.list_jobs()] == ["a", "b", "c"]
        assert [j.job_id for j in reg.list_jobs(state=JobState.RUNNING)] == ["b"]
        assert [j.job_id for j in reg.list_jobs(state="failed")] == ["c"]
        assert [j.job_id for j in reg.list_jobs(state=[JobState.PENDING, "FAILED"])] == ["a", "c"]
        assert [j.job_id for j in reg.list_jobs(since=150.0)] == ["b", "c"]
        assert [j.job_id for j in reg.list_jobs(state=JobState.FAILED, since=350.0)] == []


def test_active_and_recent(tmp_path: Path) -> None:
    now = 1_000_000.0
    with Registry.open(tmp_path) as reg:
        _add(reg, "old-done", submitted_at=now - 10 * 86400)
        reg.record_state("old-done", JobState.COMPLETED, "sacct", at=now - 9 * 86400)
        _add(reg, "old-running", submitted_at=now - 10 * 86400)
        reg.record_state("old-running", JobState.RUNNING, "squeue", at=now - 9 * 86400)
        _add(reg, "recent-done", submitted_at=now - 3600)
        reg.record_state("recent-done", JobState.FAILED, "sacct", at=now - 60)
        ids = [j.job_id for j in reg.active_and_recent(24 * 3600, now=now)]
    assert ids == ["old-running", "recent-done"]


def test_attempts_of_one_job(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg:
        _add(reg, "9")
        a0 = reg.add_attempt("9", scheduler_job_id="9", started_at=1.0)
        a1 = reg.add_attempt(
            "9", scheduler_job_id="9", started_from_checkpoint="/r/checkpoints/step_00000040"
        )
        assert (a0.attempt, a1.attempt) == (0, 1)
        with pytest.raises(UserError, match="already recorded"):
            reg.add_attempt("9", attempt=1)
        with pytest.raises(UserError, match="unknown job id"):
            reg.add_attempt("nope")
        atts = reg.attempts("9")
        assert [(a.attempt, a.started_at) for a in atts][0] == (0, 1.0) and len(atts) == 2
        assert atts[1].started_from_checkpoint == "/r/checkpoints/step_00000040"
        assert reg.attempt_counts(["9", "other"]) == {"9": 2, "other": 0}


def test_scheduler_info_and_end_reason(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg:
        _add(reg, "5")
        reg.set_scheduler_info({"5": ("n[1-2]", None, "None")})
        reg.set_scheduler_info({"5": (None, "0:9", None)})
        reg.set_end_reason("5", "cancel requested")
        job = reg.get("5")
        with pytest.raises(UserError):
            reg.set_end_reason("nope", "x")
    assert (job.node_list, job.exit_code, job.reason, job.end_reason) == (
        "n[1-2]",
        "0:9",
        "None",
        "cancel requested",
    )


def test_local_ids_never_repeat(tmp_path: Path) -> None:
    with Registry.open(tmp_path) as reg:
        ids = [reg.allocate_local_id() for _ in range(3)]
    with Registry.open(tmp_path) as reg:
        ids.append(reg.allocate_local_id())
    assert ids == ["local-1", "local-2", "local-3", "local-4"]


@pytest.mark.parametrize(
    "content", [b"this is not a database, it is a text file\n" * 200, b"SQLite format 3\x00" + b"\xff" * 4000]
)
def test_corrupt_file_is_reported_and_left_alone(tmp_path: Path, content: bytes) -> None:
    db = tmp_path / "registry.db"
    db.write_bytes(content)
    with pytest.raises(UserError) as err:
        Registry.open(tmp_path)
    assert str(db) in str(err.value)
    assert err.value.exit_code == 2
    assert db.read_bytes() == content


def test_corrupt_registry_cli_one_line_exit_2(tmp_path: Path, orch_env: dict[str, str]) -> None:
    home = Path(orch_env["ORCHESTRATOR_HOME"])
    home.mkdir(parents=True)
    (home / "registry.db").write_bytes(b"garbage" * 1000)
    res = run_cli(["list"], orch_env, timeout=60)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "registry.db" in res.stderr
    assert (home / "registry.db").read_bytes() == b"garbage" * 1000


def test_migrates_old_schema_keeping_rows(tmp_path: Path) -> None:
    db = tmp_path / "registry.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for sql in MIGRATIONS[0]:
        conn.execute(sql)
    conn.execute("INSERT INTO schema_version VALUES (1)")
    conn.execute(
        "INSERT INTO jobs (job_id, name, profile, scheduler, strategy, nodes, procs_per_node, command, run_dir,"
        " submitted_at, last_state, last_state_at, max_requeues) VALUES"
        " ('77','old','local','local','ddp',1,1,'[\"python\"]','/r',5.0,'RUNNING',6.0,0)"
    )
    conn.commit()
    conn.close()
    with Registry.open(tmp_path) as reg:
        assert reg.schema_version == SCHEMA_VERSION == 5
        job = reg.get("77")
        assert job.last_state is JobState.RUNNING and job.node_list is None
        reg.set_scheduler_info({"77": ("n1", "0:0", None)})
        assert reg.get("77").node_list == "n1"


def test_newer_schema_refused(tmp_path: Path) -> None:
    with Registry.open(tmp_path):
        pass
    conn = sqlite3.connect(tmp_path / "registry.db")
    conn.execute("INSERT INTO schema_version VALUES (99)")
    conn.commit()
    conn.close()
    with pytest.raises(UserError, match="schema version 99, newer"):
        Registry.open(tmp_path)


# ---------------------------------------------------------------- concurrency (real processes, real SQLite)
N_PROCS = 8
PER_PROC = 40


def _worker(home: str, worker: int, start: Any) -> None:
    start.wait(30)
    for i in range(PER_PROC):
        # A fresh connection each time, like separate `orchestrator submit` processes.
        with Registry.open(Path(home)) as reg:
            local_id = reg.allocate_local_id()
            reg.add_job(
                job_id=local_id,
                name=f"w{worker}-{i}",
                profile="local",
                scheduler="local",
                strategy="ddp",
                nodes=1,
                procs_per_node=1,
                command=["python", "x.py"],
                run_dir=f"/tmp/w{worker}/{i}",
            )
            reg.add_attempt(local_id)
            reg.record_state(local_id, JobState.RUNNING, "test")


def test_eight_processes_adding_jobs_lose_nothing(tmp_path: Path) -> None:
    home = tmp_path / "shared"  # not created yet: the processes race on creating it too
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_worker, args=(str(home), w, start)) for w in range(N_PROCS)]
    for p in procs:
        p.start()
    start.set()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    stuck = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not stuck, f"workers still running: {stuck}"
    assert [p.exitcode for p in procs] == [0] * N_PROCS
    with Registry.open(home) as reg:
        jobs = reg.list_jobs()
        total = N_PROCS * PER_PROC
        assert len(jobs) == total
        assert sorted(int(j.job_id.split("-")[1]) for j in jobs) == list(range(1, total + 1))
        assert {j.name for j in jobs} == {f"w{w}-{i}" for w in range(N_PROCS) for i in range(PER_PROC)}
        assert all(j.last_state is JobState.RUNNING for j in jobs)
        assert sum(reg.attempt_counts().values()) == total
        assert all(len(reg.history(j.job_id)) == 2 for j in jobs[:50])


# ---------------------------------------------------------------- `orchestrator list`
def test_list_cli(orch_env: dict[str, str]) -> None:
    home = Path(orch_env["ORCHESTRATOR_HOME"])
    now = time.time()
    with Registry.open(home) as reg:
        _add(reg, "100", scheduler="slurm", submitted_at=now - 5 * 86400)
        _add(reg, "101", scheduler="slurm", submitted_at=now - 600)
        _add(reg, "local-1", submitted_at=now - 60)
        reg.record_state("101", JobState.RUNNING, "squeue")
    res = run_cli(["list", "--json"], orch_env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert [j["job_id"] for j in json.loads(res.stdout)] == ["100", "101", "local-1"]
    res = run_cli(["list", "--state", "running", "--json"], orch_env, timeout=60)
    assert [j["job_id"] for j in json.loads(res.stdout)] == ["101"]
    res = run_cli(["list", "--since", "2h", "--json"], orch_env, timeout=60)
    assert [j["job_id"] for j in json.loads(res.stdout)] == ["101", "local-1"]
    iso = time.strftime("%Y-%m-%d", time.localtime(now - 2 * 86400))
    res = run_cli(["list", "--since", iso], orch_env, timeout=60)
    assert res.returncode == 0
    lines = res.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["JOB", "NAME", "STATE"]
    assert [ln.split()[0] for ln in lines[1:]] == ["101", "local-1"]


@pytest.mark.parametrize(
    "args, needle", [(["--since", "yesterday"], "--since"), (["--state", "WEIRD"], "--state")]
)
def test_list_cli_bad_input(orch_env: dict[str, str], args: list[str], needle: str) -> None:
    res = run_cli(["list", *args], orch_env, timeout=60)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and needle in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_rows_read_back_are_complete_records(tmp_path: Path) -> None:
    """Rows become JobRecords without the dataclass __init__ (speed): every field must be there."""
    from orchestrator.registry.store import JobRecord

    with Registry.open(tmp_path) as reg:
        _add(reg, "local-1")
        rec = reg.get("local-1")
    assert vars(rec) == vars(JobRecord(**vars(rec)))


# ---------------------------------------------------------------- runs: the jobs of one run directory
def test_jobs_in_one_run_dir_are_one_run(tmp_path: Path) -> None:
    """`resume` / auto-resume submit a new job into the same run directory: the run's newest job is
    where each older one continues; order is submission order, not job id or clock."""
    with Registry.open(tmp_path) as reg:
        _add(reg, "local-9", run_dir="/r/a", submitted_at=5.0)
        _add(reg, "local-20", run_dir="/r/b", submitted_at=5.0)
        _add(reg, "local-10", run_dir="/r/a", submitted_at=5.0)  # same clock: id "10" < "9" as text
        _add(
            reg, "local-11", run_dir="/r/a/", submitted_at=4.0
        )  # a clock stepped back; same dir spelled with /
        assert reg.successors(["local-9", "local-10", "local-11", "local-20", "nope"]) == {
            "local-9": "local-11",
            "local-10": "local-11",
        }
        run = reg.run_of("local-10")
        assert (run.run_dir, run.job_ids) == (Path("/r/a"), ("local-9", "local-10", "local-11"))
        assert (run.root_job_id, run.newest_job_id, run.created_at) == ("local-9", "local-11", 5.0)
        other = reg.run_at("/r/b")
        assert other is not None and other.job_ids == ("local-20",) and other.run_id != run.run_id
        assert reg.run_at("/r/a/") == run and reg.run_at("/r/none") is None
        with pytest.raises(UserError, match="unknown job id 'nope'"):
            reg.run_of("nope")
        with pytest.raises(UserError, match="already in the registry"):
            _add(reg, "local-9", run_dir="/r/c")  # the refused job leaves no empty run behind
        assert reg.run_at("/r/c") is None


def test_successors_over_many_jobs_is_one_query_per_500_ids(tmp_path: Path) -> None:
    """`status` asks for every row at once: no query per job (1,200 ids -> 3 queries)."""
    with Registry.open(tmp_path) as reg:
        for i in range(600):
            _add(reg, f"{i}", run_dir=f"/r/{i}", submitted_at=1.0)
            _add(reg, f"{i}-resumed", run_dir=f"/r/{i}", submitted_at=2.0)
        ids = [f"{i}{suffix}" for i in range(600) for suffix in ("", "-resumed")]
        statements: list[str] = []
        reg._conn.set_trace_callback(statements.append)
        found = reg.successors(ids)
        reg._conn.set_trace_callback(None)
    assert found == {f"{i}": f"{i}-resumed" for i in range(600)}
    assert list(found) == [f"{i}" for i in range(600)]  # in the order asked
    assert len(statements) == 3, statements[:5]


def _v2_registry(home: Path) -> None:
    """A registry as version 2 left it, with a run that was resumed twice and linked through attempts."""
    home.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(home / "registry.db")
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version in (1, 2):
        for sql in MIGRATIONS[version - 1]:
            conn.execute(sql)
        conn.execute("INSERT INTO schema_version VALUES (?)", (version,))
    jobs = [  # job_id, run_dir, submitted_at
        ("100", "/r/a", 1.0),
        ("200", "/r/b", 1.5),
        ("101", "/r/a", 2.0),  # `orchestrator resume 100`
        ("102", "/r/a", 3.0),  # `orchestrator resume 101`
        ("local-9", "/r/d", 4.0),
        ("local-10", "/r/d", 4.0),  # resumed within the clock's resolution
        ("300", "/r/c", 5.0),
    ]
    for job_id, run_dir, at in jobs:
        conn.execute(
            "INSERT INTO jobs (job_id, name, profile, scheduler, strategy, nodes, procs_per_node, command, run_dir,"
            " submitted_at, last_state, last_state_at, max_requeues, node_list) VALUES"
            " (?, 'old', 'slurm_test', 'slurm', 'ddp', 1, 1, '[\"train.py\"]', ?, ?, 'FAILED', ?, 0, 'n1')",
            (job_id, run_dir, at, at),
        )
    attempts = [  # job_id, attempt, scheduler_job_id, started_from_checkpoint
        ("100", 0, "100", None),
        ("100", 1, "100", "/r/a/checkpoints/step_00000020"),  # a Slurm requeue: kept
        ("100", 2, "101", "/r/a/checkpoints/step_00000040"),  # version 2's link to the resumed job
        ("101", 0, "101", "/r/a/checkpoints/step_00000040"),
        ("101", 1, "102", "/r/a/checkpoints/step_00000080"),
        ("102", 0, "102", "/r/a/checkpoints/step_00000080"),
        ("200", 0, "4242", None),  # a local job's submitit id: not a link
        ("300", 0, "300", None),
        ("300", 1, "999", None),  # names no registered job: not a link
    ]
    conn.executemany("INSERT INTO attempts VALUES (?, ?, ?, ?, 1.0, NULL, NULL)", attempts)
    conn.execute("INSERT INTO checkpoints VALUES ('100', 40, '/r/a/checkpoints/step_00000040', 2.0)")
    conn.commit()
    conn.close()


def test_migration_from_v2_puts_linked_jobs_in_one_run(tmp_path: Path) -> None:
    _v2_registry(tmp_path)
    ids = ["100", "101", "102", "200", "300", "local-9", "local-10"]
    with Registry.open(tmp_path) as reg:
        assert reg.schema_version == SCHEMA_VERSION == 5
        # what version 2 answered for the resumed run, plus the run it could not see (no link rows)
        assert reg.successors(ids) == {"100": "102", "101": "102", "local-9": "local-10"}
        assert reg.run_of("101").job_ids == ("100", "101", "102")
        assert reg.run_of("local-10").job_ids == ("local-9", "local-10")
        assert reg.run_of("300").job_ids == ("300",) and reg.run_of("200").job_ids == ("200",)
        # attempts are now those of one job each: the links went, requeues and ids of other kinds stayed
        assert [(a.attempt, a.scheduler_job_id) for a in reg.attempts("100")] == [(0, "100"), (1, "100")]
        assert [a.scheduler_job_id for a in reg.attempts("101")] == ["101"]
        assert [a.scheduler_job_id for a in reg.attempts("200")] == ["4242"]
        assert [a.scheduler_job_id for a in reg.attempts("300")] == ["300", "999"]
        assert reg.get("102").node_list == "n1" and len(reg.list_jobs()) == 7
        tables = {r[0] for r in reg._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "checkpoints" not in tables and "runs" in tables
        # the run goes on after the migration: numbering continues after the backfilled jobs
        _add(reg, "103", run_dir="/r/a", submitted_at=0.5)
        assert reg.successors(["100", "102", "103"]) == {"100": "103", "102": "103"}
        assert reg.run_of("103").root_job_id == "100"


N_RUN_PROCS = 6
PER_RUN_PROC = 15


def _run_dir_worker(home: str, worker: int, start: Any) -> None:
    start.wait(30)
    for i in range(PER_RUN_PROC):
        with Registry.open(Path(home)) as reg:  # a fresh connection each time, like separate `resume`s
            _add(reg, f"w{worker}-{i}", run_dir=f"{home}/runs/shared", submitted_at=1.0)


def test_concurrent_add_job_into_one_run_dir_makes_one_run(tmp_path: Path) -> None:
    home = tmp_path / "shared"  # a brand-new registry: the first jobs also race on creating the run
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_run_dir_worker, args=(str(home), w, start)) for w in range(N_RUN_PROCS)]
    for p in procs:
        p.start()
    start.set()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    stuck = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not stuck, f"workers still running: {stuck}"
    assert [p.exitcode for p in procs] == [0] * N_RUN_PROCS
    with Registry.open(home) as reg:
        rows = reg._conn.execute("SELECT run_id, run_dir FROM runs").fetchall()
        assert len(rows) == 1 and rows[0][1] == f"{home}/runs/shared", rows
        seqs = sorted(r[0] for r in reg._conn.execute("SELECT run_seq FROM jobs"))
        run = reg.run_of("w0-0")
        successors = reg.successors(run.job_ids)
    total = N_RUN_PROCS * PER_RUN_PROC
    assert seqs == list(range(total))
    assert sorted(run.job_ids) == sorted(f"w{w}-{i}" for w in range(N_RUN_PROCS) for i in range(PER_RUN_PROC))
    for w in range(N_RUN_PROCS):  # each process's jobs in the order it added them
        own = [j for j in run.job_ids if j.startswith(f"w{w}-")]
        assert own == [f"w{w}-{i}" for i in range(PER_RUN_PROC)]
    assert successors == {j: run.newest_job_id for j in run.job_ids[:-1]}
