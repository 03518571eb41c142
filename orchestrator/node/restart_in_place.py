"""A node's side of a restart in place: the node task and its launcher outlive a failed start of the
ranks, and start them again when the batch step says so.

A restart inside the allocation used to be a new step of the job: every node started a new task, whose
interpreter imported the plan, accelerate and torch again before it could fork a rank (4.3 s of a
5.4 s restart on a quiet machine; 12 s of imports at a load average of 11, bench/results.md). In a
step the batch step marks (:data:`RESTART_IN_PLACE_ENV`), a node whose ranks failed keeps its
launcher, writes ``node_<N>.kept`` and then its exit file, and waits here for the batch step's word
in the attempt's folder (``next_attempt.json``): the number of the next attempt, whose ranks the kept
launcher forks from the imports it already holds; or none, and the task ends as it always did.
torchrun's agent does the same for its workers (it respawns them, it is not started again).

The batch step keeps every decision: it restarts in place only when every node kept its launcher
(a node that lost its launcher, a lost node or a spare's swap go the old way, a new step; after a
hang it first tells every node to end its ranks and keep its launcher, ``stop_ranks.json``).
A local job has no batch step: its node 0 decides by the same rules
(:mod:`orchestrator.schedulers.local.in_allocation`), with ``max_restarts`` as the mark
(``NodeEnvironment.keeps_launchers``).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrator.contract.in_place import next_attempt_file
from orchestrator.contract.memory_checkpoints import (
    memory_ckpt_root,
    node_memory_ckpt_dir,
    user_memory_ckpt_dir,
)
from orchestrator.contract.run_dir import node_log_file
from orchestrator.contract.shared_fs import read_json_listed

#: How long a node with a kept launcher waits for the batch step's word. The batch step answers
#: within a second or two (it asks Slurm whether the job was cancelled, reads the attempt's logs); a
#: batch step that never answers has died, and with it the step.
NEXT_ATTEMPT_WAIT_S = 120.0
#: How often the word is looked for.
NEXT_ATTEMPT_POLL_S = 0.05


def wait_for_next_attempt(
    attempt_path: Path, node: int, stop_signals: Sequence[int], wait_s: float = NEXT_ATTEMPT_WAIT_S
) -> int | None:
    """The attempt the batch step restarts the ranks as, or None (end the task): its word says so,
    a stop signal came (``stop_signals`` grew), or no word came within ``wait_s``; why not is the
    last line of this node's log of the attempt (``orchestrator logs`` shows it)."""
    record = next_attempt_file(attempt_path)
    seen = len(stop_signals)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(stop_signals) == seen:
        data = read_json_listed(record)  # the batch step writes it on another host
        if isinstance(data, dict):
            attempt = data.get("attempt")
            if isinstance(attempt, int):
                return attempt
            _say(attempt_path, node, f"not restarted in place: {data.get('why') or 'the batch step said so'}")
            return None
        time.sleep(NEXT_ATTEMPT_POLL_S)
    why = (
        "a stop signal came"
        if len(stop_signals) != seen
        else f"no word from the batch step within {wait_s:.0f} s"
    )
    _say(attempt_path, node, f"not restarted in place: {why}")
    return None


def _say(attempt_path: Path, node: int, line: str) -> None:
    with open(node_log_file(attempt_path, node), "a", encoding="utf-8") as log:
        log.write(f"[orchestrator node] {line}\n")


def memory_ckpt_folder(run_dir: Path, job_id: str, node_key: str, environ: Mapping[str, str]) -> Path:
    """The folder this node's ranks keep their memory checkpoints in (``contract/memory_checkpoints.py``):
    ``environ`` is the ranks' environment (a profile's ``env`` may choose the root)."""
    return node_memory_ckpt_dir(memory_ckpt_root(dict(environ)), run_dir, job_id, node_key)


def memory_ckpt_user_dir(environ: Mapping[str, str]) -> Path:
    """This user's folder of node folders (``environ``: the ranks' environment, as above)."""
    return user_memory_ckpt_dir(memory_ckpt_root(dict(environ)))


def clear_memory_ckpts(folder: Path) -> None:
    """The node task's memory checkpoints go with it: at its start (a task killed before it could clear them
    left them behind) and at its end (they fill memory, ``/dev/shm``, until the node reboots), but
    where a later task of the allocation may resume from them (``NodeEnvironment.memory_outlives_task``)."""
    shutil.rmtree(folder, ignore_errors=True)
