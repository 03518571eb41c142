"""Memory checkpoints: each rank's training state in node-local memory every few steps, so that a
restart in place loses a step or two instead of everything since the last shared checkpoint.

Why: a restart inside the allocation comes back in a second or two (the kept launcher forks the
ranks again), but it resumed from the newest checkpoint on the shared file system, and a job that
checkpoints every 500 steps re-trained 250 of them on average: the fault's real cost. Shared
checkpoints are expensive (every rank's shard over the network, fsyncs, digests); a copy into
``/dev/shm`` is not. NVIDIA's resiliency extension keeps such "local checkpoints" for its in-job
restarts, and torchft recovers from a live peer's memory; here the node's memory outlives the ranks
because the node's task and launcher do (:mod:`orchestrator.node.restart_in_place`).

What a memory checkpoint holds is what ``accelerator.save_state`` restores: for every prepared model
its parameters and buffers (this rank's local part: an FSDP shard, a DDP replica), for every prepared
optimizer its per-parameter state and its groups' hyperparameters, every prepared scheduler and
every object registered with ``register_for_checkpointing`` (``state_dict``), the gradient scaler,
``accelerator.step`` and the RNG states (Python, NumPy, torch, CUDA). It is written by this rank
alone: the tensors as they lie in memory, in parameter order, through ``torch.save`` into a temp
name and renamed (a rank killed mid-write leaves none of that step). On more than one node the file
then goes to another node too (:mod:`.memory_replicas`), so a lost node's state is not lost with it.

Restoring is collective: every rank lists its memory checkpoints, the ranks take the newest step all
of them hold (:func:`orchestrator.contract.memory_checkpoints.newest_common_step`; on more nodes, held
on some node, and fetched from there: :mod:`.memory_replicas`), and that step is
used only where it is as new as the shared checkpoint chosen anyway or newer; each rank reads its file,
checks it against the live objects (counts, shapes, dtypes) and tells the others; only when every
rank's fits does each copy its tensors back into the live parameters and optimizer state. One that
does not (a file that cannot be read) leaves every rank as it was, and they resume from the shared
checkpoint: a rank restored alone would train from another state than its peers. The files are
pickles, so they are read only from a folder of this user's alone (:func:`private_folder`).

DDP keeps one copy per node: its ranks hold the same parameters and optimizer state (the gradients
are all-reduced before every step), so only the node's first rank writes them, and every other rank's
file holds its own buffers, RNG states and the rest, and names the rank whose file has the tensors
(:func:`_replica_source`). DeepSpeed is left out: its engine keeps the state in partitions of its
own, which its own checkpoint code reads and writes.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from orchestrator.contract.env import MEMORY_CKPT_DIR_ENV
from orchestrator.contract.memory_checkpoints import (
    AUTO,
    AUTO_MEMORY_CKPT_OVERHEAD,
    AUTO_MEMORY_CKPT_PROBE_STEP,
    KEEP_MEMORY_CKPTS,
    auto_memory_ckpt_every,
    memory_ckpt_file,
    memory_ckpt_holdings,
    memory_ckpt_steps,
    newest_common_step,
    newest_step_held,
)
from orchestrator.rank.memory_replicas import ReplicaLink, private_folder, remove_torn_files

#: What the file says it is; a file of another layout is not read (2: a DDP rank's may name the file
#: that holds its parameters).
FORMAT = 2


def why_not_supported(accelerator: Any) -> str | None:
    """None where this rank's state can be checkpointed in memory, else why not (said once, at start)."""
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", ""))
    if kind == "DEEPSPEED":
        return "DeepSpeed keeps its state in its own partitions: no memory checkpoints"
    if not os.environ.get(MEMORY_CKPT_DIR_ENV):
        return f"no {MEMORY_CKPT_DIR_ENV}: memory checkpoints are taken only inside a job"
    return None


