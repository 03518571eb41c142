"""The hang watchdog's parts without a cluster: heartbeats written and read back from real files,
the allowance rules, the stall trigger, straggler flags and which rank differs. The real-cluster
behaviour (a stopped rank, a slow checkpoint, stacks, auto-resume) is in tests/cluster/test_watchdog.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.contract.heartbeat import RECENT_STEPS, Heartbeat, read_heartbeats, stragglers
from orchestrator.contract.run_dir import attempt_dir, heartbeat_file
from orchestrator.supervise.stacks import find_culprit
from orchestrator.supervise.watchdog import STRAGGLER_REPEAT_S, Watchdog


def beats(run_dir: Path, rank: int, steps: int) -> Heartbeat:
    hb = Heartbeat(heartbeat_file(attempt_dir(run_dir, 0), rank), rank, node=rank)
    for step in range(1, steps + 1):
        for phase in ("data", "forward", "backward", "optimizer"):
            hb.beat(step, phase)
    return hb


def test_for_this_rank_needs_the_launch_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("ORCHESTRATOR_RUN_DIR", "ORCHESTRATOR_ATTEMPT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert Heartbeat.for_this_rank() is None
    monkeypatch.setenv("ORCHESTRATOR_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("ORCHESTRATOR_ATTEMPT", "3")
    monkeypatch.setenv("RANK", "5")
    hb = Heartbeat.for_this_rank()
    assert hb is not None
    hb.beat(7, "checkpoint")
    record = read_heartbeats(attempt_dir(tmp_path, 3))[5]
    assert (record["step"], record["phase"], record["step_s"]) == (7, "checkpoint", None)


def test_a_beat_rewrites_one_record_and_times_finished_steps(tmp_path: Path) -> None:
    hb = beats(tmp_path, 0, RECENT_STEPS + 3)
    hb.beat(99, "data")  # a jump (resume): no step time from it
    path = heartbeat_file(attempt_dir(tmp_path, 0), 0)
    assert path.stat().st_size == 512
    rec = read_heartbeats(attempt_dir(tmp_path, 0))[0]
    assert rec["step"] == 99 and rec["phase"] == "data"
    assert len(rec["recent"]) == RECENT_STEPS and rec["step_s"] is not None


def test_a_torn_record_reads_as_none(tmp_path: Path) -> None:
    path = heartbeat_file(attempt_dir(tmp_path, 0), 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"rank": 0, "step": 4, "pha')
    assert read_heartbeats(attempt_dir(tmp_path, 0)) == {}


def test_allowance_is_longer_in_the_first_step_and_while_checkpointing(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, 0, hang_timeout=60)
    running = {
        0: {"step": 5, "phase": "forward", "step_s": 0.1},
        1: {"step": 5, "phase": "backward", "step_s": 0.1},
    }
    # docs/resume-and-faults.md's numbers, written out (not the module's constants): x10 while a rank checkpoints,
    # x5 until every rank finished its first step, else 20 median step times but at least 300 s.
    assert dog.allowance(running) == (60, "")
    saving = {**running, 1: {"step": 5, "phase": "checkpoint", "step_s": 0.1}}
    assert dog.allowance(saving) == (600, ", longer: a rank is checkpointing")
    first = {**running, 1: {"step": 1, "phase": "forward", "step_s": None}}
    assert dog.allowance(first) == (300, ", longer: the first step")
    derived = Watchdog(tmp_path, 0, hang_timeout=None)
    assert derived.allowance(running) == (300, "")
    slow = {r: {**h, "step_s": 30.0} for r, h in running.items()}
    assert derived.allowance(slow) == (600, "")
    uneven = {0: {**running[0], "step_s": 20.0}, 1: {**running[1], "step_s": 40.0}}
    assert derived.allowance(uneven) == (600, "")  # the median of 20 and 40 s
    assert derived.allowance({**slow, 1: {**slow[1], "phase": "checkpoint"}})[0] == 6000


def test_the_watchdog_fires_only_after_no_rank_moved_for_the_timeout(tmp_path: Path) -> None:
    hb0, hb1 = beats(tmp_path, 0, 3), beats(tmp_path, 1, 3)
    dog = Watchdog(tmp_path, 0, hang_timeout=10)
    assert dog.check(now=100.0) is None  # first sight: progress
    assert dog.check(now=109.0) is None
    hb1.beat(4, "data")  # one rank moves: the clock restarts
    assert dog.check(now=110.0) is None
    assert dog.check(now=119.5) is None
    hang = dog.check(now=121.0)
    assert hang is not None and hang.stalled_s == pytest.approx(11.0)
    assert "rank 1 step 4 data" in hang.describe()
    hb0.close()
    hb1.close()


def test_no_heartbeats_no_watchdog(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, 0, hang_timeout=1)
    assert dog.check(now=0.0) is None and dog.check(now=1000.0) is None


def test_stragglers_flag_a_rank_slow_in_every_recent_step() -> None:
    fast = [0.01] * RECENT_STEPS
    records = {
        0: {"recent": fast, "node": 0, "host": "n1"},
        1: {"recent": [0.05] * RECENT_STEPS, "node": 1, "host": "n2"},
        2: {"recent": fast, "node": 2, "host": "n3"},
    }
    found = stragglers(records)
    assert found is not None and found.flagged == [1] and found.slowest_host == "n2"
    assert found.to_json()["ratio"] == 5.0
    records[1]["recent"] = [0.05] * (RECENT_STEPS - 1) + [0.01]  # one normal step: not flagged
    again = stragglers(records)
    assert again is not None and again.flagged == [] and again.slowest_rank == 1
    assert stragglers({0: {"recent": fast}}) is None


def test_a_rank_that_keeps_turning_straggler_is_named_once_per_interval(tmp_path: Path) -> None:
    """On a loaded machine ranks take turns being slow: each is named once, then again only after
    STRAGGLER_REPEAT_S, with the times it was flagged meanwhile (the chaos run's log had a line every
    few seconds)."""
    said: list[str] = []
    dog = Watchdog(tmp_path, 0, 30.0, say=said.append)
    fast, slow = [0.01] * RECENT_STEPS, [0.05] * RECENT_STEPS
    turns = [{0: {"recent": slow, "host": "n1"}, 1: {"recent": fast, "host": "n2"}},
             {0: {"recent": fast, "host": "n1"}, 1: {"recent": slow, "host": "n2"}}]  # fmt: skip
    for i in range(10):  # ten flips within a minute
        dog.note_stragglers(turns[i % 2], now=float(i * 5))
    assert [line.split(" on ")[0] for line in said] == ["straggler: rank 0", "straggler: rank 1"]
    dog.note_stragglers(turns[0], now=STRAGGLER_REPEAT_S + 1.0)
    assert len(said) == 3 and said[-1].startswith("straggler: rank 0")
    assert said[-1].endswith("(flagged 4 more time(s) since it was last named)")


def test_find_culprit_in_order_of_certainty() -> None:
    ev = [
        {"rank": 0, "host": "n1", "pid": 1, "state": "sleeping", "in_collective": True},
        {"rank": 1, "host": "n2", "pid": 2, "state": "stopped", "in_collective": False},
    ]
    assert find_culprit(ev, {}) == (1, "n2", "its process is stopped (pid 2)")
    ev[1]["state"] = "running"
    assert find_culprit(ev, {}) == (1, "n2", "the only rank not inside a collective")
    hbs = {
        0: {"step": 8, "phase": "backward", "host": "n1"},
        1: {"step": 8, "phase": "backward", "host": "n1"},
        2: {"step": 7, "phase": "forward", "host": "n3"},
    }
    assert find_culprit([], hbs) == (
        2,
        "n3",
        "at step 7 phase forward while the others are at step 8 phase backward",
    )
    three = [*ev, {"rank": 2, "host": "n3", "pid": 3, "state": "sleeping", "in_collective": True}]
    three[1]["in_collective"] = True
    assert find_culprit(three[:2], {}, world_size=3) == (2, "?", "no training process for it on its node")
    assert find_culprit(three, {}) is None  # everyone waits: no single rank differs


def test_hang_timeout_reaches_the_batch_step_and_bad_values_are_refused(tmp_path: Path) -> None:
    import os

    from tests.helpers.cli import run_cli

    env = {
        **os.environ,
        "ORCHESTRATOR_HOME": str(tmp_path / "home"),
        "ORCHESTRATOR_RUNS": str(tmp_path / "runs"),
    }
    res = run_cli(["render", "--profile", "slurm_test", "--hang-timeout", "45", "--", "train/train.py"], env)
    assert (
        res.returncode == 0
        and "orchestrator.schedulers.slurm.batch_step --attempt-base 0 --hang-timeout 45 --" in res.stdout
    )
    res = run_cli(["render", "--profile", "slurm_test", "--", "train/train.py"], env)
    assert res.returncode == 0 and "--hang-timeout" not in res.stdout  # derived from step times
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--hang-timeout", "0", "--dry-run", "--", "train/train.py"], env
    )
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "orchestrator submit: error: --hang-timeout: expected seconds from 1 to 86400, got 0"
    ], res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
