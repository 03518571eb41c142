"""A node's wait for the batch step's word after its ranks failed (orchestrator/node/restart_in_place.py).
The whole path runs on the cluster: tests/cluster/test_restart_in_allocation.py."""

from __future__ import annotations

import threading
from pathlib import Path

from orchestrator.contract.in_place import next_attempt_file
from orchestrator.contract.run_dir import node_log_file, write_json_atomic
from orchestrator.node.restart_in_place import wait_for_next_attempt


def test_the_word_arriving_later_names_the_attempt(tmp_path: Path) -> None:
    word = threading.Timer(0.3, write_json_atomic, (next_attempt_file(tmp_path), {"attempt": 5}))
    word.start()
    try:
        assert wait_for_next_attempt(tmp_path, 1, [], wait_s=30) == 5
    finally:
        word.cancel()


def test_an_end_says_why_in_the_node_log(tmp_path: Path) -> None:
    write_json_atomic(next_attempt_file(tmp_path), {"attempt": None, "why": "the job received SIGTERM"})
    assert wait_for_next_attempt(tmp_path, 1, [], wait_s=30) is None
    assert node_log_file(tmp_path, 1).read_text() == (
        "[orchestrator node] not restarted in place: the job received SIGTERM\n"
    )


def test_a_stop_signal_or_no_word_ends_the_wait(tmp_path: Path) -> None:
    signals: list[int] = []
    threading.Timer(0.2, signals.append, (15,)).start()
    assert wait_for_next_attempt(tmp_path, 0, signals, wait_s=30) is None
    assert wait_for_next_attempt(tmp_path, 1, [], wait_s=0.3) is None
    assert "a stop signal came" in node_log_file(tmp_path, 0).read_text()
    assert "no word from the batch step within 0 s" in node_log_file(tmp_path, 1).read_text()
