"""Per-rank model-state bytes and peak RSS for one strategy; run under ``accelerate launch``.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file <rendered config> bench/memory_probe.py \
        --preset small --steps 2 --out /tmp/mem.json

Builds the model from train/model.py and prepares it exactly like train/train.py (the CPU
workarounds of orchestrator/rank/workarounds.py, imported, not copied), then runs ``--steps`` steps
of AdamW on synthetic data and measures on every rank:

* model state after the last ``optimizer.step()`` (before ``zero_grad``): the bytes of the local
  parameter shards, gradient shards and optimizer state tensors (``DTensor.to_local()`` for FSDP2;
  the full tensors for DDP);
* the parameter bytes held between forward and backward of the last step (FSDP2 keeps the
  all-gathered parameters there unless it reshards after forward: what separates shard_grad_op from
  full_shard);
* RSS: current RSS before the model is built (baseline), the high-water mark of building + preparing
  (``VmHWM`` from /proc/self/status), the high-water mark of the training steps alone (VmHWM reset
  with ``/proc/self/clear_refs`` after preparing), and the lifetime ``ru_maxrss``.

Rank 0 gathers every rank's figures and writes them as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from orchestrator.rank import workarounds as accelerate_workarounds  # noqa: E402
from train.model import build_model, count_params  # noqa: E402


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def rss_bytes() -> int:
    return status_kb("VmRSS") * 1024


def hwm_bytes() -> int:
    return status_kb("VmHWM") * 1024


def reset_hwm() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # DTensor (FSDP2)
        t = t.to_local()
    return t.numel() * t.element_size()


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters())
    optim = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                optim += local_bytes(v)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")

    from accelerate import Accelerator

    pending = accelerate_workarounds.before_accelerator()
    accelerator = Accelerator()
    accelerate_workarounds.after_accelerator(accelerator, pending)
    rank, world = accelerator.process_index, accelerator.num_processes
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    kind = accelerator.distributed_type.value
    detail = {}
    if (
        kind == "FSDP"
        and plugin is not None
        and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
        and getattr(plugin.cpu_offload, "pin_memory", False)
        and not torch.cuda.is_available()
    ):
        # FSDP2 CPU offload pins its CPU copies (pin_memory=True by default, Accelerate has no option):
        # on a machine without an accelerator that raises "Cannot access accelerator device when none
        # is available". orchestrator/rank/workarounds.py has no fix for it yet; the probe turns pinning off.
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        pending.applied.append("bench:offload_without_pinning")
        detail = {
            "fsdp_version": plugin.fsdp_version,
            "reshard_after_forward": str(plugin.reshard_after_forward),
            "cpu_offload": str(plugin.cpu_offload),
        }

    accelerator.wait_for_everyone()
    rss_base = rss_bytes()
    reset_hwm()
    t0 = time.perf_counter()
    model: torch.nn.Module = build_model(a.preset, a.seq_len, seed=0)
    num_params = count_params(model)
    rss_built = rss_bytes()
    model = accelerate_workarounds.wrap_model(accelerator, model, pending)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = getattr(optimizer, "optimizer", optimizer)
    accelerator.wait_for_everyone()
    rss_prepared = rss_bytes()
    hwm_init = hwm_bytes()
    init_s = time.perf_counter() - t0

    hwm_reset = reset_hwm()
    g = torch.Generator().manual_seed(rank)
    after_forward_params = 0
    state = {}
    step_s = []
    for step in range(a.steps):
        t = time.perf_counter()
        x = torch.randint(0, 256, (a.batch_size, a.seq_len), generator=g)
        y = torch.randint(0, 256, (a.batch_size, a.seq_len), generator=g)
        loss = model(x, y)
        if step == a.steps - 1:
            # Parameters held between forward and backward (unsharded ones count in full).
            after_forward_params = sum(local_bytes(p) for p in model.parameters())
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step == a.steps - 1:
            state = model_state(model, inner)
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t)
    accelerator.wait_for_everyone()
    mine = {
        "rank": rank,
        "rss_baseline": rss_base,
        "rss_after_build": rss_built,
        "rss_after_prepare": rss_prepared,
        "hwm_build_prepare": hwm_init,
        "hwm_steps": hwm_bytes() if hwm_reset else None,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "model_state": state,
        "params_between_forward_and_backward": after_forward_params,
        "init_s": round(init_s, 3),
        "step_s": [round(s, 3) for s in step_s],
    }
    everyone: list[dict[str, Any] | None] = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if rank == 0:
        out = {
            "preset": a.preset,
            "num_params": num_params,
            "world_size": world,
            "distributed_type": kind,
            "batch_size": a.batch_size,
            "seq_len": a.seq_len,
            "steps": a.steps,
            "workarounds": list(pending.applied),
            **detail,
            "ranks": everyone,
        }
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out), flush=True)
    accelerate_workarounds.finish(accelerator)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
