"""Where a sharded load's time goes (issue 44, item 1): train/'s load of the ``base`` checkpoint split
into phases, through DCP's own path (as before issue 44) and through the load plan, warm and cold.

Launched by ``bench_ckpt_load.py --phases N`` with ``accelerate launch --config_file <render
--strategy full_shard --wrap-cls TransformerBlock>`` (2 ranks), as ckpt_save_probe.py. Builds the
model, one AdamW step, one save (train/'s), then N rounds of: stock load warm, plan load warm, stock
load cold, plan load cold, resume cold (page cache dropped before each cold one; root only). Each
phase is the time rank 0 spent inside the function named (wrappers around the real functions,
summed over a load); ``other`` is the rest of the load (Accelerate's barriers, RNG and scheduler
files, logging). Rank 0 prints one JSON line per round.

Stock path phases: ``metadata`` (DCP's read_metadata: unpickling ``.metadata``), ``plan`` (DCP's
reduce_scatter of the plans, including local planning; ``metadata`` excluded), ``reads`` (the
reader's read_data: the bytes into the tensors), ``finish`` (the all_gather after the reads,
``reads`` excluded: waiting for the slower rank), ``state_dicts`` (Accelerate's get/set model and
optimizer state dicts: the model's load_state_dict copies every parameter onto itself).
Plan path phases: ``plan_read``, ``match`` (the model's and the optimizer's tensors against the
plan, param groups), ``agree`` (the all_reduce), ``reads``. Resume phases: ``pick`` (rank 0's
find_resumable(..., shards=False) and the broadcast), ``check`` (checked_choice: every rank's own
shards' sha256), ``load``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckpt_save_probe import drop_page_cache, stock_dcp_reads  # noqa: E402

from orchestrator.contract.checkpoints import find_resumable  # noqa: E402
from orchestrator.rank import workarounds  # noqa: E402
from orchestrator.rank.checkpoint_io import checked_choice  # noqa: E402
from train import checkpointing  # noqa: E402
from train.model import build_model  # noqa: E402

T: dict[str, float] = {}


@contextlib.contextmanager
def timing(owner: Any, name: str, phase: str) -> Iterator[None]:
    """Add the time spent in ``owner.name`` to ``T[phase]`` while inside."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            T[phase] = T.get(phase, 0.0) + time.perf_counter() - t

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, real)


@contextlib.contextmanager
def phases() -> Iterator[None]:
    import accelerate.utils.fsdp_utils as fsdp_utils
    import torch.distributed.checkpoint.state_dict as sd
    import torch.distributed.checkpoint.utils as dcp_utils
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from orchestrator.rank import shard_plan

    wrapped = [
        (FileSystemReader, "read_metadata", "metadata"),
        (dcp_utils._DistWrapper, "reduce_scatter", "plan+"),
        (FileSystemReader, "read_data", "reads"),
        (dcp_utils._DistWrapper, "all_gather", "finish+"),
        (fsdp_utils, "_get_model_state_dict", "state_dicts"),
        (fsdp_utils, "_set_model_state_dict", "state_dicts"),
        (sd, "get_optimizer_state_dict", "state_dicts"),
        (sd, "set_optimizer_state_dict", "state_dicts"),
        (shard_plan, "_read_plan", "plan_read"),
        (shard_plan, "_model_targets", "match"),
        (shard_plan, "_optimizer_targets", "match"),
        (shard_plan, "_group_values", "match"),
        (shard_plan, "_agree", "agree"),
        (shard_plan, "_read_files", "reads"),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, phase in wrapped:
            stack.enter_context(timing(owner, name, phase))
        yield


def split(total: float) -> dict[str, float]:
    """``T`` as phases of a load of ``total`` seconds (nested phases taken out of their callers)."""
    got = dict(T)
    if "plan+" in got:
        got["plan"] = got.pop("plan+") - got.get("metadata", 0.0)
    if "finish+" in got:
        got["finish"] = got.pop("finish+") - got.get("reads", 0.0)
    got["other"] = total - sum(got.values())
    return {k: round(v, 4) for k, v in got.items()}


def main() -> None:
    root, rounds = Path(sys.argv[1]), int(sys.argv[2])
    from accelerate import Accelerator

    pending = workarounds.before_accelerator()
    acc = Accelerator()
    workarounds.after_accelerator(acc, pending)
    model = workarounds.wrap_model(acc, build_model("base"), pending)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    out = model(torch.randint(0, 100, (1, 16)))
    (out[0] if isinstance(out, tuple) else out).float().mean().backward()
    opt.step()
    rank = acc.process_index
    current = {"world_size": acc.num_processes, "strategy": "full_shard"}
    run_dir = root / "run"
    folder = checkpointing.save(acc, run_dir, 1, dict(current), keep_last=1).path
    can_drop = os.access("/proc/sys/vm/drop_caches", os.W_OK)
    kinds = ["stock_warm", "plan_warm"] + (["stock_cold", "plan_cold", "resume_cold"] if can_drop else [])
    with phases():
        for r in range(rounds):
            row: dict[str, Any] = {"round": r}
            for kind in kinds:
                dist.barrier()
                if kind.endswith("_cold") and rank == 0:
                    drop_page_cache()
                dist.barrier()
                T.clear()
                t = time.perf_counter()
                if kind.startswith("stock"):
                    with stock_dcp_reads():
                        checkpointing.load(acc, folder, dict(current), opt, current)
                elif kind.startswith("plan"):
                    checkpointing.load(acc, folder, dict(current), opt, current)
                else:
                    choice: list[Any] = [None]
                    if rank == 0:
                        found = find_resumable(run_dir, print, shards=False)
                        choice = [(str(found[0]), found[1]) if found else None]
                    dist.broadcast_object_list(choice, src=0)
                    picked = time.perf_counter()
                    checked = checked_choice(acc, run_dir, choice[0])
                    assert checked is not None
                    loading = time.perf_counter()
                    checkpointing.load(acc, folder, checked[1], opt, current)
                    T.clear()
                    T.update(pick=picked - t, check=loading - picked, load=time.perf_counter() - loading)
                total = time.perf_counter() - t
                row[kind] = {"total": round(total, 4), **split(total)}
            dist.barrier()
            if rank == 0:
                print(json.dumps({**row, "loadavg": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
