"""GPU benchmark of train/ through ``accelerate launch`` (one process per GPU; here 1 GPU): writes
bench/results_gpu.json.

What it measures (``python bench/bench_gpu.py`` on a machine with CUDA):

* throughput: ``accelerate launch --config_file <orchestrator render --profile slurm_h100 --nodes 1
  --procs-per-node 1 ...> train/train.py --preset P --data synthetic`` for FSDP2 full_shard (``--wrap-cls
  TransformerBlock``) and ddp, ``--mixed-precision bf16`` and ``no``, presets small / base / 1b: median
  ``step_time_s`` after the first steps (warm-up), tokens/s = tokens per step / that median, peak GPU
  memory (train's ``peak_mem_mb`` = ``torch.cuda.max_memory_allocated``), MFU = 6 * params * tokens/s /
  peak (H100 SXM dense bf16 989.4e12 FLOP/s; attention FLOPs not counted);
* ``--offload`` (FSDP2 CPU offload, ``fsdp_offload_params: true``) against the same run without it;
* a sharded checkpoint round trip: run A (20 steps, save_state at step 10 and 20); run C resumes
  from A's step-10 checkpoint (``--resume PATH``, a fresh run dir: load_state in a new process) and
  runs to 20; and run B is stopped by SIGUSR2 after step 10 (saves, exits 75) and relaunched with
  ``--resume auto``. The losses of steps 11..20 of C and B are compared with A's (max abs diff); train
  itself checks the restored parameters/optimizer against the checksums in the marker (exit 4 if not);
* the same round trip with ``--async-ckpt``; ``resume-diag`` runs add D, 20 steps with no checkpoint before the end,
  to tell a resume defect from GPU run-to-run nondeterminism (A vs D);
* ``probe`` (bench/gpu_step_probe.py under the same config): torch.profiler view of a step (GPU kernel time vs wall
  time, kernels, launches, stream waits per step).

The Accelerate configs are rendered by the orchestrator (``--render-only DIR`` renders them where the
orchestrator's own dependencies are installed; ``--configs DIR`` uses such a folder on a machine
without them). The profile's NCCL environment (InfiniBand interface names) is not applied: it
belongs to that cluster. ``--cpu-dry-run`` runs the same plumbing on CPU with the tiny preset
(``ACCELERATE_USE_CPU=1``) to test this script without a GPU; its figures mean nothing.

Every run is independent: a failing run is recorded (exit code, log tail) and the next one runs;
results are written after every run (``--out``, and ``--copy-to`` too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
PY = sys.executable
RESULTS = BENCH / "results_gpu.json"
#: The tree whose train/ is run (``--tree``: e.g. a ``git archive`` of a commit, so that others' edits in
#: progress in the working tree are not what gets measured).
TREE = REPO

#: H100 SXM5 dense BF16 tensor-core peak (NVIDIA datasheet: 1,979 TFLOP/s with sparsity, half dense).
PEAK_BF16 = 989.4e12
#: H100 SXM5 FP32 (non-tensor-core) peak; train/ leaves torch's default (no TF32) for fp32 matmuls.
PEAK_FP32 = 66.9e12

#: Tokens per step kept equal (16,384) for small and base; 1b gets half so fp32 activations fit.
SHAPES = {"tiny": (4, 32), "small": (64, 256), "base": (32, 512), "1b": (8, 1024)}
STEPS = {
    "tiny": (8, 2),
    "small": (30, 5),
    "base": (30, 5),
    "1b": (15, 5),
}  # (max steps, warm-up steps excluded)

#: Config variants: name -> render options.
VARIANTS: dict[str, list[str]] = {
    "full_shard_bf16": [
        "--strategy",
        "full_shard",
        "--mixed-precision",
        "bf16",
        "--wrap-cls",
        "TransformerBlock",
    ],
    "full_shard_no": [
        "--strategy",
        "full_shard",
        "--mixed-precision",
        "no",
        "--wrap-cls",
        "TransformerBlock",
    ],
    "full_shard_bf16_offload": [
        "--strategy",
        "full_shard",
        "--mixed-precision",
        "bf16",
        "--wrap-cls",
        "TransformerBlock",
        "--offload",
    ],
    "ddp_bf16": ["--strategy", "ddp", "--mixed-precision", "bf16"],
    "ddp_no": ["--strategy", "ddp", "--mixed-precision", "no"],
}


def log(msg: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def render_configs(dest: Path) -> dict[str, Path]:
    """Render every variant with the orchestrator (needs its dependencies: pydantic, jinja2, ...)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = {}
    for name, opts in VARIANTS.items():
        folder = dest / name
        subprocess.run(
            [
                PY,
                "-m",
                "orchestrator",
                "render",
                "--profile",
                "slurm_h100",
                "--nodes",
                "1",
                "--procs-per-node",
                "1",
                *opts,
                "--out",
                str(folder),
                "--",
                "train/train.py",
            ],
            env=env,
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        out[name] = next(folder.glob("accelerate_config*.yaml"))
    return out


def existing_configs(src: Path) -> dict[str, Path]:
    src = src.resolve()
    return {
        name: next((src / name).glob("accelerate_config*.yaml")) for name in VARIANTS if (src / name).is_dir()
    }


def param_count(preset: str, seq_len: int) -> int:
    import torch

    sys.path.insert(0, str(TREE))
    from train.model import GPT, config_for

    with torch.device("meta"):
        model = GPT(config_for(preset, seq_len))
    return sum(p.numel() for p in model.parameters())


def tree_commit() -> str | None:
    """The commit the measured train/ came from: ``TREE/COMMIT`` (written with a git archive) or git."""
    marker = TREE / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    try:
        res = subprocess.run(
            ["git", "-C", str(TREE), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(TREE), "status", "--porcelain", "train"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return res.stdout.strip() + (" (train/ modified)" if dirty.stdout.strip() else "")


def device_info() -> dict:
    import accelerate
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "accelerate": accelerate.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            device_name=torch.cuda.get_device_name(0),
            capability=list(torch.cuda.get_device_capability(0)),
            total_memory_bytes=p.total_memory,
            multiprocessors=p.multi_processor_count,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    try:
        q = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["nvidia_smi"] = q.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    return info


def matmul_tflops() -> float | None:
    """Achievable bf16 matmul rate (8192^3, mean of 10 after 3 warm-ups): the ceiling MFU is read against."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / 10
    del a, b
    torch.cuda.empty_cache()
    return round(2 * n**3 / dt / 1e12, 1)


class Runner:
    def __init__(self, configs: dict[str, Path], tmp: Path, cpu: bool):
        self.configs, self.tmp, self.cpu = configs, tmp, cpu
        self.n = 0

    def env(self, variant: str) -> dict:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("ORCHESTRATOR_", "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))
        }
        strategy = "ddp" if variant.startswith("ddp") else "full_shard"
        env.update(
            PYTHONPATH=str(TREE) + os.pathsep + env.get("PYTHONPATH", ""),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="8",
            TORCH_CPP_LOG_LEVEL="ERROR",
            ORCHESTRATOR_EXPECTED_WORLD_SIZE="1",
            ORCHESTRATOR_EXPECTED_NUM_NODES="1",
            ORCHESTRATOR_PROCS_PER_NODE="1",
            ORCHESTRATOR_STRATEGY=strategy,
            ORCHESTRATOR_FSDP_VERSION="2",
        )
        if self.cpu:
            env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="2")
        return env

    def start(
        self, variant: str, args: list[str], run_dir: Path, script: str = "train/train.py"
    ) -> tuple[subprocess.Popen, Path]:
        self.n += 1
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        logf = run_dir.parent / f"{run_dir.name}.{self.n}.log"
        tail_args = ["--run-dir", str(run_dir)] if script == "train/train.py" else []
        cmd = [
            PY,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(self.configs[variant]),
            "--main_process_port",
            str(free_port()),
            script,
            *args,
            *tail_args,
        ]
        env = dict(self.env(variant), BENCH_TREE=str(TREE))
        with open(logf, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=TREE,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return proc, logf

    def run(
        self,
        variant: str,
        args: list[str],
        run_dir: Path,
        timeout: float,
        signal_after_step: int | None = None,
        script: str = "train/train.py",
    ) -> dict:
        t0 = time.perf_counter()
        proc, logf = self.start(variant, args, run_dir, script)
        signalled = None
        try:
            end = time.monotonic() + timeout
            while proc.poll() is None:
                if time.monotonic() > end:
                    raise subprocess.TimeoutExpired(proc.args, timeout)
                if signal_after_step is not None and signalled is None:
                    ev = train_events(run_dir)
                    if ev and ev[-1]["step"] >= signal_after_step:
                        signalled = ev[-1]["step"]
                        for pid in worker_pids(proc.pid):
                            os.kill(pid, signal.SIGUSR2)
                time.sleep(0.05)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wall = time.perf_counter() - t0
        text = logf.read_text(errors="replace")
        return {
            "returncode": proc.returncode,
            "wall_s": round(wall, 2),
            "log": text,
            "signalled_at_step": signalled,
            "exit_status": read_json(run_dir / "exit_status.json"),
        }


def worker_pids(root: int) -> list[int]:
    """The train/train.py processes under an ``accelerate launch`` (not the launcher itself)."""
    import psutil

    out = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if any(c.endswith("train/train.py") for c in cmd) and not any("accelerate" in c for c in cmd[:3]):
            out.append(p.pid)
    return out


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_events(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if '"train"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return out


def tail(text: str, n: int = 2500) -> str:
    return text[-n:]


def train_args(preset: str, steps: int, extra: list[str] | None = None) -> list[str]:
    bs, seq = SHAPES[preset]
    return [
        "--preset",
        preset,
        "--data",
        "synthetic",
        "--batch-size",
        str(bs),
        "--seq-len",
        str(seq),
        "--max-steps",
        str(steps),
        "--warmup-steps",
        "5",
        "--lr",
        "1e-3",
        "--log-every",
        "1000",
        "--eval-batches",
        "1",
        "--keep-last",
        "3",
        *(extra or []),
    ]


def summarise_log(text: str) -> dict:
    out: dict[str, Any] = {}
    m = re.search(r"self-check ok: (.*?); workarounds applied: (.*?); ([\d.]+)M parameters", text)
    if m:
        out.update(selfcheck=m.group(1), workarounds=m.group(2))
    out["saves"] = [
        {"step": int(s), "seconds": float(t)}
        for s, t in re.findall(r"checkpoint step (\d+) saved in ([\d.]+)s", text)
    ]
    out["async_saves"] = [
        {"step": int(s), "seconds": float(t)}
        for s, t in re.findall(r"checkpoint step (\d+) complete \(async, ([\d.]+)s\)", text)
    ]
    m = re.search(r"resumed from (\S+) at step (\d+) in ([\d.]+)s", text)
    if m:
        out["resumed"] = {"checkpoint": m.group(1), "step": int(m.group(2)), "load_s": float(m.group(3))}
    return out


def throughput(runner: Runner, tmp: Path, preset: str, variant: str, timeout: float) -> dict:
    steps, skip = STEPS[preset]
    bs, seq = SHAPES[preset]
    run_dir = tmp / f"{preset}_{variant}"
    r = runner.run(variant, train_args(preset, steps), run_dir, timeout)
    ev = train_events(run_dir)
    params = param_count(preset, seq)
    tokens = bs * seq
    rec: dict[str, Any] = {
        "kind": "throughput",
        "preset": preset,
        "variant": variant,
        "params": params,
        "batch_size": bs,
        "seq_len": seq,
        "tokens_per_step": tokens,
        "steps": len(ev),
        "excluded_first_steps": skip,
        "returncode": r["returncode"],
        "wall_s": r["wall_s"],
        **summarise_log(r["log"]),
    }
    ok = r["returncode"] == 0 and len(ev) > skip
    if not ok:
        rec["error"] = tail(r["log"])
        return rec
    times = [e["step_time_s"] for e in ev[skip:]]
    st = med(times)
    tps = tokens / st
    final_dir = sorted((run_dir / "checkpoints").glob("step_*"))
    marker = read_json(final_dir[-1] / "COMPLETE.json") if final_dir else None
    rec.update(
        median_step_time_s=round(st, 5),
        min_step_time_s=round(min(times), 5),
        max_step_time_s=round(max(times), 5),
        first_step_time_s=round(ev[0]["step_time_s"], 3),
        tokens_per_s=round(tps, 1),
        peak_mem_mb=round(ev[-1]["peak_mem_mb"], 1),
        mfu_bf16_peak=round(6 * params * tps / PEAK_BF16, 4),
        mfu_fp32_peak=round(6 * params * tps / PEAK_FP32, 4) if variant.endswith("_no") else None,
        final_loss=ev[-1]["loss"],
        checkpoint_bytes=sum(marker["files"].values()) if marker else None,
        step_times_s=[round(x, 5) for x in times],
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return rec


def losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in train_events(run_dir)}


def compare(x: dict[int, float], y: dict[int, float], steps: range) -> dict | None:
    """Max |loss difference| over the steps both have, and the first step where they differ."""
    common = [s for s in steps if s in x and s in y]
    if not common:
        return None
    diffs = {s: abs(x[s] - y[s]) for s in common}
    first = next((s for s in common if diffs[s] != 0.0), None)
    return {
        "steps": [common[0], common[-1]],
        "max_abs_diff": max(diffs.values()),
        "first_differing_step": first,
    }


def resume_check(
    runner: Runner,
    tmp: Path,
    preset: str,
    variant: str,
    timeout: float,
    async_ckpt: bool,
    with_c: bool = True,
    with_d: bool = False,
) -> dict:
    """A: 20 steps, checkpoints at 10 and 20. C: resume from A's step 10 in a fresh run dir. B: SIGUSR2 after
    step 10 (checkpoint, exit 75), then ``--resume auto``. D (``with_d``): 20 steps with no checkpoint
    before the end: the truly uninterrupted run. Losses of every run, and their differences."""
    total, mid = (20, 10) if preset != "tiny" else (6, 3)
    asyn = ["--async-ckpt"] if async_ckpt else []
    extra = ["--ckpt-every", str(mid), *asyn]
    tag = f"{preset}_{variant}{'_async' if async_ckpt else ''}"
    rec: dict[str, Any] = {
        "kind": "resume",
        "preset": preset,
        "variant": variant,
        "async_ckpt": async_ckpt,
        "steps": total,
        "ckpt_step": mid,
    }
    dirs = {k: tmp / f"resume_{tag}_{k}" for k in "ABCD"}
    every = range(1, total + 1)
    if with_d:
        d = runner.run(variant, train_args(preset, total, asyn), dirs["D"], timeout)
        rec["D"] = {
            "how": "no checkpoint before the end",
            "returncode": d["returncode"],
            "wall_s": d["wall_s"],
            **summarise_log(d["log"]),
        }
        if d["returncode"] != 0:
            rec["D"]["error"] = tail(d["log"])
    a = runner.run(variant, train_args(preset, total, extra), dirs["A"], timeout)
    rec["A"] = {
        "how": f"checkpoints at step {mid} and {total}",
        "returncode": a["returncode"],
        "wall_s": a["wall_s"],
        **summarise_log(a["log"]),
    }
    if a["returncode"] != 0:
        rec["error"] = "A: " + tail(a["log"])
        return rec
    mid_ckpt = dirs["A"] / "checkpoints" / f"step_{mid:08d}"
    marker = read_json(mid_ckpt / "COMPLETE.json")
    rec["checkpoint_bytes"] = sum(marker["files"].values()) if marker else None
    rec["checkpoint_files"] = sorted(marker["files"]) if marker else None
    if with_c:
        c = runner.run(
            variant, train_args(preset, total, ["--resume", str(mid_ckpt), *asyn]), dirs["C"], timeout
        )
        rec["C"] = {
            "how": f"--resume {mid_ckpt.name} of A, fresh run dir",
            "returncode": c["returncode"],
            "wall_s": c["wall_s"],
            **summarise_log(c["log"]),
            "loaded": read_json(dirs["C"] / "loaded.json"),
        }
        if c["returncode"] != 0:
            rec["C"]["error"] = tail(c["log"])
    b1 = runner.run(variant, train_args(preset, total, asyn), dirs["B"], timeout, signal_after_step=mid)
    b2 = runner.run(variant, train_args(preset, total, asyn), dirs["B"], timeout)  # --resume auto
    rec["B"] = {
        "how": f"SIGUSR2 to the worker once step >= {mid} was logged, then --resume auto in the same run dir",
        "signalled_at_step": b1["signalled_at_step"],
        "first_exit_status": b1["exit_status"],
        "first_returncode": b1["returncode"],
        "returncode": b2["returncode"],
        "wall_s": [b1["wall_s"], b2["wall_s"]],
        "first": summarise_log(b1["log"]),
        **summarise_log(b2["log"]),
        "loaded": read_json(dirs["B"] / "loaded.json"),
    }
    if b2["returncode"] != 0 or (b1["exit_status"] or {}).get("code") != 75:
        rec["B"]["error"] = tail(b1["log"], 1500) + "\n---\n" + tail(b2["log"], 1500)

    L = {k: losses(dirs[k]) for k in "ABCD" if k in rec}
    rec["losses"] = {k: {str(s): v for s, v in sorted(x.items())} for k, x in L.items()}
    if "D" in L:
        rec["A_vs_D"] = compare(L["A"], L["D"], every)  # does saving a checkpoint change the run?
    for name in ("C", "B"):
        if name not in rec:
            continue
        resumed_at = (rec[name].get("loaded") or {}).get("step")
        if resumed_at is None:
            continue
        after = range(resumed_at + 1, total + 1)
        got = compare(L[name], L["A"], after)
        rec[name].update(
            resumed_at_step=resumed_at,
            compared_steps=got["steps"] if got else None,
            max_abs_loss_diff=got["max_abs_diff"] if got else None,
            bit_equal=bool(got and got["max_abs_diff"] == 0.0),
        )
        if "D" in L:
            rec[name]["after_resume_vs_D"] = compare(L[name], L["D"], after)
            rec[name]["before_resume_vs_D"] = compare(L[name], L["D"], range(1, resumed_at + 1))
        fa, fx = read_json(dirs["A"] / "final.json") or {}, read_json(dirs[name] / "final.json") or {}
        if fa.get("param_checksum") is not None and fx.get("param_checksum") is not None:
            rec[name]["final_param_checksum_rel_diff"] = abs(
                fa["param_checksum"] - fx["param_checksum"]
            ) / max(1e-30, abs(fa["param_checksum"]))
    for path in dirs.values():
        shutil.rmtree(path, ignore_errors=True)
    return rec


def probe(runner: Runner, tmp: Path, preset: str, variant: str, timeout: float) -> dict:
    """bench/gpu_step_probe.py under the same config: profiler view of one step."""
    bs, seq = SHAPES[preset]
    out = tmp / f"probe_{preset}_{variant}.json"
    r = runner.run(
        variant,
        ["--preset", preset, "--batch-size", str(bs), "--seq-len", str(seq), "--out", str(out)],
        tmp / f"probe_{preset}_{variant}",
        timeout,
        script=str(BENCH / "gpu_step_probe.py"),
    )
    rec: dict[str, Any] = {
        "kind": "probe",
        "preset": preset,
        "variant": variant,
        "returncode": r["returncode"],
        "wall_s": r["wall_s"],
    }
    got = read_json(out)
    if r["returncode"] != 0 or got is None:
        rec["error"] = tail(r["log"])
    else:
        rec.update(got)
    return rec


def plan(cpu: bool, quick: bool) -> list[tuple[str, dict]]:
    """(label, spec) in priority order: what matters most runs first, so a time limit cuts the least."""
    if cpu:
        return [
            ("tiny full_shard_bf16", {"kind": "throughput", "preset": "tiny", "variant": "full_shard_bf16"}),
            ("tiny ddp_no", {"kind": "throughput", "preset": "tiny", "variant": "ddp_no"}),
            (
                "resume tiny full_shard_bf16",
                {
                    "kind": "resume",
                    "preset": "tiny",
                    "variant": "full_shard_bf16",
                    "async": False,
                    "with_d": True,
                },
            ),
            ("probe tiny full_shard_bf16", {"kind": "probe", "preset": "tiny", "variant": "full_shard_bf16"}),
        ]
    items: list[tuple[str, dict]] = []
    for preset in ("small", "base"):
        for v in ("full_shard_bf16", "ddp_bf16"):
            items.append((f"{preset} {v}", {"kind": "throughput", "preset": preset, "variant": v}))
    items.append(
        (
            "base full_shard_bf16_offload",
            {"kind": "throughput", "preset": "base", "variant": "full_shard_bf16_offload"},
        )
    )
    items.append(
        (
            "resume base full_shard_bf16",
            {"kind": "resume", "preset": "base", "variant": "full_shard_bf16", "async": False},
        )
    )
    items.append(
        (
            "resume small full_shard_bf16 async",
            {"kind": "resume", "preset": "small", "variant": "full_shard_bf16", "async": True},
        )
    )
    for preset in ("small", "base"):
        for v in ("full_shard_no", "ddp_no"):
            items.append((f"{preset} {v}", {"kind": "throughput", "preset": preset, "variant": v}))
    items += [
        ("1b full_shard_bf16", {"kind": "throughput", "preset": "1b", "variant": "full_shard_bf16"}),
        (
            "resume-diag base full_shard_bf16",
            {
                "kind": "resume",
                "preset": "base",
                "variant": "full_shard_bf16",
                "async": False,
                "with_c": False,
                "with_d": True,
            },
        ),
        ("probe small full_shard_bf16", {"kind": "probe", "preset": "small", "variant": "full_shard_bf16"}),
        ("probe small ddp_bf16", {"kind": "probe", "preset": "small", "variant": "ddp_bf16"}),
        ("1b ddp_bf16", {"kind": "throughput", "preset": "1b", "variant": "ddp_bf16"}),
    ]
    if not quick:
        items += [
            (
                "resume-diag small ddp_bf16",
                {
                    "kind": "resume",
                    "preset": "small",
                    "variant": "ddp_bf16",
                    "async": False,
                    "with_c": False,
                    "with_d": True,
                },
            ),
            (
                "resume-diag small full_shard_no",
                {
                    "kind": "resume",
                    "preset": "small",
                    "variant": "full_shard_no",
                    "async": False,
                    "with_c": False,
                    "with_d": True,
                },
            ),
            (
                "small full_shard_bf16_offload",
                {"kind": "throughput", "preset": "small", "variant": "full_shard_bf16_offload"},
            ),
            ("probe small full_shard_no", {"kind": "probe", "preset": "small", "variant": "full_shard_no"}),
            (
                "resume base full_shard_bf16 async",
                {"kind": "resume", "preset": "base", "variant": "full_shard_bf16", "async": True},
            ),
            (
                "1b full_shard_bf16_offload",
                {"kind": "throughput", "preset": "1b", "variant": "full_shard_bf16_offload"},
            ),
            ("1b full_shard_no", {"kind": "throughput", "preset": "1b", "variant": "full_shard_no"}),
        ]
    return items


def scratch_root() -> Path:
    """tmpfs when it has room (checkpoints of 1b are ~12 GB; the disk is not what is measured here)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 40e9:
        return shm
    return Path(tempfile.gettempdir())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--render-only", metavar="DIR", help="render the Accelerate configs into DIR and stop")
    ap.add_argument(
        "--configs", metavar="DIR", help="use configs rendered before (--render-only) instead of rendering"
    )
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--copy-to", metavar="DIR", help="also write the results (and failing logs) here after every run"
    )
    ap.add_argument(
        "--budget", type=float, default=1800.0, help="seconds; runs that would start after it are skipped"
    )
    ap.add_argument("--quick", action="store_true", help="no 1b, no async round trip")
    ap.add_argument("--only", nargs="*", help="labels (as in the plan) to run")
    ap.add_argument(
        "--merge",
        metavar="FILE",
        help="start from these results: keep their runs, replace those run again (by label)",
    )
    ap.add_argument(
        "--tree", metavar="DIR", help="run DIR/train/train.py instead of this checkout's (e.g. a git archive)"
    )
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="test the plumbing on CPU (tiny preset; figures meaningless)",
    )
    a = ap.parse_args(argv)
    global TREE
    if a.tree:
        TREE = Path(a.tree).resolve()
    if a.render_only:
        for name, path in render_configs(Path(a.render_only)).items():
            print(name, path)
        return 0
    import torch

    if not torch.cuda.is_available() and not a.cpu_dry_run:
        print("no CUDA device: nothing measured (see --cpu-dry-run)", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="bench_gpu_", dir=scratch_root()))
    configs = existing_configs(Path(a.configs)) if a.configs else render_configs(root / "configs")
    runner = Runner(configs, root, cpu=a.cpu_dry_run)
    info = device_info()
    R: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M %Z"),
        "device": info,
        "cpu_dry_run": a.cpu_dry_run,
        "tree": str(TREE),
        "tree_commit": tree_commit(),
        "peak_flops": {
            "bf16_dense": PEAK_BF16,
            "fp32": PEAK_FP32,
            "note": "H100 SXM5 datasheet: BF16 dense 989.4 TFLOP/s, FP32 66.9 TFLOP/s; MFU = 6 * params * tokens/s / peak",
        },
        "matmul_bf16_8192_tflops": matmul_tflops(),
        "scratch": str(root),
        "configs": {k: str(v) for k, v in configs.items()},
        "shapes": {
            k: {
                "batch_size": v[0],
                "seq_len": v[1],
                "max_steps": STEPS[k][0],
                "excluded_first_steps": STEPS[k][1],
            }
            for k, v in SHAPES.items()
        },
        "runs": [],
        "skipped": [],
    }
    calls = [{"when": R["when"], "labels": []}]
    if a.merge and (old := read_json(Path(a.merge))):
        R["runs"] = old.get("runs", [])
        calls = (
            old.get(
                "calls",
                [
                    {
                        "when": old.get("when"),
                        "wall_s": old.get("wall_s"),
                        "labels": [r.get("label") for r in old.get("runs", [])],
                    }
                ],
            )
            + calls
        )
        if old.get("device", {}).get("device_name") != info.get("device_name"):
            R["merged_from_another_device"] = old.get("device")
    R["calls"] = calls
    out = Path(a.out)

    def save() -> None:
        R["wall_s"] = calls[-1]["wall_s"] = round(time.monotonic() - t_start, 1)
        text = json.dumps(R, indent=1) + "\n"
        out.write_text(text)
        if a.copy_to:
            Path(a.copy_to).mkdir(parents=True, exist_ok=True)
            (Path(a.copy_to) / "results_gpu.json").write_text(text)

    save()
    durations: list[float] = []
    for label, spec in plan(a.cpu_dry_run, a.quick):
        if a.only and label not in a.only:
            continue
        if spec["variant"] not in configs:
            R["skipped"].append({"label": label, "why": "no config rendered for " + spec["variant"]})
            continue
        elapsed = time.monotonic() - t_start
        guess = (
            {"resume": 3.5, "probe": 1.0}.get(spec["kind"], 1)
            * (1.0 if spec["preset"] != "small" or spec["kind"] != "resume" else 0.7)
            * (max(durations) if durations else 30)
            * (3 if spec["preset"] == "1b" else 1)
        )
        if elapsed + guess > a.budget:
            R["skipped"].append({"label": label, "why": f"budget: {elapsed:.0f} s used of {a.budget:.0f} s"})
            save()
            continue
        log(f"{label} ...")
        t = time.monotonic()
        timeout = max(60.0, a.budget - elapsed)
        try:
            if spec["kind"] == "throughput":
                rec = throughput(runner, root, spec["preset"], spec["variant"], timeout)
            elif spec["kind"] == "probe":
                rec = probe(runner, root, spec["preset"], spec["variant"], timeout)
            else:
                rec = resume_check(
                    runner,
                    root,
                    spec["preset"],
                    spec["variant"],
                    timeout,
                    spec["async"],
                    spec.get("with_c", True),
                    spec.get("with_d", False),
                )
        except Exception as exc:  # one run's failure must not lose the others
            rec = {
                "kind": spec["kind"],
                "preset": spec["preset"],
                "variant": spec["variant"],
                "error": repr(exc),
            }
        rec["label"] = label
        rec["bench_s"] = round(time.monotonic() - t, 1)
        if spec["kind"] == "throughput":
            durations.append(rec["bench_s"])
        R["runs"] = [r for r in R["runs"] if r.get("label") != label] + [rec]
        calls[-1]["labels"].append(label)
        log(f"{label}: {short(rec)}")
        save()
    shutil.rmtree(root, ignore_errors=True)
    save()
    return 0


