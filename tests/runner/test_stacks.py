"""``orchestrator stacks`` on a job that may be healthy: one dump catches a healthy job with a rank
still computing while the others wait in the all-reduce, which is no reason to say "rank 1 differs";
only ranks that stay where they were (a second dump alike), or a dead rank, are named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.contract.run_dir import attempt_dir
from orchestrator.runner import stacks as runner_stacks
from orchestrator.supervise import stacks as supervise_stacks
from orchestrator.supervise.stacks import find_culprit, unchanged
from tests.helpers.cli import REPO, job_and_run_dir, job_ended, poll, run_cli

ALLREDUCE = ["wait (torch/distributed/distributed_c10d.py:2501)", "all_reduce (x.py:3)", "step (t.py:9)"]
FORWARD = ["linear (torch/nn/modules/linear.py:125)", "forward (model.py:40)", "step (t.py:7)"]
BACKWARD = ["_engine_run_backward (torch/autograd/graph.py:824)", "backward (t.py:8)", "step (t.py:8)"]


def _rank(rank: int, tail: list[str], state: str = "running") -> dict[str, Any]:
    return {
        "rank": rank,
        "node": rank,
        "host": f"n{rank}",
        "pid": 100 + rank,
        "state": state,
        "in_collective": bool(supervise_stacks.COLLECTIVE_FRAME_RE.search(" ".join(tail))),
        "stack_tail": tail,
    }


class _Local:
    def job_nodes(self, job_id: str) -> list[str]:
        return []

    def on_every_node(self, nodes: list[str], job_id: str | None = None) -> list[str] | None:
        return None


def _dump_stacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dumps: list[list[dict[str, Any]]]
) -> tuple[runner_stacks.Stacks, int]:
    """``dump_stacks`` of a local job whose successive py-spy dumps are ``dumps``."""
    import orchestrator.schedulers

    attempt_dir(tmp_path, 0).mkdir(parents=True)
    calls = []

    def collect_here(run_dir: str, attempt: int, out_dir: Path) -> list[dict[str, Any]]:
        calls.append(attempt)
        return dumps[min(len(calls), len(dumps)) - 1]

    monkeypatch.setattr(supervise_stacks, "collect_here", collect_here)
    monkeypatch.setattr(orchestrator.schedulers, "get_scheduler", lambda name: _Local())
    monkeypatch.setattr(runner_stacks, "CONFIRM_AFTER_S", 0.0)
    return runner_stacks.dump_stacks("local-1", tmp_path, "local"), len(calls)


def test_a_healthy_job_caught_between_collectives_has_no_rank_that_differs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # rank 0 waits in the all-reduce while rank 1 still runs its forward; a moment later both moved.
    first = [_rank(0, ALLREDUCE), _rank(1, FORWARD)]
    second = [_rank(0, BACKWARD), _rank(1, ALLREDUCE)]
    dump, calls = _dump_stacks(monkeypatch, tmp_path, [first, second])
    assert dump.culprit is None and calls == 2
    assert dump.records == second  # what is shown is the dump the answer rests on


def test_a_stuck_rank_outside_the_collective_is_still_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stuck = [_rank(0, ALLREDUCE), _rank(1, FORWARD), _rank(2, ALLREDUCE)]
    dump, calls = _dump_stacks(monkeypatch, tmp_path, [stuck, [dict(r) for r in stuck]])
    assert calls == 2
    assert dump.culprit == (1, "n1", "the only rank not inside a collective")


def test_a_dead_rank_is_named_from_one_dump(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    records = [_rank(0, ALLREDUCE), _rank(1, FORWARD, state="stopped")]
    dump, calls = _dump_stacks(monkeypatch, tmp_path, [records])
    assert calls == 1 and dump.culprit is not None and dump.culprit[0] == 1
    assert "stopped" in dump.culprit[2]


def test_ranks_all_in_step_need_no_second_dump(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    records = [_rank(0, ALLREDUCE), _rank(1, ALLREDUCE)]
    dump, calls = _dump_stacks(monkeypatch, tmp_path, [records])
    assert calls == 1 and dump.culprit is None


def test_the_watchdog_keeps_its_reading_of_one_dump_of_stalled_ranks() -> None:
    records = [_rank(0, ALLREDUCE), _rank(1, FORWARD)]
    assert find_culprit(records, {}) == (1, "n1", "the only rank not inside a collective")
    assert find_culprit(records, {}, stalled=False) is None
    assert unchanged(records, [dict(r) for r in records])
    assert not unchanged(records, [_rank(0, ALLREDUCE), _rank(1, BACKWARD)])
    assert not unchanged([], [])


#: A healthy job whose rank 1 computes each step while rank 0 waits for it in the all-reduce.
UNEVEN = str(REPO / "tests" / "scripts" / "uneven_ranks.py")


@pytest.mark.parametrize("stuck", [False, True], ids=["computing", "stuck"])
def test_a_rank_that_computes_while_the_others_wait_is_not_named_a_stuck_one_is(
    orch_env: dict[str, str], reap_local_jobs: None, stuck: bool
) -> None:
    """Issue 41: ``orchestrator stacks`` of a healthy 2-rank local job said "rank 1 differs": rank 1
    computing (on one line, its frames the same in both dumps) while rank 0 waits in the all-reduce.
    Same frames twice are not a stop: a rank outside the collective that used CPU between the dumps
    is working. A rank that stopped there (``--stuck``: it sleeps) is still named, from real dumps."""
    from orchestrator import api

    res = run_cli(["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "2", "--", UNEVEN,
                   "--work", "30", *(["--stuck"] if stuck else [])], orch_env)  # fmt: skip
    job, run_dir = job_and_run_dir(res.stdout)
    poll(lambda: (run_dir / "ready").exists() or job_ended(orch_env, job), 120, "the first all-reduce")
    dump = api.stacks(job)
    run_cli(["cancel", job], orch_env)
    where = {r["rank"]: r["in_collective"] for r in dump.records}
    assert where == {0: True, 1: False}, dump.records  # rank 0 waits for rank 1, in both cases
    if stuck:
        assert dump.culprit is not None and dump.culprit[0] == 1, dump.records
        assert dump.culprit[2] == "the only rank not inside a collective"
    else:
        assert dump.culprit is None, (dump.culprit, dump.records)
