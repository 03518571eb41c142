"""Resume, requeue and live progress for your own Accelerate training loop, in three lines.

::

    from orchestrator.loop import ResumableLoop

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    loop = ResumableLoop(accelerator, save_every=100)       # 1: restores the newest complete checkpoint
    for batch in loop.batches(loader, epochs=3):            # 2: continues mid-epoch where it stopped
        loss = model(batch).loss
        accelerator.backward(loss)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        loop.step_done(loss)                                # 3: progress, saves, the agreed stop

What the three lines give the loop, the same as ``train/`` has:

* **Resume** from the newest *complete* checkpoint in the run directory: model, optimizer, scheduler,
  RNG states and anything registered with ``accelerator.register_for_checkpointing`` (all through
  ``accelerator.save_state``/``load_state``), plus the position in the data (epoch, batch) and the
  step. Checkpoints are written to a temp folder, marked complete (sizes and digests of every file)
  and renamed into place; a torn or corrupt one is never chosen.
* **The stop request**: on USR2 (Slurm's pre-timeout signal) or TERM, every rank agrees at the next
  optimizer-step boundary (one tiny all-reduce), all save that same step, and the job leaves with
  exit 75 for a requeue. Unlike Lightning's auto-requeue or submitit's ``Checkpointable``, no rank
  saves on its own clock.
* **Progress** into ``metrics.jsonl``: ``status``, ``logs``, ``plot`` and the ETA work.

For an exact resume of a shuffled loader, build the Accelerator with
``DataLoaderConfiguration(use_seedable_sampler=True)``: the order of an epoch is then a function of the
seed and the epoch, which the loop sets (Accelerate's default sampler draws from the global RNG).

Importing this module costs nothing (standard library); torch is used only once a loop is built.
Outside a job (no ``ORCHESTRATOR_RUN_DIR``) checkpoints go to ``run_dir`` (default ``./run``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrator.contract.attempt_start import write_attempt_start
from orchestrator.contract.checkpoints import (
    checkpoints_dir,
    finalize,
    find_resumable,
    prune,
    removed_if_unfinished,
    temp_folder,
)
from orchestrator.contract.env import RUN_DIR_ENV, STRATEGY_ENV
from orchestrator.contract.heartbeat import Heartbeat
from orchestrator.contract.run_dir import (
    EXIT_REQUEUE,
    METRICS_FILE,
    checkpoint_folder_name,
    write_exit_status,
)
from orchestrator.rank.stop import StopRequest, barrier, broadcast_from_main

#: The ``hook`` this module names in start records and checkpoint markers.
HOOK = "accelerate"


@dataclass
class LoopState:
    """Where the loop stands; saved with every checkpoint (``register_for_checkpointing``)."""

    step: int = 0
    """Optimizer steps done (batches that synchronised gradients)."""
    epoch: int = 0
    batch_in_epoch: int = 0
    """Batches of ``epoch`` already trained: a resume skips them."""

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, int(value))


def fix_ddp_buckets(accelerator: Any) -> None:
    """On CPU, give every DDP model its final gradient-bucket layout now, the same in every attempt.

    DDP reduces the first iteration's gradients in its initial buckets, then rebuilds them in the order
    the gradients became ready. An uninterrupted run trains step k > 1 on the rebuilt layout; a resumed
    one trained its first step, k, on the initial layout. With three or more ranks gloo's ring
    all-reduce sums an element in an order that depends on its place in the bucket, so that step
    differed in the last bit and the runs drifted apart by ~1e-7 relative. Rebuilt here, before the
    first step, in parameter order (``_push_all_rebuilt_params``), DDP never rebuilds again, and every
    step of every attempt reduces in one layout. Not on GPUs (there the ready order overlaps
    communication with the backward, and no bit-exactness is claimed)."""
    import gc

    import torch

    if torch.cuda.is_available() or getattr(accelerator, "num_processes", 1) < 3:
        return
    from torch.nn.parallel import DistributedDataParallel

    # Accelerate keeps the unwrapped model of a CPU DDP launch in _models: find the wrappers around them.
    models = {id(m) for m in getattr(accelerator, "_models", [])}
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel) and (id(obj) in models or id(obj.module) in models):
            obj.reducer._push_all_rebuilt_params()
            obj.reducer._rebuild_buckets()


class ResumableLoop:
    """One per training loop, built after ``accelerator.prepare``."""

    def __init__(
        self,
        accelerator: Any,
        *,
        save_every: int = 0,
        max_steps: int | None = None,
        keep_last: int = 2,
        log_every: int = 1,
        run_dir: str | os.PathLike[str] | None = None,
        memory_ckpt_every: int | Literal["auto"] = 0,
    ) -> None:
        """``save_every``: also checkpoint every that many optimizer steps (0: only on a stop request).
        ``max_steps``: end :meth:`batches` after that many steps (and the ETA's denominator).
        ``memory_ckpt_every``: every that many steps, each rank's state into its node's memory
        (:mod:`orchestrator.rank.memory_checkpoints`): a restart in place resumes from there, not from the
        shared checkpoint further back (0: none; ``"auto"``: measured, at most 2 % of training time)."""
        self.accelerator = accelerator
        self.save_every = save_every
        self.memory_ckpts = self._memory_ckpts(memory_ckpt_every)
        self.max_steps = max_steps
        self.keep_last = keep_last
        self.log_every = max(1, log_every)
        self.run_dir = Path(run_dir or os.environ.get(RUN_DIR_ENV) or "run")
        self.state = LoopState()
        self.last_saved_step = -1
        self.resumed_from: Path | None = None
        self._step_started = time.monotonic()
        self._metrics = None
        accelerator.register_for_checkpointing(self.state)
        fix_ddp_buckets(accelerator)
        self.stop = StopRequest().install()
        # Step and phase for the hang watchdog (None outside a job). The loop sees the boundaries of a
        # batch, not its inside: "data" while the next batch is fetched, "forward" while the user's
        # code trains on it, "checkpoint" while saving.
        self.heartbeat = Heartbeat.for_this_rank()
        if accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._restore()

    @property
    def step(self) -> int:
        return self.state.step

    # ------------------------------------------------------------------ resume
    def _restore(self) -> None:
        """As train/ resumes: rank 0 picks the newest complete checkpoint without reading its shard
        files, every rank hashes the shards it will read, all at once (``checked_choice``: a shard that
        does not match the marker's digest marks the checkpoint corrupt and an older one is chosen),
        then every rank loads the same one."""
        from orchestrator.rank.checkpoint_io import checked_choice, load_state

        found: tuple[str, dict[str, Any]] | None = None
        if self.accelerator.is_main_process:
            newest = find_resumable(self.run_dir, self._warn, shards=False)
            found = (str(newest[0]), newest[1]) if newest else None
        found = broadcast_from_main(found)
        if self._restored_from_memory(found[1]["step"] if found else -1):
            return
        checked = checked_choice(self.accelerator, self.run_dir, found, self._warn)
        choice = checked[0] if checked else None
        if choice is not None:
            from orchestrator.rank.workarounds import init_fsdp1_optimizer_state

            for optimizer in getattr(self.accelerator, "_optimizers", []):
                init_fsdp1_optimizer_state(self.accelerator, optimizer)
            load_state(self.accelerator, Path(choice))
            self.resumed_from = Path(choice)
            self.last_saved_step = self.state.step
            self._event({"event": "resume", "step": self.state.step, "checkpoint": choice})
            self._say(f"resumed from {choice}: step {self.state.step}, epoch {self.state.epoch}")
        if self.accelerator.is_main_process:
            write_attempt_start(self.state.step, choice, HOOK, self.run_dir)

    def _memory_ckpts(self, every: int | Literal["auto"]) -> Any:
        if every == 0:
            return None
        from orchestrator.rank.memory_checkpoints import MemoryCheckpoints, why_not_supported

        why = why_not_supported(self.accelerator)
        if why:
            self._say(f"memory_ckpt_every: {why}")
            return None
        return MemoryCheckpoints(self.accelerator, every, shared_every=self.save_every)

    def _restored_from_memory(self, shared_step: int) -> bool:
        """Collective: restores the newest memory checkpoint every rank holds, where it is as new as
        ``shared_step`` or newer; False where there is none or it could not be restored."""
        if self.memory_ckpts is None:
            return False
        step = self.memory_ckpts.common_step()
        if step is None or step < shared_step:
            return False
        failed = self.memory_ckpts.restore(step)
        if failed is not None:
            self._warn(f"the memory checkpoint of step {step} was not restored ({failed})")
            return False
        self.last_saved_step = shared_step
        self._event({"event": "resume", "step": step, "checkpoint": f"memory checkpoint of step {step}"})
        self._say(f"resumed from the memory checkpoint of step {step}, epoch {self.state.epoch}")
        if self.accelerator.is_main_process:
            write_attempt_start(step, None, HOOK, self.run_dir, memory=True)
        return True

    # ------------------------------------------------------------------ the loop
    def batches(self, dataloader: Iterable[Any], epochs: int | None = None) -> Iterator[Any]:
        """The batches still to train: the rest of the current epoch, then whole epochs up to ``epochs``
        (or ``max_steps``). Call :meth:`step_done` once per batch."""
        while (epochs is None or self.state.epoch < epochs) and not self._finished():
            set_epoch = getattr(dataloader, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.state.epoch)
            skip = self.state.batch_in_epoch
            source = self.accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
            self._beat("data")
            for batch in source:
                if self._finished():
                    self._copies_done()
                    return
                self._beat("forward")
                yield batch
                self._beat("data")
            self.state.epoch += 1
            self.state.batch_in_epoch = 0
        self._copies_done()

    def _finished(self) -> bool:
        return self.max_steps is not None and self.state.step >= self.max_steps

    def step_done(self, loss: Any = None, **values: float) -> None:
        """After the batch's optimizer step. With gradient accumulation only batches that synchronised
        gradients count as steps, and only there can the loop save or stop (a save mid-accumulation
        would lose the gradients accumulated so far)."""
        self.state.batch_in_epoch += 1
        if not getattr(self.accelerator, "sync_gradients", True):
            return
        self.state.step += 1
        now = time.monotonic()
        step_time, self._step_started = now - self._step_started, now
        if self._metrics is not None and (self.state.step % self.log_every == 0 or self._finished()):
            record: dict[str, Any] = {"event": "train", "step": self.state.step}
            if self.max_steps is not None:
                record["max_steps"] = self.max_steps
            if loss is not None:
                record["loss"] = float(loss.detach() if hasattr(loss, "detach") else loss)
            record.update({k: float(v) for k, v in values.items()})
            record.update(
                step_time_s=step_time,
                world_size=self.accelerator.num_processes,
                strategy=os.environ.get(STRATEGY_ENV, self.accelerator.distributed_type.value),
            )
            self._event(record)
        if self.stop.agreed():
            self._save()
            self._leave()
        if self.memory_ckpts is not None and self.memory_ckpts.due(self.state.step):
            self._beat("checkpoint")  # before a shared save of the same step, as train/ does
            self.memory_ckpts.save(self.state.step)
            self._beat("data")
        if self.save_every and self.state.step % self.save_every == 0:
            self._save()

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint now (every rank calls it); returns the complete checkpoint's folder."""
        return self._save()

    def _save(self) -> Path:
        step = self.state.step
        root = checkpoints_dir(self.run_dir)
        final = root / checkpoint_folder_name(step)
        if self.last_saved_step == step:
            return final
        started = time.monotonic()
        self._beat("checkpoint")
        if self.accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
        tmp = temp_folder(self.run_dir, step, broadcast_from_main(uuid.uuid4().hex[:8]))
        from orchestrator.rank.checkpoint_io import own_shard_digests, without_zip_crc32

        acc = self.accelerator
        with removed_if_unfinished(tmp):  # a failed save (a full disk) gives its room back
            with without_zip_crc32():
                acc.save_state(str(tmp))
            barrier()
            digests = own_shard_digests(tmp, acc.process_index, acc.num_processes)
            if acc.is_main_process:
                marker = {
                    "step": step,
                    "time": time.time(),
                    "world_size": acc.num_processes,
                    "strategy": os.environ.get(STRATEGY_ENV),
                    "hook": HOOK,
                }
                finalize(tmp, final, marker, digests)
        if acc.is_main_process:
            prune(self.run_dir, self.keep_last)
        barrier()
        self.last_saved_step = step
        self._beat("data")  # leave the checkpoint allowance at once
        self._say(f"checkpoint step {step} complete ({time.monotonic() - started:.2f}s): {final}")
        return final

    def _leave(self) -> None:
        """Every rank saved the agreed step: say so, then exit for a requeue."""
        if self.accelerator.is_main_process:
            write_exit_status(self.run_dir, EXIT_REQUEUE, "signal", step=self.state.step)
            self._say(f"requeue: checkpoint step {self.state.step} saved")
        if self._metrics is not None:
            self._metrics.close()
        self._copies_done()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        raise SystemExit(EXIT_REQUEUE)

    def _copies_done(self) -> None:
        """Until the newest memory checkpoint's copy to another node has landed: a rank that left
        mid-copy would cut its peer's copy off (said on its stderr as a failure)."""
        link = self.memory_ckpts.link if self.memory_ckpts is not None else None
        if link is not None:
            link.wait()

    # ------------------------------------------------------------------ output
    def _beat(self, phase: str) -> None:
        if self.heartbeat is not None:
            # The step being worked on: the next one, except while saving the one just done.
            self.heartbeat.beat(self.state.step + (phase != "checkpoint"), phase)

    def _event(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps({**record, "time": time.time()}) + "\n")
            self._metrics.flush()

    def _say(self, line: str) -> None:
        if self.accelerator.is_main_process:
            print(f"[orchestrator.loop] {line}", flush=True)

    def _warn(self, line: str) -> None:
        print(f"[orchestrator.loop] {line}", file=sys.stderr, flush=True)
