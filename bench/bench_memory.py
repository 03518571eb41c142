"""Memory per rank of ddp / shard_grad_op / full_shard (+ CPU offload) against the ZeRO formulas.

Each (preset, strategy) is one ``accelerate launch --config_file <config rendered by orchestrator
render --profile local --nodes 1 --procs-per-node 2 --strategy S --wrap-cls TransformerBlock>
bench/memory_probe.py`` (2 ranks, CPU, gloo, ACCELERATE_USE_CPU=1, OMP_NUM_THREADS=1 as the local
profile). See memory_probe.py for what is measured on each rank.

The issue's formulas are for Adam in mixed precision (fp16 params and grads, fp32 master copy and
moments: 16 bytes per parameter). On CPU everything is fp32: params 4 bytes, grads 4, Adam m + v 8,
which again totals 16 bytes per parameter, split differently. For Psi parameters and N ranks:

    ddp            16 Psi              (everything replicated)
    shard_grad_op   4 Psi + 12 Psi / N  (ZeRO-2: params replicated; grads + optimizer sharded)
    full_shard     16 Psi / N           (ZeRO-3: all sharded)
    full_shard + CPU offload: 16 Psi / N of host memory (on a GPU machine the device would hold ~0
                   at rest; on CPU the "offload" moves nothing, so the formula is the same)

Run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that large freed blocks go back to the OS and RSS
follows live memory more closely (glibc otherwise keeps freed heap, which RSS still counts).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

VARIANTS = {  # name -> extra render args
    "ddp": ("ddp", ()),
    "shard_grad_op": ("shard_grad_op", ("--wrap-cls", "TransformerBlock")),
    "full_shard": ("full_shard", ("--wrap-cls", "TransformerBlock")),
    # `--offload` is refused on profiles without GPUs (FSDP's offload pins memory, which needs a GPU), so this
    # variant renders full_shard and turns offload on in the file; memory_probe.py unpins FSDP2's copies.
    "full_shard+offload": ("full_shard", ("--wrap-cls", "TransformerBlock")),
}
FORCE_OFFLOAD = {"full_shard+offload"}


def formula_bytes(variant: str, psi: int, n: int) -> int:
    if variant == "ddp":
        return 16 * psi
    if variant == "shard_grad_op":
        return 4 * psi + 12 * psi // n
    return 16 * psi // n


FORMULA_TEXT = {
    "ddp": "16Ψ",
    "shard_grad_op": "4Ψ + 12Ψ/N",
    "full_shard": "16Ψ/N",
    "full_shard+offload": "16Ψ/N",
}


def render(variant: str, out: Path, env: dict) -> Path:
    strategy, extra = VARIANTS[variant]
    subprocess.run(
        [
            PY,
            "-m",
            "orchestrator",
            "render",
            "--profile",
            "local",
            "--nodes",
            "1",
            "--procs-per-node",
            "2",
            "--strategy",
            strategy,
            *extra,
            "--out",
            str(out),
            "--",
            "train/train.py",
        ],
        env=env,
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    config = next(out.glob("accelerate_config*.yaml"))
    if variant in FORCE_OFFLOAD:
        text = config.read_text()
        assert "fsdp_offload_params: false" in text, text
        config.write_text(text.replace("fsdp_offload_params: false", "fsdp_offload_params: true"))
    return config


def probe(cfg: Path, preset: str, steps: int, out: Path, env: dict, port: int) -> dict:
    acc = shutil.which("accelerate") or "accelerate"
    env = dict(env, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [
        acc,
        "launch",
        "--config_file",
        str(cfg),
        "--main_process_port",
        str(port),
        "bench/memory_probe.py",
        "--preset",
        preset,
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"memory probe {preset} {cfg} failed ({res.returncode}): {res.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarise(variant: str, raw: dict) -> dict:
    psi, n = raw["num_params"], raw["world_size"]
    formula = formula_bytes(variant, psi, n)
    ranks = raw["ranks"]
    state = max(r["model_state"]["total"] for r in ranks)
    sharded_params = max(r["model_state"]["params"] for r in ranks)
    held = max(r["params_between_forward_and_backward"] for r in ranks)
    # In-step model state: at-rest state plus the all-gathered parameters kept from forward to backward.
    in_step = state + max(0, held - sharded_params)
    rss_peak = max(r["hwm_steps"] - r["rss_baseline"] for r in ranks if r["hwm_steps"] is not None)
    rss_lifetime = max(r["ru_maxrss"] - r["rss_baseline"] for r in ranks)
    return {
        "variant": variant,
        "preset": raw["preset"],
        "num_params": psi,
        "world_size": n,
        "formula": FORMULA_TEXT[variant],
        "formula_bytes": formula,
        "model_state_bytes": state,
        "model_state_by_kind": ranks[0]["model_state"],
        "params_between_forward_and_backward_bytes": held,
        "in_step_model_state_bytes": in_step,
        "model_state_ratio": round(state / formula, 3),
        "in_step_ratio": round(in_step / formula, 3),
        "peak_rss_minus_baseline_bytes": rss_peak,
        "lifetime_maxrss_minus_baseline_bytes": rss_lifetime,
        "rss_ratio": round(rss_peak / formula, 3),
        "workarounds": raw.get("workarounds"),
        "reshard_after_forward": raw.get("reshard_after_forward"),
        "cpu_offload": raw.get("cpu_offload"),
        "step_s": [r["step_s"] for r in ranks],
        "raw": raw,
    }


def bench_memory(
    tmp: Path,
    env: dict,
    presets: list[str],
    steps: int,
    free_port: Callable[[], int],
    log: Callable[[str], None] = print,
    skip: AbstractSet[tuple[str, str]] = frozenset(),
) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    cfgs = {v: render(v, tmp / f"cfg_{v}", env) for v in VARIANTS}
    rows = []
    for preset in presets:
        for v, cfg in cfgs.items():
            if (preset, v) in skip:
                continue
            log(f"memory: {preset} {v}")
            raw = probe(cfg, preset, steps, tmp / f"{preset}_{v}.json", env, free_port())
            rows.append(summarise(v, raw))
    return {
        "steps": steps,
        "batch_size": rows[0]["raw"]["batch_size"] if rows else None,
        "seq_len": rows[0]["raw"]["seq_len"] if rows else None,
        "rows": rows,
    }


def mb(x: float) -> str:
    return f"{x / 1e6:.0f} MB"


def goal_rows(M: dict) -> list[dict]:
    out = []
    for r in M["rows"]:
        is_goal = r["variant"] == "full_shard"
        out.append(
            {
                "item": f"memory/rank {r['preset']} ({r['num_params'] / 1e6:.1f}M) {r['variant']}, N={r['world_size']}",
                "goal": "model state <= 1.2x of 16Ψ/N (fp32)"
                if is_goal
                else f"report vs {r['formula']} (fp32)",
                "measured": (
                    f"model state {mb(r['model_state_bytes'])} (in-step {mb(r['in_step_model_state_bytes'])}); "
                    f"peak RSS − baseline {mb(r['peak_rss_minus_baseline_bytes'])}; formula {r['formula']} = {mb(r['formula_bytes'])}"
                ),
                "ratio": f"state {r['model_state_ratio']:.2f}x, in-step {r['in_step_ratio']:.2f}x, RSS {r['rss_ratio']:.2f}x",
                "met": (r["model_state_ratio"] <= 1.2) if is_goal else None,
            }
        )
    return out


def table(M: dict) -> list[str]:
    lines = [
        "| preset | strategy | formula (fp32 CPU) | formula | params | grads | Adam m+v | model state | ratio | params held fwd→bwd | in-step state | ratio | peak RSS − baseline | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in M["rows"]:
        k = r["model_state_by_kind"]
        lines.append(
            f"| {r['preset']} | {r['variant']} | {r['formula']} | {mb(r['formula_bytes'])} | {mb(k['params'])} | {mb(k['grads'])} | "
            f"{mb(k['optimizer'])} | {mb(r['model_state_bytes'])} | {r['model_state_ratio']:.2f}x | "
            f"{mb(r['params_between_forward_and_backward_bytes'])} | {mb(r['in_step_model_state_bytes'])} | {r['in_step_ratio']:.2f}x | "
            f"{mb(r['peak_rss_minus_baseline_bytes'])} | {r['rss_ratio']:.2f}x |"
        )
    return lines
