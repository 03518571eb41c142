"""``orchestrator export``'s memory on a checkpoint over 1 GB (``python bench/bench_export.py [--reps N]``).

Goal (issue 32): memory stays bounded while the export streams, at most the largest tensor plus a
small constant, not the whole model. Measured against the naive export in the same invocation,
interleaved, each in a fresh process: peak RSS (``ru_maxrss``) minus the process's RSS once torch,
safetensors and DCP are imported (what every variant pays before reading a byte).

The checkpoint: an FSDP sharded checkpoint as Accelerate's ``save_state`` lays it out
(``pytorch_model_fsdp_0/``, DCP, ``{"model": state_dict}``), of a GPT-shaped state dict with
d_model 1536 and 10 blocks (283 M fp32 parameters, 1.13 GB; the largest tensor 37.7 MB), written by
DCP's own ``save`` and completed with the run directory's marker (``COMPLETE.json``, sizes and
sha256), so the export finds and checks it as it does a training run's.

Variants:

* ``export``: ``orchestrator.runner.export.export`` to safetensors (DCP ``load`` one tensor at a time,
  the safetensors file streamed);
* ``export --verify``: the same, then every tensor read back and compared, and the checksum;
* ``naive safetensors``: DCP's whole-checkpoint load (``_EmptyStateDictLoadPlanner``, as
  ``dcp_to_torch_save`` reads), then ``safetensors.torch.save_file``;
* ``dcp_to_torch_save``: torch's own converter (load everything, ``torch.save``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
D_MODEL, N_LAYER, VOCAB, SEQ = 1536, 10, 256, 1024

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, {repo!r})
import torch, safetensors.torch, torch.distributed.checkpoint as dcp
from orchestrator.runner import export as export_mod
def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
base = rss_kb()
variant, run_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
ckpt = os.path.join(run_dir, "checkpoints", "step_00000001", "pytorch_model_fsdp_0")
t0 = time.monotonic()
if variant in ("export", "export --verify"):
    os.rmdir(out) if os.path.isdir(out) else None
    export_mod.export(__import__("pathlib").Path(run_dir), __import__("pathlib").Path(out),
                      verify=variant.endswith("verify"), say=lambda _l: None)
elif variant == "naive safetensors":
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state = {{}}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(ckpt), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    os.makedirs(out, exist_ok=True)
    safetensors.torch.save_file(state["model"], os.path.join(out, "model.safetensors"), metadata={{"format": "pt"}})
else:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    os.makedirs(out, exist_ok=True)
    dcp_to_torch_save(ckpt, os.path.join(out, "model.pt"))
wall = time.monotonic() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"base_kb": base, "peak_kb": peak, "wall_s": wall}}))
"""


def make_checkpoint(run_dir: Path) -> dict[str, float]:
    """The >1 GB checkpoint, in a run directory, by DCP's save and the run directory's marker."""
    code = f"""
import sys, time, json
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
import torch, torch.distributed.checkpoint as dcp
from orchestrator.contract.checkpoints import finalize
d, L = {D_MODEL}, {N_LAYER}
g = torch.Generator().manual_seed(0)
sd = {{"tok_emb.weight": (256, d), "pos_emb.weight": ({SEQ}, d), "ln_f.weight": (d,), "head.weight": ({VOCAB}, d)}}
for i in range(L):
    for name, shape in {{"ln1.weight": (d,), "ln1.bias": (d,), "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
                        "attn.proj.weight": (d, d), "attn.proj.bias": (d,), "ln2.weight": (d,), "ln2.bias": (d,),
                        "mlp.fc.weight": (4 * d, d), "mlp.fc.bias": (4 * d,), "mlp.proj.weight": (d, 4 * d),
                        "mlp.proj.bias": (d,)}}.items():
        sd[f"blocks.{{i}}.{{name}}"] = shape
state = {{k: torch.randn(s, generator=g) * 0.02 for k, s in sd.items()}}
run = Path({str(run_dir)!r})
tmp = run / "checkpoints" / ".tmp-step_00000001-bench"
(tmp / "pytorch_model_fsdp_0").mkdir(parents=True)
dcp.save({{"model": state}}, storage_writer=dcp.FileSystemWriter(str(tmp / "pytorch_model_fsdp_0")), no_dist=True)
finalize(tmp, run / "checkpoints" / "step_00000001", {{"step": 1, "world_size": 2, "strategy": "full_shard"}})
sizes = [t.numel() * 4 for t in state.values()]
print(json.dumps({{"params": sum(t.numel() for t in state.values()), "bytes": sum(sizes), "largest": max(sizes)}}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def measure(variant: str, run_dir: Path, out: Path) -> dict[str, float]:
    res = subprocess.run(
        [sys.executable, "-c", CHILD.format(repo=str(REPO)), variant, str(run_dir), str(out)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{res.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    variants = ["export", "naive safetensors", "export --verify", "dcp_to_torch_save"]
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp_name:
        tmp = Path(tmp_name)
        info = make_checkpoint(tmp / "run")
        print(
            f"checkpoint: {info['params'] / 1e6:.0f} M params, {info['bytes'] / 1e9:.2f} GB, "
            f"largest tensor {info['largest'] / 1e6:.1f} MB"
        )
        got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.reps):
            for variant in variants:  # interleaved
                got[variant].append(measure(variant, tmp / "run", tmp / "out"))
    results: dict[str, dict] = {}
    for variant, reps in got.items():
        extra_mb = [(r["peak_kb"] - r["base_kb"]) / 1024 for r in reps]
        results[variant] = {
            "extra_mb": statistics.median(extra_mb),
            "extra_mb_range": [min(extra_mb), max(extra_mb)],
            "wall_s": statistics.median(r["wall_s"] for r in reps),
            "base_mb": statistics.median(r["base_kb"] / 1024 for r in reps),
        }
        res = results[variant]
        print(
            f"{variant}: peak RSS - after imports {res['extra_mb']:.0f} MB "
            f"(range {res['extra_mb_range'][0]:.0f}-{res['extra_mb_range'][1]:.0f}), wall {res['wall_s']:.2f} s, "
            f"RSS after imports {res['base_mb']:.0f} MB"
        )
    print(
        json.dumps({"checkpoint": info, "results": results, "largest_mb": math.ceil(info["largest"] / 2**20)})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
