"""Checkpoints: ``accelerator.save_state`` (sharded DCP state dicts) behind an atomic marker protocol.

Layout (a contract with the monitoring code)::

    <run_dir>/checkpoints/step_<8-digit step>/          complete, with COMPLETE.json
    <run_dir>/checkpoints/.tmp-step_<8d>-<id>/          being written (or torn: never read)

Protocol: every rank writes into the temp folder, barrier; rank 0 fsyncs the
files, writes ``COMPLETE.json`` ``{"step", "world_size", "strategy",
"fsdp_version", "files": {relpath: size_bytes}, "param_checksum",
"optim_checksum", ...}`` (fsync), renames the folder into place (atomic) and
fsyncs the parent; barrier. Resume takes the newest ``step_*`` folder whose
marker parses and whose listed files all exist with their sizes; others are
skipped with a warning.

Inside a checkpoint (Accelerate's own layout): ``pytorch_model_fsdp_0/`` and
``optimizer_0/`` (DCP: ``.metadata`` + ``__<rank>_0.distcp``) for FSDP, or
``model.safetensors`` + ``optimizer.bin`` for DDP; ``random_states_<rank>.pkl``;
``custom_checkpoint_0.pkl`` (LR scheduler), ``custom_checkpoint_1.pkl``
(``TrainState``: step, data position, ...).

``--async-ckpt`` writes the same files from a writer thread per rank (FSDP: DCP ``save`` of a
staged copy on a gloo process group of its own, so its collectives never interleave with
training's; DDP: rank 0 only); rank 0's thread computes the checksums, writes the marker and
renames the folder once the save has completed on every rank (see ``AsyncCheckpointer``).
"""

from __future__ import annotations

import copy
import os
import random
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from orchestrator.contract.checkpoints import (
    discard_failed_save,
    finalize,
    prune,
    removed_if_unfinished,
    temp_folder,
)
from orchestrator.contract.run_dir import (
    COMPLETE_MARKER,
    check_checkpoint,
    checkpoint_folder_name,
    checkpoint_folders,
)
from orchestrator.rank.checkpoint_io import load_state, own_shard_digests, without_zip_crc32
from orchestrator.rank.shard_plan import write_load_plan

if TYPE_CHECKING:
    from accelerate import Accelerator

MARKER = COMPLETE_MARKER
CHECKPOINTS = "checkpoints"


def step_name(step: int) -> str:
    return checkpoint_folder_name(step)


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


@dataclass
class TrainState:
    """Training progress saved with every checkpoint (registered with ``register_for_checkpointing``)."""

    step: int = 0
    samples_seen: int = 0
    """The data position: training samples consumed by all ranks together (see data.py)."""
    world_size: int = 1
    strategy: str = "ddp"
    fsdp_version: int | None = None
    seed: int = 0
    data: str = "synthetic"
    preset: str = "tiny"
    last_loss: float | None = None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)


# ---------------------------------------------------------------------------
# Files and the marker


def validate(folder: Path) -> tuple[dict | None, str]:
    """(marker, "") for a complete checkpoint, else (None, why not): the run directory's one rule,
    shared with ``status`` and ``resume``."""
    return check_checkpoint(folder)


