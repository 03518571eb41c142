"""Where a node keeps its ranks' memory checkpoints, how their files are named, and which node
holds a copy of which rank's.

A memory checkpoint is one rank's training state (its shard of the model and optimizer, the
scheduler, the loop's position, the RNG states) written to node-local memory (``/dev/shm``) every
few steps by :mod:`orchestrator.rank.memory_checkpoints`. A restart in place (the same task, the same
launcher, the same ranks on the same node) resumes from the newest step every rank still holds,
usually a few steps back, where the shared checkpoint may be hundreds of steps back.

A node can be lost, and its memory with it. So where a job has more than one node, every rank also
sends its file to the rank of the same local rank on the node half the job's nodes away
(:func:`replica_peer`), which keeps it in its node's folder under the owner's name. A node folder is named by the node (its host on
Slurm), not by its place in the step: after a spare took a lost node's place, the survivors find their
folders again although their node ranks moved, and the restore sends every rank the file of its rank
from whichever node holds it (:func:`transfers`). A requeue or a new job, another world size or a
shrink finds no common memory checkpoint and resumes from the shared checkpoint as before.

The node entry names the folder (:func:`node_memory_ckpt_dir`, passed to every rank as
``ORCHESTRATOR_MEMORY_CKPT_DIR``, ``contract.env``); the ranks write and read inside it. Standard
library only.
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
_KEY = re.compile(r"^[A-Za-z0-9._-]+$")


def memory_ckpt_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    chosen = env.get(MEMORY_CKPT_ROOT_ENV)
    if chosen:
        return Path(chosen)
    if os.path.isdir(DEFAULT_MEMORY_CKPT_ROOT) and os.access(DEFAULT_MEMORY_CKPT_ROOT, os.W_OK):
        return Path(DEFAULT_MEMORY_CKPT_ROOT)
    import tempfile

    return Path(tempfile.gettempdir())


def job_memory_ckpt_prefix(run_dir: Path, job_id: str) -> str:
    """The start of the name of every node folder of ``job_id`` in this run (:func:`node_memory_ckpt_dir`)."""
    run = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"{run}-{job_id}-"


def node_memory_ckpt_dir(root: Path, run_dir: Path, job_id: str, node_key: str) -> Path:
    """This node's folder for ``job_id``'s ranks: one per user, run, job and node. ``node_key`` names
    the node for as long as its memory lives (``NodeEnvironment.memory_key``: on Slurm the allocation
    and the host, so that a later step of the allocation finds it wherever the node now stands; a
    local job's simulated nodes share a machine, so there their index)."""
    if not _KEY.match(node_key):
        raise ValueError(f"a node's memory key must be letters, digits, '.', '_' or '-': {node_key!r}")
    return user_memory_ckpt_dir(root) / f"{job_memory_ckpt_prefix(run_dir, job_id)}{node_key}"


def user_memory_ckpt_dir(root: Path) -> Path:
    """This user's folder under the root: every node folder of the user's jobs on the node."""
    return Path(root) / f"orchestrator-{os.getuid()}"


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


def memory_ckpt_holdings(folder: Path, world_size: int) -> dict[int, list[int]]:
    """Every complete memory checkpoint in a node folder at this world size, its own ranks' and the
    copies it keeps of other nodes' ranks: owner rank -> steps, newest first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    held: dict[int, list[int]] = {}
    for name in names:
        match = _NAME.match(name)
        if match and int(match[1]) == world_size:
            held.setdefault(int(match[2]), []).append(int(match[3]))
    return {owner: sorted(steps, reverse=True) for owner, steps in held.items()}


def replica_peer(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank that keeps a copy of ``rank``'s memory checkpoints: the same local rank on the node half
    the job's nodes away (ranks are numbered node by node; with two or three nodes, the next one), so
    that no node's loss takes a rank's only copy. Half-way, not next door: Slurm orders a step's nodes
    by name, and neighbours by name tend to share a rack, a switch, a power feed. Next door, two
    neighbours lost together took a rank's file and its copy, and the job went back to its shared
    checkpoint; half-way, any run of up to half the job's nodes can go at once. Of two nodes lost
    at random, with an even number N of nodes, 1 pair in N-1 loses a file half-way, 2 in N-1 next
    door. None on one node."""
    if local_world_size <= 0 or world_size <= local_world_size or world_size % local_world_size:
        return None
    return (rank + _replica_jump(world_size, local_world_size)) % world_size


def replica_owner(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank whose memory checkpoints ``rank`` keeps a copy of (:func:`replica_peer`'s inverse)."""
    if replica_peer(rank, world_size, local_world_size) is None:
        return None
    return (rank - _replica_jump(world_size, local_world_size)) % world_size


def _replica_jump(world_size: int, local_world_size: int) -> int:
    """Ranks between a rank and its copy's keeper: half the nodes' worth, rounded down."""
    return (world_size // local_world_size) // 2 * local_world_size


def newest_step_held(holdings_by_rank: list[dict[int, list[int]]], world_size: int) -> int | None:
    """The newest step whose memory checkpoint every rank's file exists of somewhere: each entry is
    what one rank's node folder holds (:func:`memory_ckpt_holdings`)."""
    found: dict[int, set[int]] = {}
    for holdings in holdings_by_rank:
        for owner, steps in holdings.items():
            found.setdefault(int(owner), set()).update(steps)
    if any(owner not in found for owner in range(world_size)):
        return None
    common = set.intersection(*(found[owner] for owner in range(world_size)))
    return max(common) if common else None


def transfers(holdings_by_rank: list[dict[int, list[int]]], step: int) -> list[tuple[int, int]]:
    """(sender, receiver) for every rank whose node folder lacks its own file of ``step``: the sender is
    the first rank whose node folder holds it. Every rank computes the same list from the same
    gathered holdings, so every send meets its receive."""
    moves = []
    for rank, holdings in enumerate(holdings_by_rank):
        if step in holdings.get(rank, []):
            continue
        sender = next((r for r, h in enumerate(holdings_by_rank) if step in h.get(rank, [])), None)
        if sender is not None:
            moves.append((sender, rank))
    return moves


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
