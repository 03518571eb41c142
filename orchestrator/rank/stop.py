"""A stop request that every rank agrees on at a step boundary: the pre-timeout signal (USR2) or TERM.

The node entry relays the scheduler's signal to every rank, but not at the same instant and not
within the same step: a rank that saved on its own timer (Lightning's auto-requeue, submitit's
``Checkpointable``, Transformers' ``enable_jit_checkpoint``) could save step k while its peers are in
step k+1, and a sharded checkpoint of mixed steps restores nothing. So a handler only notes the
signal; at each step boundary one tiny all-reduce (MAX of a flag) tells every rank whether any rank
heard it, and then all of them save the same step and leave with ``EXIT_REQUEUE``.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

#: The signals that ask for a checkpoint and a requeue: Slurm's pre-timeout signal (``--signal``,
#: USR2 by default) and TERM (``scancel``, preemption, the node entry stopping the launch).
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopRequest:
    """Notes a stop signal on this rank; :meth:`agreed` asks every rank."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: never save from a signal handler (the step may be half done).
        self.signum = signum
        rank = os.environ.get("RANK", "?")
        print(f"[rank {rank}] received {signal.Signals(signum).name}", file=sys.stderr, flush=True)

    def agreed(self) -> bool:
        """True on every rank when any rank heard a stop signal (one all-reduce when distributed)."""
        return bool(any_rank(self.signum != 0))


def any_rank(flag: bool) -> bool:
    """Logical OR of ``flag`` over all ranks of the default process group (just ``flag`` without one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def broadcast_from_main(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a pickled object; for small decisions such as which
    checkpoint to restore, so that all ranks restore the same one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