def short(rec: dict) -> str:
    if rec.get("error"):
        return "FAILED: " + rec["error"][-400:]
    if rec["kind"] == "probe":
        return (
            f"{rec['distributed_type']} {rec['mixed_precision']}: wall {rec['wall_ms_per_step_unprofiled']} ms/step, GPU busy "
            f"{rec['gpu_busy_ms_per_step']} ms, {rec['kernels_per_step']} kernels, {rec['sync_or_wait_calls_per_step']} syncs/step"
        )
    if rec["kind"] == "throughput":
        return (
            f"{rec['median_step_time_s'] * 1e3:.1f} ms/step, {rec['tokens_per_s']:.0f} tok/s, peak {rec['peak_mem_mb']:.0f} MiB, "
            f"MFU {rec['mfu_bf16_peak'] * 100:.1f}% ({rec['wall_s']} s)"
        )
    parts = [f"A vs D {rec.get('A_vs_D')}"]
    for k in ("C", "B"):
        x = rec.get(k, {})
        if not x:
            continue
        parts.append(
            f"{k}: rc {x.get('returncode')} resumed at {x.get('resumed_at_step')} max|dloss| {x.get('max_abs_loss_diff')} "
            f"vs D after {x.get('after_resume_vs_D')} before {x.get('before_resume_vs_D')}"
            + (f" ERROR {x['error'][-300:]}" if x.get("error") else "")
        )
    return "; ".join(parts)


