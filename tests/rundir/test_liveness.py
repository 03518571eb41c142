"""``status``'s liveness of a running job (orchestrator.rundir.liveness): seconds since any rank's last output,
from the newest attempt's node logs, and the slowest rank, from the heartbeats. ``status`` keeps the
listing of ``logs/`` and of that attempt's folder in its summary cache while neither folder changes:
the answer itself must be read fresh on every call (a heartbeat rewritten in place and a node log
written to change no folder), and a new node log or attempt must be seen at once."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from orchestrator.contract.heartbeat import RECORD_BYTES
from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry
from orchestrator.rundir.liveness import SILENT_NOTE_S, liveness
from orchestrator.rundir.summary_cache import SUMMARY_CACHE_FILE, SummaryCache
from tests.helpers.cli import run_cli


def beat(attempt: Path, rank: int, recent: list[float]) -> None:
    """A rank's heartbeat record as Heartbeat.beat writes it: one fixed-size record rewritten in place
    at offset 0 (the file's folder does not change)."""
    folder = attempt / "heartbeat"
    folder.mkdir(exist_ok=True)
    record = {
        "rank": rank, "node": rank, "host": f"n{rank}", "pid": 100 + rank, "step": 9, "phase": "forward",
        "time": time.time(), "step_s": 1.0, "local_s": recent[-1], "recent": recent,
    }  # fmt: skip
    fd = os.open(folder / f"rank_{rank}.json", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, json.dumps(record).encode().ljust(RECORD_BYTES), 0)
    finally:
        os.close(fd)


def output_at(log: Path, ago: float) -> None:
    """The node log was last written ``ago`` seconds ago."""
    log.touch()
    t = time.time() - ago
    os.utime(log, (t, t))


def age(*folders: Path) -> None:
    """Folders last changed an hour ago: a listing of them may be cached (fresh ones never are)."""
    t = time.time() - 3600
    for folder in folders:
        os.utime(folder, (t, t))


def make_run(run: Path) -> Path:
    (run / "logs" / "attempt_0").mkdir(parents=True)
    (run / "logs" / "attempt_7").write_text("a file named like an attempt folder: not an attempt")
    attempt = run / "logs" / "attempt_1"
    attempt.mkdir()
    output_at(attempt / "node_0.log", 100)
    output_at(attempt / "node_1.log", 50)
    beat(attempt, 0, [0.1] * 5)
    beat(attempt, 1, [0.5] * 5)  # rank 1: 5x slower outside collectives in each of its last 5 steps
    (run / "local_pids.json").write_text(json.dumps({"controller": os.getpid()}))  # alive: RUNNING
    age(attempt, run / "logs")
    return attempt


def status(env: dict[str, str], job_id: str) -> tuple[dict[str, Any], str]:
    """(the job's liveness from ``status --json``, the table's output)."""
    res = run_cli(["status", "--json", job_id], env, timeout=60)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)["jobs"][0]
    assert row["state"] == "RUNNING", row
    table = run_cli(["status", job_id], env, timeout=60)
    assert table.returncode == 0, table.stderr
    return row["liveness"], table.stdout


def test_liveness_is_read_fresh_on_every_status_call(orch_env: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    attempt = make_run(run)
    home = Path(orch_env["ORCHESTRATOR_HOME"])
    with Registry.open(home) as reg:
        reg.add_job(
            job_id="local-7", name="t", profile="local", scheduler="local", strategy="ddp", nodes=2,
            procs_per_node=1, command=["python"], run_dir=run, state=JobState.RUNNING,
        )  # fmt: skip

    live, table = status(orch_env, "local-7")
    assert live["attempt"] == 1  # the newest attempt folder; attempt_7 is a file
    assert 50 <= live["silent_s"] < 50 + 30, live  # node_1.log, the newest output
    s = live["stragglers"]
    assert (s["slowest_rank"], s["slowest_host"], s["flagged_ranks"], s["ratio"]) == (1, "n1", [1], 5.0)
    silent = re.search(r"^local-7: no output from any rank for (\d+) s", table, re.M)
    assert silent is not None and 50 <= int(silent.group(1)) < 50 + 30, table
    assert "local-7: straggler rank 1 on n1" in table
    cached = json.loads((home / SUMMARY_CACHE_FILE).read_text())["attempts"]
    assert cached[str(run)][2:] == [1, "attempt_1", ["node_0.log", "node_1.log"], True]
    listed_at = attempt.stat().st_mtime_ns

    # Output and heartbeats change; no folder does: the cached listing is used, the answer is new.
    output_at(attempt / "node_0.log", 2)
    beat(attempt, 1, [0.1] * 5)
    beat(attempt, 0, [0.12] * 5)
    assert attempt.stat().st_mtime_ns == listed_at and str(run) in cached
    live, table = status(orch_env, "local-7")
    assert live["attempt"] == 1 and live["silent_s"] < SILENT_NOTE_S, live
    s = live["stragglers"]
    assert (s["slowest_rank"], s["flagged_ranks"]) == (0, []), s
    assert "no output from any rank" not in table and "straggler" not in table

    # A node log that was not there when the folder was listed is the newest output.
    output_at(attempt / "node_0.log", 300)
    output_at(attempt / "node_1.log", 300)
    output_at(attempt / "node_2.log", 30)
    live, _ = status(orch_env, "local-7")
    assert 30 <= live["silent_s"] < 30 + 30, live

    # A new attempt (a requeue): its folder, no heartbeats yet, no output yet.
    (run / "logs" / "attempt_2").mkdir()
    live, table = status(orch_env, "local-7")
    assert live == {"attempt": 2, "silent_s": None, "stragglers": None}
    assert "local-7:" not in table


def test_cached_listing_answers_like_a_fresh_one(tmp_path: Path) -> None:
    """In one process and across processes (the saved file): the same answer as liveness() itself."""
    run = tmp_path / "run"
    attempt = make_run(run)
    cache_file = tmp_path / "cache.json"
    now = time.time()
    first = SummaryCache(cache_file)
    assert first.liveness(run, now) == liveness(run, now)
    first.save()
    again = SummaryCache(cache_file)
    assert again._attempts, "the listing must have been cached, or this test proves nothing"
    assert again.liveness(run, now) == liveness(run, now)
    (attempt / "heartbeat" / "rank_1.json").unlink()  # one rank: no straggler comparison
    assert again.liveness(run, now) == liveness(run, now)
    assert again.liveness(run, now)["stragglers"] is None  # type: ignore[index]
    assert SummaryCache(cache_file).liveness(tmp_path / "none", now) is None
