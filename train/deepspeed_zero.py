"""What ``train.py`` does differently under DeepSpeed ZeRO (Accelerate's DEEPSPEED path).

* The engine clips gradients (at the config's ``gradient_clipping``) and steps the optimizer inside
  ``accelerator.backward``; ``optimizer.step()`` and ``zero_grad()`` are no-ops there. The gradient norm
  comes from the engine.
* DeepSpeed needs ``train_micro_batch_size_per_gpu``, which Accelerate takes from a prepared data
  loader; ``train.py`` has its own batcher, so it says the batch size itself.
* ZeRO checkpoints (``accelerator.save_state``: ``pytorch_model/zero_pp_rank_R_mp_rank_00_*_states.pt``)
  are partitioned for the world size that wrote them. At another world size, rank 0 converts the
  checkpoint once to DeepSpeed's universal checkpoint (``ds_to_universal``, into ``universal/`` inside
  the checkpoint folder) and every rank loads that (``load_universal``); another ZeRO stage or a
  non-DeepSpeed strategy is refused with the reason (``orchestrator resume`` refuses it before
  submitting).
* Checksums gather ZeRO-3's partitioned parameters; the optimizer checksum is the sum over ranks of
  each rank's partition (comparable at the same world size; at another one only the parameters'
  checksum is compared on restore).

``orchestrator export RUN --out DIR`` writes a ZeRO checkpoint's consolidated weights (any stage, no
process group needed; DeepSpeed's ``zero_to_fp32`` reads it: ``orchestrator.rundir.export.read``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: The tag Accelerate's ``save_state`` gives the engine's checkpoint (its folder inside ours).
CHECKPOINT_TAG = "pytorch_model"


def active(accelerator: Any) -> bool:
    return bool(accelerator.distributed_type.value == "DEEPSPEED")


def zero_stage(accelerator: Any) -> int | None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage)


def configure(accelerator: Any, batch_size: int, grad_accum: int, clip: float) -> list[str]:
    """Before ``prepare``: fill in what DeepSpeed cannot infer. Returns notes for rank 0 to print."""
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = batch_size
    notes = []
    if grad_accum != 1:
        raise SystemExit(
            "--grad-accum: DeepSpeed accumulates inside its engine (gradient_accumulation_steps in its "
            "config); train.py runs DeepSpeed with --grad-accum 1 only"
        )
    ds_clip = config.get("gradient_clipping", 1.0)
    if ds_clip in (None, "auto"):
        ds_clip = 1.0
    if float(ds_clip) != float(clip):
        notes.append(
            f"note: DeepSpeed clips gradients at {float(ds_clip)} (its config's gradient_clipping), not at "
            f"--clip {clip}; set the orchestrator's --gradient-clipping to change it"
        )
    return notes


def grad_norm(accelerator: Any, clip_result: Any) -> float:
    """The engine's global gradient norm of the step just taken (``clip_grad_norm_`` returns it)."""
    value = clip_result
    if value is None and getattr(accelerator, "deepspeed_engine_wrapped", None) is not None:
        value = accelerator.deepspeed_engine_wrapped.engine.get_global_grad_norm()
    if value is None:
        return 0.0
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _gathered(engine: Any) -> Any:
    if engine.zero_optimization_stage() != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


