"""Resume, requeue and live progress for your own Accelerate training loop, in three lines.

::

    from orchestrator.loop import ResumableLoop

    loop = ResumableLoop(accelerator, save_every=100)       # restores the newest complete checkpoint
    for batch in loop.batches(loader, epochs=3):            # continues mid-epoch where it stopped
        ...
        loop.step_done(loss)                                # progress, saves, the agreed stop

The public names; the code runs in the ranks and lives in :mod:`orchestrator.rank.loop`.
"""

from __future__ import annotations

from orchestrator.rank.loop import LoopState, ResumableLoop

__all__ = ["LoopState", "ResumableLoop"]
