"""Where a training step's time goes on a GPU; run under ``accelerate launch`` (bench_gpu.py does).

    accelerate launch --config_file <rendered config> bench/gpu_step_probe.py --preset small --out /tmp/p.json

Builds and prepares the model like train/train.py (its workarounds imported from train/, which must be
importable: ``PYTHONPATH=<tree>``), runs the same step (autocast forward, backward, clip, AdamW) on
synthetic batches of train's shape, and after warm-up profiles a few steps with ``torch.profiler``:
wall time per step, the sum of GPU kernel time per step (GPU busy), the top CUDA kernels and CPU ops
by self time, and the number of kernel launches and stream synchronisations per step. GPU busy much
lower than wall time means the step waits on the host (launch- or sync-bound), not on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.autograd.profiler_util import FunctionEventAvg

TREE = Path(os.environ.get("BENCH_TREE", Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(TREE))

from orchestrator.rank import workarounds as accelerate_workarounds  # noqa: E402
from train.model import build_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from accelerate import Accelerator
    from torch.profiler import ProfilerActivity, profile

    pending = accelerate_workarounds.before_accelerator()
    accelerator = Accelerator()
    accelerate_workarounds.after_accelerator(accelerator, pending)
    model = accelerate_workarounds.wrap_model(accelerator, build_model(a.preset, a.seq_len, seed=0), pending)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (a.batch_size, a.seq_len), generator=g).to(accelerator.device)
    y = torch.randint(0, 256, (a.batch_size, a.seq_len), generator=g).to(accelerator.device)

    def step() -> float:
        with accelerator.autocast():
            loss = model(x, y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())  # train.py syncs here too

    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(a.warmup):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    wall_unprofiled = (time.perf_counter() - t) / a.steps
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(a.steps):
            step()
        sync()
    ev = prof.key_averages()

    def dev_us(e: FunctionEventAvg) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    # GPU-side spans of record_function ranges (FSDP::pre_backward, Optimizer.step#AdamW.step) overlap the
    # kernels inside them: not kernels, not counted.
    kernels = [
        e
        for e in ev
        if dev_us(e) > 0
        and e.device_type.name == "CUDA"
        and not getattr(e, "is_user_annotation", False)
        and not e.key.startswith(("FSDP::", "Optimizer.", "ProfilerStep"))
    ]
    cpu_ops = sorted((e for e in ev if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    syncs = sum(
        e.count for e in ev if "Synchronize" in e.key or "EventSynchronize" in e.key or "StreamWait" in e.key
    )
    launches = sum(
        e.count
        for e in ev
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    )
    res = {
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "model_type": type(model).__name__,
        "preset": a.preset,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "wall_ms_per_step_unprofiled": round(wall_unprofiled * 1e3, 2),
        "gpu_busy_ms_per_step": round(sum(dev_us(e) for e in kernels) / a.steps / 1e3, 2),
        "kernels_per_step": round(sum(e.count for e in kernels) / a.steps, 1),
        "kernel_launch_calls_per_step": round(launches / a.steps, 1),
        "sync_or_wait_calls_per_step": round(syncs / a.steps, 1),
        "top_kernels": [
            {
                "name": e.key[:90],
                "ms_per_step": round(dev_us(e) / a.steps / 1e3, 3),
                "calls_per_step": e.count / a.steps,
            }
            for e in sorted(kernels, key=lambda e: -dev_us(e))[:12]
        ],
        "top_cpu_ops": [
            {
                "name": e.key[:90],
                "self_ms_per_step": round(e.self_cpu_time_total / a.steps / 1e3, 3),
                "calls_per_step": e.count / a.steps,
            }
            for e in cpu_ops[:15]
        ],
    }
    if accelerator.is_main_process:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
