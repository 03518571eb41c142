"""The decider's side of a restart in place (orchestrator/contract/in_place.py: Slurm's batch step, a
local job's node 0): when the attempt has ended on every node, and the word it leaves for them. The
whole path runs on the cluster (tests/cluster/test_restart_in_allocation.py) and locally
(tests/schedulers/local/test_restart_in_place.py)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.contract.in_place import ended_in_place, next_attempt_file, node_kept_file, tell_nodes
from orchestrator.contract.run_dir import attempt_dir, node_exit_file


def _ended(run_dir: Path, node: int, code: int, kept: bool = True) -> None:
    path = attempt_dir(run_dir, 3)
    path.mkdir(parents=True, exist_ok=True)
    if kept:
        node_kept_file(path, node).write_text("")
    node_exit_file(path, node).write_text(str(code))


def test_the_attempt_has_ended_in_place_only_once_every_node_kept_its_launcher(tmp_path: Path) -> None:
    assert ended_in_place(tmp_path, 3, 2) == (None, False)
    _ended(tmp_path, 1, 137)
    assert ended_in_place(tmp_path, 3, 2) == (None, True)  # node 0 not yet: the batch step probes later
    _ended(tmp_path, 0, 143)
    assert ended_in_place(tmp_path, 3, 2) == (143, True)
    assert not next_attempt_file(attempt_dir(tmp_path, 3)).exists()  # the decision is the batch step's


def test_a_node_that_ended_its_task_ends_the_wait_of_the_others(tmp_path: Path) -> None:
    """Node 0 requeued the job at a preemption (exit 0, its task ended) while node 1's rank died:
    nothing to restart in place, and node 1 is told so at once, not after its wait's bound."""
    _ended(tmp_path, 1, 137)
    _ended(tmp_path, 0, 0, kept=False)
    assert ended_in_place(tmp_path, 3, 2) == (None, True)
    word = json.loads(next_attempt_file(attempt_dir(tmp_path, 3)).read_text())
    assert word == {"attempt": None, "why": "node 0 ended its task"}


def test_a_kept_mark_without_its_exit_file_is_not_an_end(tmp_path: Path) -> None:
    _ended(tmp_path, 0, 1)
    node_kept_file(attempt_dir(tmp_path, 3), 1).write_text("")  # written first; its exit file not yet
    assert ended_in_place(tmp_path, 3, 2) == (None, True)


def test_the_word_names_the_next_attempt_or_why_not(tmp_path: Path) -> None:
    attempt_dir(tmp_path, 3).mkdir(parents=True)
    tell_nodes(tmp_path, 3, 4)
    assert json.loads(next_attempt_file(attempt_dir(tmp_path, 3)).read_text()) == {"attempt": 4}
    tell_nodes(tmp_path, 3, None, "3 restart(s) reached max_restarts")
    assert json.loads(next_attempt_file(attempt_dir(tmp_path, 3)).read_text()) == {
        "attempt": None,
        "why": "3 restart(s) reached max_restarts",
    }
