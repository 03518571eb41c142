"""Many processes opening a brand-new registry at the same instant (a sweep's first ``submit``s).

Every opener finds an empty file, so all of them try to switch it to WAL and create the schema at
once. SQLite does not call the busy handler for every lock it needs on that path: ``PRAGMA
journal_mode = WAL`` fails at once with "database is locked" while another connection holds a
RESERVED lock on the file (an opener creating the schema), whatever busy_timeout says. The first
test pins that case deterministically; the second is the real race (real processes, real SQLite,
fresh registries, several rounds), which hit it in about 2 of 100 rounds of 16 processes before
the fix.
"""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from orchestrator.registry.store import SCHEMA_VERSION, Registry

N_PROCS = 16
ROUNDS = 8


def test_open_waits_for_a_first_opener_holding_the_new_file(tmp_path: Path) -> None:
    """Another connection holds the fresh, still rollback-mode file locked for writing (as a
    concurrent first opener does while it creates the schema): open must wait, not fail."""
    db = tmp_path / "registry.db"
    db.touch(mode=0o600)
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # RESERVED lock, journal mode still "delete"
    release = threading.Timer(0.5, lambda: other.execute("COMMIT"))
    release.start()
    try:
        with Registry.open(tmp_path) as reg:
            assert reg.schema_version == SCHEMA_VERSION
    finally:
        release.join()
        other.close()
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def _opener(home: str, start: Any, results: Any) -> None:
    start.wait(30)
    try:
        with Registry.open(Path(home)) as reg:
            local_id = reg.allocate_local_id()
            reg.add_job(
                job_id=local_id,
                name="race",
                profile="local",
                scheduler="local",
                strategy="ddp",
                nodes=1,
                procs_per_node=1,
                command=["python", "x.py"],
                run_dir=f"/tmp/race/{local_id}",
            )
        results.put("ok")
    except BaseException as exc:  # report, don't just die: the assertion shows the message
        results.put(f"{type(exc).__name__}: {exc}")


def _round(home: Path) -> list[str]:
    ctx = mp.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_opener, args=(str(home), start, results)) for _ in range(N_PROCS)]
    for p in procs:
        p.start()
    time.sleep(0.2)  # let every process reach the barrier, so the opens really coincide
    start.set()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    return outcomes


def test_concurrent_first_opens_never_fail(tmp_path: Path) -> None:
    for r in range(ROUNDS):
        home = tmp_path / f"round{r}"  # not created yet: the processes race on the folder too
        outcomes = _round(home)
        failures = [o for o in outcomes if o != "ok"]
        assert not failures, f"round {r}: {len(failures)} of {N_PROCS} opens failed: {failures[:3]}"
        with Registry.open(home) as reg:
            assert reg.schema_version == SCHEMA_VERSION
            assert len(reg.list_jobs()) == N_PROCS
        conn = sqlite3.connect(home / "registry.db")
        try:
            versions = [row[0] for row in conn.execute("SELECT version FROM schema_version ORDER BY version")]
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            conn.close()
        assert versions == list(range(1, SCHEMA_VERSION + 1)), "each migration applied exactly once"