# ---------------------------------------------------------------------------
# Report (used by bench/run.py's ``gpu`` item)


def load(path: Path = RESULTS) -> dict | None:
    return read_json(path)


def _runs(G: dict, kind: str) -> list[dict]:
    return [r for r in G.get("runs", []) if r.get("kind") == kind]


def _tp(G: dict, preset: str, variant: str) -> dict | None:
    return next(
        (
            r
            for r in _runs(G, "throughput")
            if r["preset"] == preset and r["variant"] == variant and not r.get("error")
        ),
        None,
    )


def measured_when(G: dict) -> str:
    calls = G.get("calls") or [{"when": G["when"]}]
    return calls[0]["when"] if len(calls) == 1 else f"{calls[0]['when']} – {calls[-1]['when']}"


def device_line(G: dict) -> str:
    d = G["device"]
    smi = str(d.get("nvidia_smi", "")).split(", ")
    driver = f" (driver {smi[1]})" if len(smi) > 1 else ""
    return f"1 x {d.get('device_name')}{driver}, torch {d.get('torch')}, accelerate {d.get('accelerate')}, measured {measured_when(G)}"


def goal_rows(G: dict) -> list[dict]:
    """Rows for bench/results.md's goal table (the full tables come from ``table``)."""
    rows: list[dict] = []
    dev = device_line(G)
    parts, ok = [], True
    for preset in ("small", "base", "1b"):
        cells = []
        for v in ("ddp_bf16", "full_shard_bf16"):
            r = _tp(G, preset, v)
            if r:
                cells.append(
                    f"{v.replace('_bf16', '')} {r['median_step_time_s'] * 1e3:.0f} ms = {r['tokens_per_s'] / 1e3:.0f}k tok/s, "
                    f"MFU {r['mfu_bf16_peak'] * 100:.1f}%"
                )
        if cells:
            parts.append(f"{preset}: " + "; ".join(cells))
    failed = [r["label"] for r in _runs(G, "throughput") if r.get("error")]
    ok = not failed
    rows.append(
        {
            "item": f"GPU: train/ under accelerate launch, ddp and FSDP2 full_shard, bf16 and no ({dev})",
            "goal": "runs; report tokens/s, step time, memory, MFU",
            "measured": " | ".join(parts)
            + (f" | FAILED: {', '.join(failed)}" if failed else "")
            + " (bf16; all figures in the GPU section)",
            "ratio": "MFU vs 989.4 TFLOP/s bf16 dense",
            "met": ok,
        }
    )
    for r in _runs(G, "throughput"):
        if "offload" not in r["variant"]:
            continue
        base = _tp(G, r["preset"], r["variant"].replace("_offload", ""))
        if r.get("error") or base is None:
            rows.append(
                {
                    "item": f"GPU --offload {r['preset']}",
                    "goal": "runs",
                    "measured": "FAILED" if r.get("error") else "no baseline",
                    "ratio": "n/a",
                    "met": not r.get("error"),
                }
            )
            continue
        rows.append(
            {
                "item": f"GPU --offload (FSDP2 CPU offload) {r['preset']} full_shard bf16",
                "goal": "runs; step time vs no offload",
                "measured": f"runs: {r['median_step_time_s'] * 1e3:.0f} ms/step vs {base['median_step_time_s'] * 1e3:.0f} ms without; "
                f"peak GPU memory {r['peak_mem_mb'] / 1024:.2f} vs {base['peak_mem_mb'] / 1024:.2f} GiB",
                "ratio": f"{r['median_step_time_s'] / base['median_step_time_s']:.1f}x slower",
                "met": True,
            }
        )
    for r in _runs(G, "resume"):
        if r.get("label", "").startswith("resume-diag"):
            continue
        parts, ok = [], not r.get("error")
        for k in ("C", "B"):
            x = r.get(k)
            if not x:
                continue
            good = x.get("returncode") == 0 and x.get("max_abs_loss_diff") is not None and not x.get("error")
            ok = ok and good
            parts.append(
                f"{k} resumed at step {x.get('resumed_at_step')}: max |Δloss| {x.get('max_abs_loss_diff'):.3g}"
                if good
                else f"{k} FAILED"
            )
        spread = [
            d["A_vs_D"]["max_abs_diff"]
            for d in _runs(G, "resume")
            if d["preset"] == r["preset"] and d["variant"] == r["variant"] and d.get("A_vs_D")
        ]
        rows.append(
            {
                "item": f"GPU sharded checkpoint round trip, {r['preset']} {r['variant']}{' --async-ckpt' if r.get('async_ckpt') else ''} "
                "(save_state at step 10 → load_state in a new process → steps 11..20)",
                "goal": "resumed losses = uninterrupted (bit-equal not expected on GPU)",
                "measured": "; ".join(parts)
                + (f"; two uninterrupted runs differ by up to {spread[0]:.3g}" if spread else ""),
                "ratio": "n/a",
                "met": ok,
            }
        )
    return rows