def checksums(model: Any, optimizer: Any) -> dict[str, float | None]:
    """Like ``train.checksum.checksums`` (a collective): the full parameters, and the optimizer state
    as the sum over ranks of each rank's partition checksum."""
    from train.checksum import tensor_checksum

    with _gathered(model):
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    zero_optimizer = getattr(optimizer, "optimizer", optimizer)
    base = getattr(zero_optimizer, "optimizer", zero_optimizer)
    local: dict[str, torch.Tensor] = {}
    # Keyed by ZeRO's flat fp32 partitions, in the order they first stepped (ZeRO-3 points the param
    # groups at them only during its step, so the groups cannot be walked here).
    for i, state in enumerate(base.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local[f"{i:06d}.{key}"] = value
    total = torch.tensor([tensor_checksum(local)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return {"param_checksum": tensor_checksum(params), "optim_checksum": float(total[0])}


def local_partition_numel(model: Any) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model) for ZeRO-3's partitioned parameters."""
    held = full = 0
    for p in model.module.parameters():
        partition = getattr(p, "ds_tensor", None)
        held += partition.numel() if partition is not None else p.numel()
        full += int(getattr(p, "ds_numel", p.numel()))
    return held, full


def local_shard_checksum(model: Any) -> float:
    """The values this rank holds: ZeRO-3 partitions, or the full (replicated) parameters below stage 3."""
    from train.checksum import tensor_checksum

    named = {}
    for name, p in model.module.named_parameters():
        partition = getattr(p, "ds_tensor", None)
        named[name] = (partition if partition is not None else p).detach()
    return tensor_checksum(named)


def resume_problem(marker: dict, strategy: str, world_size: int) -> str | None:
    """Why a checkpoint cannot be resumed by this DeepSpeed run (or a DeepSpeed checkpoint by a
    non-DeepSpeed one); None when it can (another world size can: :func:`universal_folder`)."""
    saved = str(marker.get("strategy") or "")
    saved_ds, now_ds = saved.startswith("deepspeed_"), strategy.startswith("deepspeed_")
    if not saved_ds and not now_ds:
        return None
    if saved_ds != now_ds:
        return (
            f"checkpoint written by {saved or 'unknown'}, this run is {strategy}: DeepSpeed ZeRO checkpoints and "
            "DDP/FSDP checkpoints are different formats; resume with the strategy that wrote it (export a "
            "ZeRO checkpoint with `orchestrator export RUN --out DIR` to start a new run from its weights)"
        )
    if saved != strategy:
        return f"checkpoint written by {saved}, this run is {strategy}: resume with the same ZeRO stage"
    return None


#: Where the universal checkpoint of a ZeRO checkpoint folder goes (inside it; Accelerate's layout).
UNIVERSAL_DIR = "universal"
#: Accelerate's own small files a load reads besides the engine's folder (TrainState, scheduler, RNG).
_ACCELERATE_FILES = ("custom_checkpoint_*.pkl", "random_states_*.pkl", "scheduler*.bin", "sampler*.bin")


def universal_folder(checkpoint: Path) -> Path:
    """Rank 0: ``checkpoint`` converted to DeepSpeed's universal checkpoint (once; a later call finds
    it), laid out as Accelerate's ``load_state`` reads a folder. Written into a temporary folder and
    renamed, so a conversion killed half-way is never taken for a finished one."""
    import argparse
    import contextlib
    import io
    import shutil
    import uuid

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    done = checkpoint / UNIVERSAL_DIR
    if (done / CHECKPOINT_TAG / "zero").is_dir():
        return done
    tmp = checkpoint / f".{UNIVERSAL_DIR}-{uuid.uuid4().hex[:8]}"
    try:
        args = argparse.Namespace(
            input_folder=str(checkpoint / CHECKPOINT_TAG),
            output_folder=str(tmp / CHECKPOINT_TAG),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            # Accelerate's client state has no Megatron-style universal_checkpoint_info; DeepSpeed
            # fills in the plain data-parallel one.
            inject_missing_state=True,
        )
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal(args)
        for pattern in _ACCELERATE_FILES:
            for path in checkpoint.glob(pattern):
                shutil.copy2(path, tmp / path.name)
        shutil.rmtree(done, ignore_errors=True)
        tmp.rename(done)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return done


@contextmanager
def loading_universal(accelerator: Any) -> Iterator[None]:
    """Every rank, around ``load_state`` of a :func:`universal_folder`: the engine reads it as a
    universal checkpoint (the ``checkpoint.load_universal`` config key, set for this load only)."""
    config = accelerator.deepspeed_engine_wrapped.engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
