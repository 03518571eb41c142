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

``--async-ckpt`` writes the same files with ``torch.distributed.checkpoint.async_save``
(FSDP) or a writer thread (DDP, rank 0), each on its own gloo process group so
its background collectives never interleave with training's; the marker is
written, and the folder renamed, when the save has completed on every rank.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

MARKER = "COMPLETE.json"
CHECKPOINTS = "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


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


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_files(folder: Path) -> dict[str, int]:
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MARKER:
            files[path.relative_to(folder).as_posix()] = path.stat().st_size
    return files


def finalize(tmp: Path, final: Path, marker: dict) -> dict:
    """Rank 0: fsync the files, write the marker (fsync), rename into place (atomic), fsync the parent."""
    files = list_files(tmp)
    for rel in files:
        _fsync_path(tmp / rel)
    marker = {**marker, "files": files}
    with open(tmp / MARKER, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({(tmp / rel).parent for rel in files} | {tmp}):
        _fsync_path(sub, directory=True)
    if final.exists():
        # The same step saved before (e.g. a run killed after its save): replace it, never mix the two.
        trash = final.parent / f".trash-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_path(final.parent, directory=True)
    return marker


def validate(folder: Path) -> tuple[dict | None, str]:
    """(marker, "") for a complete checkpoint, else (None, why not)."""
    marker_path = folder / MARKER
    if not marker_path.is_file():
        return None, f"no {MARKER} (the save did not finish)"
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
        files = marker["files"]
        int(marker["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable {MARKER}: {exc}"
    if not files:
        return None, f"{MARKER} lists no files"
    for rel, size in files.items():
        path = folder / rel
        if not path.is_file():
            return None, f"missing file {rel}"
        actual = path.stat().st_size
        if actual != size:
            return None, f"file {rel} has {actual} bytes, {MARKER} says {size} (truncated or torn)"
    return marker, ""


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step_*`` folder, newest first (not yet validated)."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            if entry.is_dir() and entry.name.startswith("step_") and entry.name[5:].isdigit():
                found.append((int(entry.name[5:]), entry))
    return sorted(found, reverse=True)


def find_resumable(run_dir: str | os.PathLike, warn=print) -> tuple[Path, dict] | None:
    """The newest complete checkpoint; torn ones are skipped with a warning."""
    for _, folder in complete_checkpoints(run_dir):
        marker, why = validate(folder)
        if marker is not None:
            return folder, marker
        warn(f"warning: skipping checkpoint {folder}: {why}")
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for entry in sorted(root.glob(".tmp-step_*")):
            warn(f"warning: ignoring unfinished checkpoint {entry.name} (no marker: never resumed from)")
    return None


def prune(run_dir: str | os.PathLike, keep_last: int, keep_tmp: set[str] = frozenset()) -> None:
    """Rank 0: keep the newest ``keep_last`` complete checkpoints; drop stale temp folders."""
    root = checkpoints_dir(run_dir)
    complete = [(s, p) for s, p in complete_checkpoints(run_dir) if (p / MARKER).is_file()]
    for _, folder in complete[max(1, keep_last) :]:
        shutil.rmtree(folder, ignore_errors=True)
    for entry in root.glob(".tmp-step_*"):
        if entry.name not in keep_tmp:
            shutil.rmtree(entry, ignore_errors=True)
    for entry in root.glob(".trash-*"):
        shutil.rmtree(entry, ignore_errors=True)


def _common_id(accelerator) -> str:
    """One id for the temp folder, the same on every rank (rank 0 picks it)."""
    value = [uuid.uuid4().hex[:8] if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        dist.broadcast_object_list(value, src=0)
    return value[0]


# ---------------------------------------------------------------------------
# Saving


@dataclass
class SaveResult:
    step: int
    path: Path
    seconds: float
    marker: dict = field(default_factory=dict)


def save(accelerator, run_dir: str | os.PathLike, step: int, marker: dict, keep_last: int) -> SaveResult:
    """Synchronous save by every rank; returns when the checkpoint is complete and in place."""
    started = time.monotonic()
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_name(step)}-{_common_id(accelerator)}"
    final = root / step_name(step)
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    written = {}
    if accelerator.is_main_process:
        written = finalize(tmp, final, {"step": step, "time": time.time(), "async": False, **marker})
        prune(run_dir, keep_last)
    accelerator.wait_for_everyone()
    return SaveResult(step, final, time.monotonic() - started, written)


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
    """``--async-ckpt``: one save in flight at a time; same files and marker protocol as ``save``."""

    def __init__(self, accelerator, run_dir: str | os.PathLike, keep_last: int):
        self.accelerator = accelerator
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        # Own gloo groups: the background threads' collectives must never interleave with training's.
        self.groups = [dist.new_group(backend="gloo"), dist.new_group(backend="gloo")] if accelerator.num_processes > 1 else [None, None]
        self.pending: dict | None = None
        self.completed: list[SaveResult] = []

    def start(self, model, optimizer, step: int, marker: dict) -> None:
        """All ranks. Stages the state (copies) and returns; writing goes on in the background."""
        self.wait()
        acc = self.accelerator
        started = time.monotonic()
        root = checkpoints_dir(self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{step_name(step)}-{_common_id(acc)}"
        tmp.mkdir(parents=True, exist_ok=True)
        futures = []
        thread = None
        plugin = getattr(acc.state, "fsdp_plugin", None)
        inner = getattr(optimizer, "optimizer", optimizer)
        if acc.distributed_type.value == "FSDP":
            import torch.distributed.checkpoint as dcp

            model_dir, optim_dir = tmp / "pytorch_model_fsdp_0", tmp / "optimizer_0"
            model_dir.mkdir(exist_ok=True)
            optim_dir.mkdir(exist_ok=True)
            if plugin.fsdp_version == 1:
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

                with FSDP.state_dict_type(model, plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config):
                    model_sd = model.state_dict()
                    optim_sd = FSDP.optim_state_dict(model, inner)
            else:
                from torch.distributed.checkpoint.state_dict import (
                    get_model_state_dict,
                    get_optimizer_state_dict,
                )

                model_sd = get_model_state_dict(model)
                optim_sd = get_optimizer_state_dict(model, inner)
            futures.append(
                dcp.async_save({"model": model_sd}, storage_writer=dcp.FileSystemWriter(str(model_dir)), process_group=self.groups[0])
            )
            futures.append(
                dcp.async_save({"optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(str(optim_dir)), process_group=self.groups[1])
            )
        elif acc.is_main_process:
            # DDP: every replica is identical; rank 0 writes Accelerate's model.safetensors + optimizer.bin.
            from accelerate.utils import save as acc_save

            model_sd = {k: v.detach().clone() for k, v in acc.get_state_dict(model, unwrap=True).items()}
            optim_sd = copy.deepcopy(inner.state_dict())

            def write() -> None:
                acc_save(model_sd, tmp / "model.safetensors", safe_serialization=True)
                torch.save(optim_sd, tmp / "optimizer.bin")

            thread = threading.Thread(target=write, name=f"ckpt-{step}", daemon=False)
            thread.start()
        # Small per-rank files: synchronously, exactly as save_state writes them.
        torch.save(_rng_states(step), tmp / f"random_states_{acc.process_index}.pkl")
        if acc.is_main_process:
            for i, obj in enumerate(acc._custom_objects):
                torch.save(obj.state_dict(), tmp / f"custom_checkpoint_{i}.pkl")
        acc.wait_for_everyone()
        self.pending = {
            "step": step,
            "tmp": tmp,
            "final": root / step_name(step),
            "futures": futures,
            "thread": thread,
            "marker": {"step": step, "async": True, **marker},
            "started": started,
        }

    def _done_locally(self, block: bool) -> bool:
        p = self.pending
        if p is None:
            return True
        if block:
            for fut in p["futures"]:
                fut.result()
            if p["thread"] is not None:
                p["thread"].join()
            return True
        return all(f.done() for f in p["futures"]) and (p["thread"] is None or not p["thread"].is_alive())

    def poll(self) -> SaveResult | None:
        """Rank 0 finalises a finished save (marker, rename); other ranks only reap their futures.
        Never collective: may be called by each rank at any step boundary."""
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
        for fut in p["futures"]:
            fut.result()  # raise a background failure here, loudly
        if not self.accelerator.is_main_process:
            return None
        # Rank 0's DCP future completes only after the coordinator has gathered every rank's write
        # results and written .metadata, so every shard is on disk now.
        p["marker"]["time"] = time.time()
        written = finalize(p["tmp"], p["final"], p["marker"])
        prune(self.run_dir, self.keep_last, keep_tmp=set())
        result = SaveResult(p["step"], p["final"], time.monotonic() - p["started"], written)
        self.completed.append(result)
        return result


# ---------------------------------------------------------------------------
# Loading


def load(accelerator, folder: Path, marker: dict, optimizer, current: dict, warn=print) -> list[str]:
    """Restore model, optimizer, scheduler, train state and RNG from ``folder``; all ranks.

    Returns the warnings (what could not be carried over)."""
    from train import accelerate_workarounds

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
        accelerator.load_state(str(folder))
    return notes
