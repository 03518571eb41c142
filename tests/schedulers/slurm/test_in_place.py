"""The batch step's stop of a hung attempt in place (orchestrator/schedulers/slurm/in_place.py): its
word to the nodes, then the attempt's end once every node kept its launcher, or None (the step is
then ended the old way). srun here is a real process standing in for the step's srun (``sleep``);
the nodes' answers are the files they write. The whole path runs on the cluster:
tests/cluster/test_restart_in_allocation.py::test_a_hung_rank_is_restarted_in_place_after_its_stacks_are_saved."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from orchestrator.contract.in_place import node_kept_file, stop_ranks_file
from orchestrator.contract.run_dir import attempt_dir, node_exit_file, read_json
from orchestrator.schedulers.slurm.batch_step import StepWatch
from orchestrator.schedulers.slurm.in_place import stop_in_place


def _nodes_answer(path: Path, nodes: tuple[int, ...]) -> threading.Thread:
    """Each node in ``nodes``: once the stop word is there, its mark and then its exit file."""

    def answer() -> None:
        deadline = time.monotonic() + 10
        while not stop_ranks_file(path).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        for node in nodes:
            node_kept_file(path, node).write_text("")
            node_exit_file(path, node).write_text("137")

    thread = threading.Thread(target=answer)
    thread.start()
    return thread


def test_the_hung_attempt_ends_in_place_once_every_node_kept_its_launcher(tmp_path: Path) -> None:
    path = attempt_dir(tmp_path, 2)
    path.mkdir(parents=True)
    watch = StepWatch(["sleep", "30"])
    try:
        nodes = _nodes_answer(path, (0, 1))
        assert stop_in_place(watch, tmp_path, 2, 2, "hang: rank 1 stopped", wait_s=10) == 137
        nodes.join()
        assert read_json(stop_ranks_file(path)) == {"why": "hang: rank 1 stopped"}
        assert watch.proc.poll() is None  # srun (the nodes' tasks) lives on: the restart is in place
    finally:
        watch.proc.kill()
        watch.proc.wait()


def test_a_node_that_does_not_answer_leaves_the_step_to_be_ended(tmp_path: Path) -> None:
    path = attempt_dir(tmp_path, 0)
    path.mkdir(parents=True)
    watch = StepWatch(["sleep", "30"])
    try:
        nodes = _nodes_answer(path, (0,))  # node 1 never keeps its launcher
        started = time.monotonic()
        assert stop_in_place(watch, tmp_path, 0, 2, "hang", wait_s=1.0) is None
        assert time.monotonic() - started < 5
        nodes.join()
    finally:
        watch.proc.kill()
        watch.proc.wait()
    # srun that ends by itself (a node ended its task) ends the wait at once.
    ended = StepWatch(["true"])
    assert stop_in_place(ended, tmp_path, 0, 2, "hang", wait_s=10) is None