def table(G: dict) -> list[str]:
    d = G["device"]
    lines = [
        f"Device: {d.get('device_name')} (nvidia-smi: {d.get('nvidia_smi')}; compute capability {d.get('capability')}, "
        f"{d.get('multiprocessors')} SMs); torch {d.get('torch')} (CUDA {d.get('torch_cuda')}, NCCL {d.get('nccl')}), accelerate "
        f"{d.get('accelerate')}, Python {d.get('python')}; train/ of commit {str(G.get('tree_commit'))[:12]}; "
        f"measured {measured_when(G)} ({len(G.get('calls', []))} calls). bf16 8192³ matmul on this GPU: {G.get('matmul_bf16_8192_tflops')} TFLOP/s. "
        "MFU = 6 · params · tokens/s / 989.4e12 (H100 SXM dense bf16); fp32 runs also against 66.9e12 (FP32 without TF32, "
        "torch's default for matmuls). Step time: median after the first steps (excluded: 5); peak memory: "
        "torch.cuda.max_memory_allocated (train's peak_mem_mb).",
        "",
        "| preset | config | params | batch x seq | median step | tokens/s | peak mem | MFU (bf16 peak) | MFU (fp32 peak) | final save |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _runs(G, "throughput"):
        if r.get("error"):
            lines.append(f"| {r['preset']} | {r['variant']} | | | FAILED | | | | | |")
            continue
        saves = r.get("saves") or []
        save = (
            f"{saves[-1]['seconds']:.2f} s ({r['checkpoint_bytes'] / 1e9:.2f} GB)"
            if saves and r.get("checkpoint_bytes")
            else ""
        )
        fp32 = "" if r.get("mfu_fp32_peak") is None else f"{r['mfu_fp32_peak'] * 100:.0f}%"
        lines.append(
            f"| {r['preset']} | {r['variant']} | {r['params'] / 1e6:.1f}M | {r['batch_size']} x {r['seq_len']} | "
            f"{r['median_step_time_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | {r['peak_mem_mb'] / 1024:.2f} GiB | "
            f"{r['mfu_bf16_peak'] * 100:.1f}% | {fp32} | {save} |"
        )
    res = _runs(G, "resume")
    if res:
        lines += [
            "",
            "Checkpoint round trips (A: 20 steps, save_state at 10 and 20; C: `--resume` A's step 10 in a new process and run "
            "dir; B: SIGUSR2 after step 10 → checkpoint, exit 75 → `--resume auto`; D: 20 steps, no save before the end). "
            "max |Δloss| over the steps after the resume.",
            "",
            "| run | checkpoint | save (sync / async) | load | C vs A | B vs A | B vs D after resume | A vs D (no resume at all) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in res:
            a = r.get("A", {})
            saves = a.get("saves") or a.get("async_saves") or []
            loads = [
                x.get("resumed", {}).get("load_s")
                for x in (r.get("C", {}), r.get("B", {}))
                if x.get("resumed")
            ]

            def diff(x: dict | None) -> str:
                if not x:
                    return ""
                if x.get("error"):
                    return "FAILED"
                v = x.get("max_abs_loss_diff")
                return "" if v is None else ("0 (bit-equal)" if v == 0 else f"{v:.3g}")

            bd = (r.get("B") or {}).get("after_resume_vs_D")
            ad = r.get("A_vs_D")
            save_s = ", ".join(f"{x['seconds']:.2f} s" for x in saves)
            load_s = ", ".join(f"{x:.2f} s" for x in loads)
            b_vs_d = f"{bd['max_abs_diff']:.3g}" if bd else ""
            a_vs_d = f"{ad['max_abs_diff']:.3g} (first at step {ad['first_differing_step']})" if ad else ""
            lines.append(
                f"| {r['label']} | {(r.get('checkpoint_bytes') or 0) / 1e9:.2f} GB | {save_s} | {load_s} | "
                f"{diff(r.get('C'))} | {diff(r.get('B'))} | {b_vs_d} | {a_vs_d} |"
            )
    probes = [r for r in _runs(G, "probe") if not r.get("error")]
    if probes:
        lines += [
            "",
            "Step anatomy (bench/gpu_step_probe.py, torch.profiler over 5 steps after 8 warm-up, small preset, 64 x 256):",
            "",
            "| config | wall / step | GPU kernel time / step | kernels / step | kernel launches | stream waits + syncs |",
            "|---|---|---|---|---|---|",
        ]
        for r in probes:
            lines.append(
                f"| {r['variant']} ({r['distributed_type']}) | {r['wall_ms_per_step_unprofiled']} ms | {r['gpu_busy_ms_per_step']} ms | "
                f"{r['kernels_per_step']:.0f} | {r['kernel_launch_calls_per_step']:.0f} | {r['sync_or_wait_calls_per_step']:.0f} |"
            )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