@dataclass
class MemoryCheckpoints:
    """One per training loop: when :meth:`due` (called once per optimizer step), :meth:`save`; at
    start, :meth:`restore`.

    ``every``: steps between memory checkpoints, or ``"auto"``: the attempt's
    :data:`~orchestrator.contract.memory_checkpoints.AUTO_MEMORY_CKPT_PROBE_STEP`-th step saves one and
    times it against the steps before it, every rank's slowest of each counts (a collective in that
    save), and the interval becomes
    :func:`~orchestrator.contract.memory_checkpoints.auto_memory_ckpt_every` of them, said on rank
    0's stdout. Nobody knows a save's cost before it is measured: a shard's bytes, the memory's
    speed and the step's time differ by model, node and strategy by orders of magnitude.
    ``shared_every``: the loop's shared checkpoint interval (0: none), which ``auto`` aligns to."""

    accelerator: Any
    every: int | Literal["auto"]
    shared_every: int = 0
    folder: Path = field(default_factory=lambda: Path(os.environ.get(MEMORY_CKPT_DIR_ENV, "")))
    last_seconds: float = 0.0
    """How long the newest save blocked training."""
    _step_times: list[float] = field(default_factory=list)
    """``auto``, until it has decided: when :meth:`due` was called at each step of the attempt."""
    measured: tuple[float | None, float] | None = None
    """``auto``, once decided: the slowest rank's save (None: every rank's failed) and step, seconds."""
    link: ReplicaLink | None = None
    """Where the job has more than one node: copies on another node (:mod:`.memory_replicas`)."""
    broken: bool = False
    """This rank's save failed: it writes no more, but keeps sending (nothing) on the schedule."""
    _holdings: list[dict[int, list[int]]] | None = None

    def __post_init__(self) -> None:
        remove_torn_files(self.folder)
        if int(self.accelerator.num_processes) > 1:
            self.link = ReplicaLink.between_nodes(self.accelerator, self.folder)

    @property
    def rank(self) -> int:
        return int(self.accelerator.process_index)

    @property
    def world(self) -> int:
        return int(self.accelerator.num_processes)

    @cached_property
    def replica_source(self) -> int | None:
        """:func:`_replica_source`, once: the prepared objects do not change while training."""
        return _replica_source(self.accelerator)

    @property
    def measuring(self) -> bool:
        return self.every == AUTO

    def due(self, step: int) -> bool:
        if self.measuring:
            self._step_times.append(time.monotonic())
            return len(self._step_times) == AUTO_MEMORY_CKPT_PROBE_STEP
        return isinstance(self.every, int) and self.every > 0 and step % self.every == 0

    def worth_saying(self, step: int) -> bool:
        """The first memory checkpoint and every tenth, for a log line of their cost."""
        every = self.every if isinstance(self.every, int) else 0
        return every > 0 and (step == every or step % (10 * every) == 0)

    # ------------------------------------------------------------------ saving
    def save(self, step: int) -> float:
        """This rank's state of ``step`` into its file, then its copy to another node started (:attr:`link`);
        returns the seconds training waited. Older ones past :data:`KEEP_MEMORY_CKPTS` are removed. A save
        that fails (memory full, a folder not this user's alone) turns them off for this rank, said on
        stderr; training goes on (with a link the rank still takes part in every copy, sending nothing)."""
        measuring = self.measuring
        started = time.monotonic()
        written = None if self.broken else self._write(step)
        if self.link is not None:
            self.link.exchange(step, written)
        seconds = time.monotonic() - started if written is not None else 0.0
        if written is not None:
            self.last_seconds = seconds
        if measuring:
            self._decide(None if written is None else seconds)
        return seconds

    def _decide(self, save_s: float | None) -> None:
        """Collective (``auto``): the interval from every rank's save and step times, the slowest of
        each (a step waits for the slowest rank). A rank whose save failed stays off."""
        import statistics

        ticks = self._step_times
        step_s = statistics.median(b - a for a, b in zip(ticks, ticks[1:], strict=False))
        answers = _gathered(self.accelerator, (save_s, step_s))
        slowest_save = max((a[0] for a in answers if a[0] is not None), default=None)
        slowest_step = max(a[1] for a in answers)
        self.measured = (slowest_save, slowest_step)
        chosen = 0
        if slowest_save is not None:
            chosen = auto_memory_ckpt_every(slowest_save, slowest_step, self.shared_every)
        if self.link is not None or not self.broken:  # a rank alone stays off after its failed save
            self.every = chosen
        if self.rank == 0:
            cost = f"a save {slowest_save or 0.0:.3f}s, a step {slowest_step:.3f}s"
            if chosen and slowest_save is not None:
                share = slowest_save / (chosen * slowest_step) * 100 if slowest_step > 0 else 0.0
                said = f"every {chosen} steps ({cost}: {share:.1f} % of training time)"
            else:
                limit = f"{AUTO_MEMORY_CKPT_OVERHEAD:.0%}"
                said = f"none ({cost}: under {limit} only as rarely as the shared checkpoint)"
            print(f"[orchestrator] memory checkpoints, auto: {said}", flush=True)
        self._step_times = []

    def _write(self, step: int) -> Path | None:
        """This rank's file of ``step`` (None: the save failed, and they are off for this rank)."""
        import torch

        from orchestrator.rank.checkpoint_io import without_zip_crc32

        final = memory_ckpt_file(self.folder, self.world, self.rank, step)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            unsafe = private_folder(self.folder)
            if unsafe:
                raise OSError(unsafe)
            with without_zip_crc32():
                torch.save(_state_of(self.accelerator, step, self.world, self.replica_source), tmp)
            os.replace(tmp, final)
        except OSError as exc:
            print(
                f"[orchestrator] memory checkpoints off on rank {self.rank}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            self.broken = True
            if self.link is None:  # alone on its node's schedule: nothing to keep in step with
                self.every = 0
            return None
        finally:
            tmp.unlink(missing_ok=True)
        for old in memory_ckpt_steps(self.folder, self.world, self.rank)[KEEP_MEMORY_CKPTS:]:
            memory_ckpt_file(self.folder, self.world, self.rank, old).unlink(missing_ok=True)
        return final

    # ------------------------------------------------------------------ restoring
    def common_step(self) -> int | None:
        """Collective: the newest step every rank holds a memory checkpoint of, or None. With copies on
        other nodes (:attr:`link`), the newest step every rank's file exists of on some node: a rank
        whose node lacks it gets it in :meth:`restore`."""
        if self.link is not None:
            self._holdings = _gathered(self.accelerator, memory_ckpt_holdings(self.folder, self.world))
            return newest_step_held(self._holdings, self.world)
        mine = memory_ckpt_steps(self.folder, self.world, self.rank)
        source = self.replica_source
        if source is not None:  # a step counts only with the file that holds its tensors
            mine = [s for s in mine if memory_ckpt_file(self.folder, self.world, source, s).is_file()]
        return newest_common_step(_gathered(self.accelerator, mine))

    def restore(self, step: int) -> str | None:
        """Collective: every rank restores its memory checkpoint of ``step``. None when all did, else why not
        (the first failing rank's words), and then no rank changed anything: each reads and checks
        its memory checkpoint first, and writes into the live state only once every rank's fits."""
        why: str | None = None
        state: dict[str, Any] = {}
        if self.link is not None and self._holdings is not None:
            self.link.fetch(self._holdings, step)  # collective: every rank, before any may fail
        try:
            import torch

            path = memory_ckpt_file(self.folder, self.world, self.rank, step)
            why = private_folder(self.folder, create=False)
            if why is None:
                # A pickle, so only from a folder no one else can write to (checked above); mapped,
                # not read: the copy into the live tensors reads it once.
                state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
                why = _with_replica(self.folder, state, step, self.world)
                if why is None:
                    why = _misfit(self.accelerator, state, step, self.world)
        except Exception as exc:  # every rank must answer, or the others wait at the gather forever
            why = f"{type(exc).__name__}: {exc}"
        answers = _gathered(self.accelerator, None if why is None else f"rank {self.rank}: {why}")
        failed = [a for a in answers if a is not None]
        if self.link is not None:
            self.link.tidy()  # every rank has read its file and sent what it had to
        if failed:
            return failed[0]
        _apply(self.accelerator, state)
        return None


def _gathered(accelerator: Any, value: Any) -> list[Any]:
    if accelerator.num_processes <= 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(out, value)
    return out


# ---------------------------------------------------------------------- the state


def _replica_source(accelerator: Any) -> int | None:
    """The rank whose memory checkpoint holds this rank's parameters and optimizer state, where that is
    another rank's: under DDP, the node's first rank (ranks are numbered node by node, as torchrun and
    accelerate number them; a source that is not in this node's folder leaves no common step, and the
    restart resumes from the shared checkpoint). None where this rank writes its own: the node's
    first rank, a sharded or tensor-parallel model (every rank's part differs), a model accelerate
    leaves unwrapped (no trainable parameter), or an optimizer with a parameter of no prepared model
    (its state need not be the same on every rank).

    Accelerate keeps the unwrapped module in ``_models`` (it wraps DDP after), so DDP is known from
    the distributed type as ``prepare_model`` decides it: a ``MULTI_*`` type (FSDP and DeepSpeed have
    their own) without tensor, context or sharded parallelism."""
    local = int(getattr(accelerator, "local_process_index", 0))
    models = list(getattr(accelerator, "_models", []))
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", ""))
    if local <= 0 or not models or not kind.startswith("MULTI_"):
        return None
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and any(
        getattr(config, f"{d}_enabled", False) for d in ("tp", "cp", "sp", "dp_shard")
    ):
        return None
    from torch.distributed.tensor import DTensor

    params = [p for m in models for p in m.parameters()]
    if any(isinstance(p, DTensor) for p in params):
        return None
    if not all(any(p.requires_grad for p in m.parameters()) for m in models):
        return None
    replicated = {id(p) for p in params}
    if any(
        id(p) not in replicated
        for opt in _optimizers(accelerator)
        for g in opt.param_groups
        for p in g["params"]
    ):
        return None
    return int(accelerator.process_index) - local


def _with_replica(folder: Path, state: dict[str, Any], step: int, world: int) -> str | None:
    """Fill a DDP rank's memory checkpoint in with the parameters and optimizer state of the file it
    names (:func:`_replica_source`); None when done or not needed, else why not."""
    import torch

    source = state.get("replica_of")
    if source is None:
        return None
    found = torch.load(
        memory_ckpt_file(folder, world, source, step), map_location="cpu", weights_only=False, mmap=True
    )
    expected = (FORMAT, step, world, source, None)
    got = tuple(found.get(k) for k in ("format", "step", "world_size", "rank", "replica_of"))
    if got != expected or len(found["models"]) != len(state["models"]):
        return f"rank {source}'s memory checkpoint is {got}, expected {expected}"
    if len(found["optimizers"]) != len(state["optimizers"]):
        return f"rank {source}'s memory checkpoint has {len(found['optimizers'])} optimizers"
    for mine, theirs in zip(state["models"], found["models"], strict=True):
        mine["params"] = theirs["params"]
    for mine, theirs in zip(state["optimizers"], found["optimizers"], strict=True):
        mine["state"] = theirs["state"]
    return None


def _local(tensor: Any) -> Any:
    """The part of ``tensor`` this rank holds, on the CPU (an FSDP2 DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    data = tensor.detach()
    if isinstance(data, DTensor):
        data = data.to_local()
    return data.cpu() if data.device.type != "cpu" else data


def _optimizers(accelerator: Any) -> list[Any]:
    return [getattr(o, "optimizer", o) for o in getattr(accelerator, "_optimizers", [])]


def _per_param_state(opt: Any) -> list[dict[str, tuple[Any, ...]]]:
    """The optimizer's state of each parameter, in parameter order: a tensor's local part and device."""
    import torch

    return [
        {
            k: (("tensor", _local(v), str(v.device)) if torch.is_tensor(v) else ("value", v))
            for k, v in opt.state.get(p, {}).items()
        }
        for group in opt.param_groups
        for p in group["params"]
    ]


def _state_of(accelerator: Any, step: int, world: int, replica_of: int | None) -> dict[str, Any]:
    """This rank's state; with ``replica_of``, without the parameters and optimizer state that rank's
    file holds (buffers stay: DDP broadcasts them before a forward, but a step's forward may have
    updated them since)."""
    import numpy as np
    import torch

    models = [
        {
            "params": None if replica_of is not None else [_local(p) for p in m.parameters()],
            "buffers": [_local(b) for b in m.buffers()],
        }
        for m in accelerator._models
    ]
    optimizers = [
        {
            "state": None if replica_of is not None else _per_param_state(opt),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        }
        for opt in _optimizers(accelerator)
    ]
    scaler = getattr(accelerator, "scaler", None)
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "rank": int(accelerator.process_index),
        "replica_of": replica_of,
        "models": models,
        "optimizers": optimizers,
        "schedulers": [s.state_dict() for s in getattr(accelerator, "_schedulers", [])],
        "custom": [o.state_dict() for o in getattr(accelerator, "_custom_objects", [])],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "accelerator_step": int(getattr(accelerator, "step", 0)),
        "rng": rng,
    }


def _apply(accelerator: Any, state: dict[str, Any]) -> None:
    """Everything back into place (a memory checkpoint :func:`_misfit` found fitting)."""
    import numpy as np
    import torch

    with torch.no_grad():
        for model, saved in zip(accelerator._models, state["models"], strict=True):
            for live, data in zip(model.parameters(), saved["params"], strict=True):
                _live_local(live).copy_(data)
            for live, data in zip(model.buffers(), saved["buffers"], strict=True):
                _live_local(live).copy_(data)
        for opt, saved in zip(_optimizers(accelerator), state["optimizers"], strict=True):
            params = [p for g in opt.param_groups for p in g["params"]]
            for p, entry in zip(params, saved["state"], strict=True):
                opt.state[p] = {k: _value_for(p, v) for k, v in entry.items()}
            for group, hyper in zip(opt.param_groups, saved["groups"], strict=True):
                group.update(hyper)
    for sched, sd in zip(getattr(accelerator, "_schedulers", []), state["schedulers"], strict=True):
        sched.load_state_dict(sd)
    for obj, sd in zip(getattr(accelerator, "_custom_objects", []), state["custom"], strict=True):
        obj.load_state_dict(sd)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    accelerator.step = state["accelerator_step"]
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _live_local(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _misfit(accelerator: Any, state: dict[str, Any], step: int, world: int) -> str | None:
    """Why the memory checkpoint does not fit the live objects (counts, shapes, dtypes), or None."""
    expected = (FORMAT, step, world, int(accelerator.process_index))
    found = (state.get("format"), state.get("step"), state.get("world_size"), state.get("rank"))
    if found != expected:
        return f"the memory checkpoint is (format, step, world, rank) {found}, expected {expected}"
    optimizers = _optimizers(accelerator)
    counts = (
        len(accelerator._models),
        len(optimizers),
        len(getattr(accelerator, "_schedulers", [])),
        len(getattr(accelerator, "_custom_objects", [])),
    )
    saved_counts = tuple(len(state[k]) for k in ("models", "optimizers", "schedulers", "custom"))
    if counts != saved_counts:
        return f"(models, optimizers, schedulers, registered objects) {saved_counts} saved, {counts} now"
    for model, saved in zip(accelerator._models, state["models"], strict=True):
        for kind, live in (("params", list(model.parameters())), ("buffers", list(model.buffers()))):
            if len(live) != len(saved[kind]):
                return f"{len(saved[kind])} {kind} saved, the model has {len(live)}"
            for i, (tensor, data) in enumerate(zip(live, saved[kind], strict=True)):
                target = _live_local(tensor)
                if tuple(target.shape) != tuple(data.shape) or target.dtype != data.dtype:
                    return (
                        f"{kind}[{i}]: memory checkpoint {tuple(data.shape)} {data.dtype}, "
                        f"live {tuple(target.shape)} {target.dtype}"
                    )
    for opt, saved in zip(optimizers, state["optimizers"], strict=True):
        params = [p for g in opt.param_groups for p in g["params"]]
        if len(params) != len(saved["state"]) or len(opt.param_groups) != len(saved["groups"]):
            return "the optimizer's parameters or groups differ from the memory checkpoint's"
    return None


def _value_for(param: Any, saved: tuple[Any, ...]) -> Any:
    """An optimizer state value as the optimizer made it: a tensor shaped like the parameter (an
    FSDP2 DTensor with the parameter's placement) or a scalar tensor on its own device."""
    import torch
    from torch.distributed.tensor import DTensor

    if saved[0] == "value":
        return saved[1]
    data, device = saved[1], saved[2]
    if isinstance(param, DTensor) and tuple(data.shape) == tuple(param.to_local().shape) and data.dim() > 0:
        live: Any = torch.zeros_like(param, dtype=data.dtype)  # a DTensor, placed as the parameter
        live.to_local().copy_(data)
        return live
    return data.to(device, copy=True)  # never the mapped file's pages