def step_folders(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step_*`` folder present, newest first, not yet validated (the
    complete one to resume from: ``run_dir.last_complete_checkpoint``)."""
    return checkpoint_folders(Path(run_dir))


def _common_id(accelerator: Accelerator) -> str:
    """One id for the temp folder, the same on every rank (rank 0 picks it)."""
    value = [uuid.uuid4().hex[:8] if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        dist.broadcast_object_list(value, src=0)
    common = value[0]
    assert common is not None  # rank 0 picked it; the broadcast gave it to every other rank
    return common


# ---------------------------------------------------------------------------
# Saving


@dataclass
class SaveResult:
    step: int
    path: Path
    seconds: float
    marker: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)


def save(
    accelerator: Accelerator, run_dir: str | os.PathLike, step: int, marker: dict, keep_last: int
) -> SaveResult:
    """Synchronous save by every rank; returns when the checkpoint is complete and in place."""
    started = time.monotonic()
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(run_dir, step, _common_id(accelerator))
    final = root / step_name(step)
    with removed_if_unfinished(tmp):  # a failed save (a full disk) gives its room back
        with without_zip_crc32():
            accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        wrote = time.monotonic()
        digests = own_shard_digests(tmp, accelerator.process_index, accelerator.num_processes)
        written = {}
        if accelerator.is_main_process:
            written = finalize(
                tmp, final, {"step": step, "time": time.time(), "async": False, **marker}, digests
            )
    if accelerator.is_main_process:
        prune(run_dir, keep_last)
    accelerator.wait_for_everyone()
    done = time.monotonic()
    # Where a save's time goes (bench/bench_ckpt_load.py reports it): every rank's shards written,
    # then rank 0's fsyncs + digests + marker + rename.
    return SaveResult(
        step, final, done - started, written, {"write": wrote - started, "finalize": done - wrote}
    )


def _rng_states(step: int) -> dict:
    import numpy as np

    states = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


class AsyncCheckpointer:
    """``--async-ckpt``: one save in flight at a time; same files and marker protocol as ``save``.

    The training thread only stages (copies this rank's shards, ~0.1 s for the ``small`` preset) and
    writes the tiny per-rank files; one background thread per rank then writes the shards (DCP
    ``save`` on a gloo group of its own, so its collectives never interleave with training's) and,
    on rank 0, computes the marker's checksums, fsyncs, writes ``COMPLETE.json``, renames the folder
    into place and prunes: nothing but the copy stalls training (the checksums, a full-state gather
    plus a float64 pass over every tensor, cost more than the save itself; see bench/README.md).

    Checksums are identical to the synchronous save's (same function over the same full tensors):
    for FSDP, rank 0 reads the just-written DCP checkpoint back (no collective, page cache) and sums
    it; for DDP, rank 0 sums its staged copies. A torn checkpoint is never chosen for resume: the
    marker is written only after every rank's shards and rank 0's checksums are done.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        run_dir: str | os.PathLike,
        keep_last: int,
        want_checksums: bool = True,
    ) -> None:
        self.accelerator = accelerator
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.want_checksums = want_checksums
        # Own gloo group: the background thread's collectives must never interleave with training's.
        self.group = dist.new_group(backend="gloo") if accelerator.num_processes > 1 else None
        self.pending: dict | None = None
        self.completed: list[SaveResult] = []

    def start(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, marker: dict
    ) -> None:
        """All ranks. Stages the state (copies) and returns; writing goes on in the background.

        ``marker`` holds no checksums: rank 0 adds them in the background (``want_checksums``)."""
        self.wait()
        acc = self.accelerator
        started = time.monotonic()
        root = checkpoints_dir(self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        tmp = temp_folder(self.run_dir, step, _common_id(acc))
        tmp.mkdir(parents=True, exist_ok=True)
        job = self._stage(model, optimizer)
        with removed_if_unfinished(tmp):  # a failed write (a full disk) gives its room back
            # Small per-rank files: synchronously, exactly as save_state writes them.
            torch.save(_rng_states(step), tmp / f"random_states_{acc.process_index}.pkl")
            if acc.is_main_process:
                for i, obj in enumerate(acc._custom_objects):
                    torch.save(obj.state_dict(), tmp / f"custom_checkpoint_{i}.pkl")
            acc.wait_for_everyone()
        pending: dict[str, Any] = {
            "step": step,
            "tmp": tmp,
            "final": root / step_name(step),
            "marker": {"step": step, "async": True, **marker},
            "started": started,
            "result": None,
            "error": None,
        }
        if job["kind"] is not None or acc.is_main_process:
            pending["thread"] = threading.Thread(
                target=self._background, args=(pending, job), name=f"ckpt-{step}", daemon=False
            )
            pending["thread"].start()
        else:
            pending["thread"] = None
        self.pending = pending

    def _stage(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's copy of the state its writer thread will write (memory only)."""
        acc = self.accelerator
        plugin = getattr(acc.state, "fsdp_plugin", None)
        inner = getattr(optimizer, "optimizer", optimizer)
        job: dict = {"kind": None}
        if acc.distributed_type.value == "FSDP":
            assert plugin is not None  # Accelerate sets fsdp_plugin whenever the distributed type is FSDP
            if plugin.fsdp_version == 1:
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

                with FSDP.state_dict_type(
                    model, plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config
                ):
                    model_sd = model.state_dict()
                    optim_sd = FSDP.optim_state_dict(model, inner)
            else:
                from torch.distributed.checkpoint.state_dict import (
                    get_model_state_dict,
                    get_optimizer_state_dict,
                )

                model_sd = get_model_state_dict(model)
                optim_sd = get_optimizer_state_dict(model, inner)
            both = {"model": model_sd, "optimizer": optim_sd}
            if plugin.fsdp_version == 1:
                # FSDP1 hands out ShardedTensors, which DCP's DefaultStager cannot copy (data_ptr is
                # unsupported; dcp.async_save failed the same way); these helpers copy their local shards.
                from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

                staged = _copy_state_dict(both, _create_cpu_state_dict(both))
            else:
                # The copy dcp.async_save would make (same stager, CPU options), made here so that one
                # thread can write both state dicts and then finalise, in order.
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                stager = DefaultStager(StagingOptions(False, False, False, False))
                try:
                    staged_now = stager.stage(both)
                finally:
                    stager.close()
                assert not isinstance(staged_now, Future)  # use_async_staging=False: staged synchronously
                staged = staged_now
            job = {
                "kind": "dcp",
                "model": {"model": staged["model"]},
                "optimizer": {"optimizer": staged["optimizer"]},
            }
        elif acc.is_main_process:
            # DDP: every replica is identical; rank 0 writes Accelerate's model.safetensors + optimizer.bin.
            model_sd = {k: v.detach().clone() for k, v in acc.get_state_dict(model, unwrap=True).items()}
            optim_sd = copy.deepcopy(inner.state_dict())
            job = {
                "kind": "ddp",
                "model": model_sd,
                "optimizer": optim_sd,
                "fqns": _optimizer_fqns(acc, model, inner),
            }
        return job

    def _background(self, p: dict, job: dict) -> None:
        """The writer thread: shards, then (rank 0) checksums, marker, rename, prune."""
        try:
            tmp: Path = p["tmp"]
            sums: dict | None = None
            if job["kind"] == "dcp":
                import torch.distributed.checkpoint as dcp

                for name, sub in (("model", "pytorch_model_fsdp_0"), ("optimizer", "optimizer_0")):
                    (tmp / sub).mkdir(exist_ok=True)
                    with without_zip_crc32():
                        dcp.save(
                            job[name],
                            storage_writer=dcp.FileSystemWriter(str(tmp / sub)),
                            process_group=self.group,
                        )
                    job[name] = None  # free the staged copy as soon as it is on disk
                # Each rank's load plan, as a synchronous save's own_shard_digests writes it; in place on
                # every rank before rank 0 lists the files for the marker.
                write_load_plan(tmp, self.accelerator.process_index, self.accelerator.num_processes)
                if self.group is not None:
                    dist.barrier(group=self.group)
                if self.accelerator.is_main_process and self.want_checksums:
                    # Rank 0's dcp.save returns after the coordinator gathered every rank's write
                    # results and wrote .metadata, so every shard is readable now.
                    from train.checksum import checksums_of_dcp_checkpoint

                    sums = checksums_of_dcp_checkpoint(tmp / "pytorch_model_fsdp_0", tmp / "optimizer_0")
            elif job["kind"] == "ddp":
                from accelerate.utils import save as acc_save

                acc_save(job["model"], tmp / "model.safetensors", safe_serialization=True)
                torch.save(job["optimizer"], tmp / "optimizer.bin")
                if self.want_checksums:
                    from train.checksum import checksums_of_full_state

                    sums = checksums_of_full_state(job["model"], job["optimizer"], job["fqns"])
            if not self.accelerator.is_main_process:
                return
            marker = p["marker"]
            if sums is not None:
                marker.update(sums)
            marker["time"] = time.time()
            written = finalize(tmp, p["final"], marker)
            prune(self.run_dir, self.keep_last)
            p["result"] = SaveResult(p["step"], p["final"], time.monotonic() - p["started"], written)
        except BaseException as exc:  # re-raised on the training thread by _finish
            discard_failed_save(p["tmp"], exc)  # as removed_if_unfinished: the room goes back
            p["error"] = exc

    def _done_locally(self, block: bool) -> bool:
        p = self.pending
        if p is None or p["thread"] is None:
            return True
        if block:
            p["thread"].join()
        return not p["thread"].is_alive()

    def poll(self) -> SaveResult | None:
        """Reap a finished save (rank 0: already finalised in the background). Never collective:
        may be called by each rank at any step boundary."""
        if self.pending is None or not self._done_locally(block=False):
            return None
        return self._finish()

    def wait(self) -> SaveResult | None:
        """Block until the save in flight (if any) is complete on this rank and, on rank 0, in place."""
        if self.pending is None:
            return None
        self._done_locally(block=True)
        return self._finish()

    def _finish(self) -> SaveResult | None:
        p, self.pending = self.pending, None
        assert p is not None  # callers check that a save is pending
        if p["error"] is not None:
            raise RuntimeError(f"async checkpoint of step {p['step']} failed") from p["error"]  # loudly
        if p["result"] is not None:
            self.completed.append(p["result"])
        return p["result"]


def _optimizer_fqns(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[str]:
    """Parameter names in ``optimizer.state_dict()`` index order (its ``state`` keys are positions),
    so that checksums over a DDP optimizer copy use the names ``get_optimizer_state_dict`` uses."""
    names = {id(p): n for n, p in accelerator.unwrap_model(model).named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


# ---------------------------------------------------------------------------
# Loading


def load(
    accelerator: Accelerator,
    folder: Path,
    marker: dict,
    optimizer: torch.optim.Optimizer,
    current: dict,
    warn: Callable[[str], None] = print,
) -> list[str]:
    """Restore model, optimizer, scheduler, train state and RNG from ``folder``; all ranks.

    Returns the warnings (what could not be carried over)."""
    from orchestrator.rank import workarounds as accelerate_workarounds

    notes: list[str] = []
    saved_strategy = marker.get("strategy")
    saved_sharded = saved_strategy not in (None, "ddp")
    now_sharded = current.get("strategy") != "ddp"
    if saved_sharded != now_sharded:
        raise RuntimeError(
            f"checkpoint {folder} was written by strategy {saved_strategy} "
            f"({'sharded DCP' if saved_sharded else 'full DDP'} files); this run uses {current.get('strategy')}: "
            "resume with a strategy of the same kind (any FSDP strategy reads any FSDP checkpoint)"
        )
    saved_world = int(marker.get("world_size", current["world_size"]))
    if saved_world != current["world_size"]:
        notes.append(
            f"resharding: checkpoint from world size {saved_world}, now {current['world_size']}: model and "
            "optimizer state are restored exactly and the data position is re-derived from samples_seen; "
            + (
                f"the RNG states of ranks {current['world_size']}..{saved_world - 1} are dropped"
                if saved_world > current["world_size"]
                else f"ranks {saved_world}..{current['world_size'] - 1} have no saved RNG state and keep their seeded one"
            )
        )
    accelerate_workarounds.before_load_state(accelerator, optimizer)
    import logging

    logging.getLogger("accelerate.checkpointing").setLevel(logging.ERROR)  # the RNG note above says it better
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if str(current.get("strategy", "")).startswith("deepspeed_") and saved_world != current["world_size"]:
            notes.append(_load_zero_universal(accelerator, folder, saved_world, current["world_size"]))
        else:
            load_state(accelerator, folder)
    return notes


def _load_zero_universal(accelerator: Accelerator, folder: Path, saved_world: int, world: int) -> str:
    """A ZeRO checkpoint at another world size: rank 0 converts it to DeepSpeed's universal
    checkpoint (once), every rank loads that. Returns the note saying so."""
    from train import deepspeed_zero

    answer: list[str | None] = [None]
    if accelerator.is_main_process:
        try:
            answer = [str(deepspeed_zero.universal_folder(folder))]
        except Exception as exc:  # every rank must learn it, or they wait at the broadcast forever
            answer = [f"error: {type(exc).__name__}: {exc}"]
    if accelerator.num_processes > 1:
        dist.broadcast_object_list(answer, src=0)
    got = answer[0]
    assert got is not None  # rank 0 answered
    if got.startswith("error: "):
        raise RuntimeError(f"converting {folder} to DeepSpeed's universal checkpoint failed: {got[7:]}")
    with deepspeed_zero.loading_universal(accelerator):
        load_state(accelerator, Path(got))
    return (
        f"ZeRO: the checkpoint of world size {saved_world} was converted to DeepSpeed's universal "
        f"checkpoint ({Path(got).name}/ in it) and loaded at world size {world}"
    )
