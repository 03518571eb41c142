"""Where a node keeps its ranks' memory checkpoints, and how their files are named.

A memory checkpoint is one rank's training state (its shard of the model and optimizer, the
scheduler, the loop's position, the RNG states) written to node-local memory (``/dev/shm``) every
few steps by :mod:`orchestrator.rank.memory_checkpoints`. It lives as long as the node's task: a
restart in place (the same task, the same launcher, the same ranks on the same node) resumes from
the newest step every rank still holds, usually a few steps back, where the shared checkpoint may
be hundreds of steps back. Anything else (a new step, a spare's node, a requeue, another world
size) finds no common memory checkpoint and resumes from the shared checkpoint as before.

The node entry names the folder (:func:`node_memory_ckpt_dir`, passed to every rank as
``ORCHESTRATOR_MEMORY_CKPT_DIR``, ``contract.env``) and removes it when its task ends; the ranks
write and read inside it. Standard library only.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path
from typing import Literal

from orchestrator.contract.env import MEMORY_CKPT_ROOT_ENV

#: Memory, not a disk: a memory checkpoint costs a copy, and nothing survives the node's reboot anyway.
DEFAULT_MEMORY_CKPT_ROOT = "/dev/shm"
#: Memory checkpoints a rank keeps: the newest and the one before it. Ranks are at most one apart (a
#: rank cannot start the step after one before its peers finished theirs: the step's collectives
#: wait for them), so with two kept every rank holds the older of the two newest.
KEEP_MEMORY_CKPTS = 2

#: ``--memory-ckpt-every auto`` / ``memory_ckpt_every="auto"``: the interval is measured, not guessed.
AUTO: Literal["auto"] = "auto"
#: The share of training time ``auto`` lets memory checkpoints take, at most.
AUTO_MEMORY_CKPT_OVERHEAD = 0.02
#: ``auto`` saves once at this step of an attempt (counted from its first step: the ones before warm
#: up kernels, allocator and caches) and measures that save against the steps before it.
AUTO_MEMORY_CKPT_PROBE_STEP = 5

_NAME = re.compile(r"^w(\d+)-r(\d+)-s(\d+)\.pt$")


def memory_ckpt_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    chosen = env.get(MEMORY_CKPT_ROOT_ENV)
    if chosen:
        return Path(chosen)
    if os.path.isdir(DEFAULT_MEMORY_CKPT_ROOT) and os.access(DEFAULT_MEMORY_CKPT_ROOT, os.W_OK):
        return Path(DEFAULT_MEMORY_CKPT_ROOT)
    import tempfile

    return Path(tempfile.gettempdir())


def node_memory_ckpt_dir(root: Path, run_dir: Path, job_id: str, node_rank: int) -> Path:
    """This node's folder for ``job_id``'s ranks: one per user, run, job and node (a local job's
    simulated nodes share a machine; a requeued job is another allocation and starts empty)."""
    run = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return Path(root) / f"orchestrator-{os.getuid()}" / f"{run}-{job_id}-node{node_rank}"


def memory_ckpt_file(folder: Path, world_size: int, rank: int, step: int) -> Path:
    return Path(folder) / f"w{world_size}-r{rank}-s{step:08d}.pt"


def memory_ckpt_steps(folder: Path, world_size: int, rank: int) -> list[int]:
    """The complete memory checkpoints of this rank at this world size, newest first (a file being written
    has a temp name, so every name here is a whole memory checkpoint)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    steps = []
    for name in names:
        match = _NAME.match(name)
        if match and int(match[1]) == world_size and int(match[2]) == rank:
            steps.append(int(match[3]))
    return sorted(steps, reverse=True)


def newest_common_step(steps_by_rank: list[list[int]]) -> int | None:
    """The newest step every rank holds a memory checkpoint of, or None."""
    if not steps_by_rank:
        return None
    common = set(steps_by_rank[0]).intersection(*map(set, steps_by_rank[1:]))
    return max(common) if common else None


def parse_memory_ckpt_every(text: str) -> int | Literal["auto"]:
    """``auto`` or a whole number of steps (0: none), as argparse's ``type=``: anything else is an
    ``ArgumentTypeError`` whose words argparse prints after the option's name."""
    import argparse

    if text.strip().lower() == AUTO:
        return AUTO
    try:
        every = int(text)
    except ValueError:
        every = -1
    if every < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of steps (0: none) or auto")
    return every


def auto_memory_ckpt_every(
    save_s: float, step_s: float, shared_every: int, overhead: float = AUTO_MEMORY_CKPT_OVERHEAD
) -> int:
    """The interval ``auto`` takes: the fewest steps between memory checkpoints whose saves cost at most
    ``overhead`` of training time, raised to a divisor of ``shared_every`` where one lies below it (a
    shared checkpoint's step then has a memory checkpoint too, taken first, so a restart in place never
    goes back further than the shared checkpoint); 0 (none) where only the shared interval or a longer
    one would do: a memory checkpoint that rare spares less than the shared one already does."""
    need = max(1, math.ceil(save_s / (overhead * step_s))) if step_s > 0 else 1
    if shared_every <= 0:
        return need
    if need >= shared_every:
        return 0
    return next((n for n in range(need, shared_every) if shared_every % n == 0), need)
