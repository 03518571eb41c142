"""Issue 34 on one GPU machine: the product path (``orchestrator submit --profile local_gpu``), one script.

Run on the device (see bench/gpu_submit_check.sh for the wheel install), results into ``--out``:
``results.json`` (every check's record, rewritten after each) and ``summary.md``. Checks, each bounded
in time (subprocess timeouts, process trees and local jobs killed), independent ones run at once:

a. ``submit --wait`` of train/ with ddp, full_shard (FSDP2), shard_grad_op, deepspeed_zero2/3, in fp32
   and bf16, through the direct launcher (profile ``local_gpu``) and through torchrun (a copy of it
   with ``launcher: torchrun``; DeepSpeed too, forked since 2026-11-29): exit, state, steps, final
   loss, world size, the device train/ reports (``self-check ok: ...; device cuda:0``), peak memory,
   how the ranks were started (node log);
b. USR2 preemption (``orchestrator cancel JOB --signal USR2``; the local job ends PREEMPTED) and
   ``orchestrator resume JOB --wait``: the step resumed from, and max |loss difference| after it
   against an uninterrupted run, fp32 and bf16; two uninterrupted runs measure the noise floor;
c. the self-check verdicts (from a.), ``orchestrator stacks JOB --json`` of a running GPU job
   (py-spy), the preflight's GPU check (``orchestrator.node.preflight.gpu_problems``) with the right
   count and one more than present (the negative control);
d. examples/trainer_cnn.py unchanged: USR2 after a complete checkpoint, resume, completed;
e. a launcher that touched CUDA before the fork (a ``sitecustomize`` on PYTHONPATH that initialises
   CUDA in every interpreter the job starts, the ranks excepted): the node log must say
   ``ranks started by torchrun (CUDA was initialized in the launcher)`` and the job complete;
g. recovery inside the allocation: train/ (ddp, full_shard) with ``--ckpt-every 50
   --memory-ckpt-every 5``, its highest rank SIGKILLed after step 60: restarted in place (the same
   launcher), resumed from the memory checkpoints, training again on the device; the seconds from the
   kill to the next trained step and, from the new ranks' ``startup`` event, to their start, to the
   model built (the CUDA context and the NCCL communicator are in it), to the restore, to the step;
f. speed, alone on the GPU: ``1b`` preset, bf16, ddp and FSDP2 full_shard, through ``submit`` and
   through plain ``accelerate launch`` of the config ``orchestrator render`` gives, median step time
   after warm-up -> tokens/s, MFU (6 * params * tokens/s / 989.4e12, H100/H200 dense bf16); and FSDP2
   bf16 without the fp32-reduce workaround (``ORCHESTRATOR_DISABLE_WORKAROUNDS=fsdp2_fp32_reduce``).
   Runs are stopped (SIGKILL) once enough steps are logged: the 12 GB final checkpoint is not waited for.

h. ``orchestrator doctor`` on a GPU profile (``runner.doctor.run_doctor``: the Slurm step's script, the
   node's part, the verdict; the device has no Slurm, so bash runs the step ``srun`` would, as one
   task of a one-node allocation): the GPU row (torch's count and names, nvidia-smi's health) passes
   with the machine's count and fails with one more (the negative control). Its NCCL all-reduce runs
   between nodes only: a one-GPU machine has no second node to reduce with.

b, g and f take their strategies from ``--resume-strategies``, ``--restart-strategies`` and
``--speed-strategies`` (issue 46: ``deepspeed_zero3`` for b and f).

``--cpu-dry-run``: the same plumbing on a CPU machine (profile ``local``, 2 ranks, tiny preset for
everything); its figures mean nothing. ``--only a,b``: just those checks. ``--budget S``: the whole
invocation's wall-clock bound (f is cut short to fit).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
T0 = time.monotonic()
PEAK_BF16 = 989.4e12  # H100 SXM dense bf16 (datasheet); H200 is the same chip
STRATEGIES = ["ddp", "full_shard", "shard_grad_op", "deepspeed_zero2", "deepspeed_zero3"]
CHECKS = "abcdefgh"


def elapsed() -> float:
    return time.monotonic() - T0


def say(line: str) -> None:
    print(f"[gsc {elapsed():6.1f}s] {line}", flush=True)


class Deadline(Exception):
    pass


# --------------------------------------------------------------------------- processes


def kill_tree(pid: int) -> None:
    try:
        import psutil

        procs = psutil.Process(pid).children(recursive=True)
    except Exception:
        procs = []
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.kill()


def run(
    argv: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO
) -> tuple[int, str, float]:
    """(exit code, stdout+stderr, seconds); 124 on timeout (the whole tree killed)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        code = 124
        out = (out or "") + f"\n[gsc] timed out after {timeout:.0f} s"
    return code, out or "", time.monotonic() - started


def poll(condition: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    return None


def tail(text: str, n: int = 1500) -> str:
    return text[-n:]


# --------------------------------------------------------------------------- the context


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.cpu = args.cpu_dry_run
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gsc-", dir=args.work_dir))
        self.budget = args.budget
        self.parallel = args.parallel or (2 if self.cpu else 6)
        self.measured = args.measured  # f: steps measured after the warm-up
        self.scale = 3.0 if self.cpu else 1.0  # CPU runs are slower: longer timeouts
        self.profile = "local" if self.cpu else "local_gpu"
        self.profiles_dir = self.work / "profiles"
        self.profiles_dir.mkdir()
        base = (REPO / "cluster_profiles" / f"{self.profile}.yaml").read_text()
        (self.profiles_dir / f"{self.profile}_torchrun.yaml").write_text(base + "\nlauncher: torchrun\n")
        self.env = dict(os.environ)
        self.env.update(
            {
                "ORCHESTRATOR_HOME": str(self.work / "home"),
                "ORCHESTRATOR_RUNS": str(self.work / "runs"),
                "ORCHESTRATOR_CACHE_DIR": str(self.work / "cache"),
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p),
            }
        )
        self.env.pop("ORCHESTRATOR_DISABLE_WORKAROUNDS", None)
        self.env.pop("ACCELERATE_USE_CPU", None)
        self.procs = ["--procs-per-node", "2"] if self.cpu else []  # GPU: one rank per GPU found
        self.results: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.jobs: set[str] = set()

    def left(self) -> float:
        return self.budget - elapsed()

    def record(self, rec: dict[str, Any]) -> None:
        with self.lock:
            self.results.append(rec)
            write_json(self.out / "results.json", {"meta": self.meta, "checks": self.results})
            (self.out / "summary.md").write_text(summary_md(self.meta, self.results))

    meta: dict[str, Any] = {}

    def cli(self, args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
        code, out, _ = run([PY, "-m", "orchestrator", *args], timeout, env or self.env)
        return code, out

    def kill_job(self, job: str) -> None:
        self.cli(["cancel", job, "--signal", "KILL"], 30)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- a job's files


def job_and_run_dir(out: str) -> tuple[str | None, Path | None]:
    job = re.search(r"submitted job (\S+)", out)
    run_dir = re.search(r"run directory (\S+)", out)
    return (job.group(1) if job else None), (Path(run_dir.group(1)) if run_dir else None)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def job_ended(run_dir: Path) -> bool:
    """A local job writes local_state.json when it ends (any outcome)."""
    return (run_dir / "local_state.json").is_file()


def trains(run_dir: Path) -> list[dict[str, Any]]:
    return [m for m in metrics(run_dir) if m.get("event") == "train"]


def node_logs(run_dir: Path) -> str:
    texts = []
    for path in sorted((run_dir / "logs").glob("attempt_*/node_*.log")):
        with contextlib.suppress(OSError):
            texts.append(f"== {path.relative_to(run_dir)}\n" + path.read_text(errors="replace"))
    return "\n".join(texts)


def describe_run(run_dir: Path | None) -> dict[str, Any]:
    if run_dir is None:
        return {}
    steps = trains(run_dir)
    last = steps[-1] if steps else {}
    logs = node_logs(run_dir)
    launch = re.findall(r"ranks started by torchrun \(([^)]*)\)", logs)
    fork = re.findall(r"started (\d+) rank\(s\) by fork", logs)
    check = [ln.split("]:", 1)[-1].strip() for ln in logs.splitlines() if "self-check" in ln]
    device = re.findall(r"; device (\S+?)[;\s]", logs + " ")
    final = {}
    with contextlib.suppress(OSError, ValueError):
        final = json.loads((run_dir / "final.json").read_text())
    return {
        "run_dir": str(run_dir),
        "steps": last.get("step"),
        "final_loss": final.get("loss", last.get("loss")),
        "world_size": last.get("world_size"),
        "strategy_ran": last.get("strategy"),
        "peak_mem_mb": last.get("peak_mem_mb"),
        "device": device[0] if device else None,
        "launch": "fork" if fork and not launch else ("torchrun: " + launch[0] if launch else None),
        "self_check": check[0][:400] if check else None,
        "nccl_or_errors": [ln[:300] for ln in logs.splitlines() if "Error" in ln or "error:" in ln][:5],
    }


# --------------------------------------------------------------------------- checks


def train_args(ctx: Ctx, steps: int, extra: list[str] | None = None) -> list[str]:
    return [
        str(REPO / "train" / "train.py"), "--preset", "tiny", "--data", "synthetic", "--max-steps", str(steps),
        "--log-every", "1", "--eval-every", "0", *(extra or []),
    ]  # fmt: skip


def submit(
    ctx: Ctx,
    strategy: str,
    precision: str,
    script_args: list[str],
    launcher: str = "direct",
    wait: bool = True,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    profile = ctx.profile if launcher == "direct" else f"{ctx.profile}_torchrun"
    args = ["submit", "--profile", profile, "--profiles-dir", str(ctx.profiles_dir), "--strategy", strategy,
            "--mixed-precision", precision, *ctx.procs, *(extra or [])]  # fmt: skip
    if wait:
        args += ["--wait", "--poll", "0.5"]
    code, out = ctx.cli([*args, "--", *script_args], timeout * ctx.scale, env)
    job, run_dir = job_and_run_dir(out)
    if job:
        ctx.jobs.add(job)
    if code == 124 and job:
        ctx.kill_job(job)
    return {"exit": code, "job": job, "run_dir": run_dir, "out": out}


def check_a_one(ctx: Ctx, strategy: str, precision: str, launcher: str) -> dict[str, Any]:
    res = submit(ctx, strategy, precision, train_args(ctx, 30), launcher=launcher, timeout=240)
    rec = {"exit": res["exit"], "job": res["job"], **describe_run(res["run_dir"])}
    ok = res["exit"] == 0 and rec.get("steps") == 30
    if not ctx.cpu:
        ok = ok and str(rec.get("device", "")).startswith("cuda")
    want_fork = launcher == "direct"  # DeepSpeed's ranks too, since 5724e02
    if want_fork and not ctx.cpu:
        ok = ok and rec.get("launch") == "fork"
    rec["ok"] = bool(ok)
    if not ok:
        rec["out_tail"] = tail(res["out"])
        if res["run_dir"]:
            rec["log_tail"] = tail(node_logs(res["run_dir"]), 3000)
    return rec


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs the steps after its checkpoint again)."""
    return {int(m["step"]): float(m["loss"]) for m in trains(run_dir)}


def check_b_one(ctx: Ctx, precision: str, strategy: str = "full_shard") -> dict[str, Any]:
    """USR2 at step >= 40, resume, compare with two uninterrupted runs (same seed, same max steps)."""
    steps, signal_at = (120, 20) if ctx.cpu else (1500, 40)
    rec: dict[str, Any] = {"precision": precision, "strategy": strategy, "max_steps": steps}
    pre = submit(ctx, strategy, precision, train_args(ctx, steps), wait=False, timeout=60)
    job, run_dir = pre["job"], pre["run_dir"]
    if not job or run_dir is None:
        return {**rec, "ok": False, "problem": "submit failed", "out_tail": tail(pre["out"])}
    refs = [
        submit(ctx, strategy, precision, train_args(ctx, steps), wait=False, timeout=60) for _ in range(2)
    ]
    at = poll(
        lambda: (
            ((t := trains(run_dir)) and t[-1]["step"] >= signal_at and t[-1]["step"]) or job_ended(run_dir)
        ),
        120 * ctx.scale,
        0.05,
    )
    at = None if at is True else at
    if not at:
        ctx.kill_job(job)
        return {
            **rec,
            "ok": False,
            "problem": f"no step {signal_at} within the time",
            "log_tail": tail(node_logs(run_dir)),
        }
    code, out = ctx.cli(["cancel", job, "--signal", "USR2"], 30)
    rec["signalled_at_step"] = at
    rec["cancel"] = out.strip()[:200]
    code, out = ctx.cli(["wait", job, "--timeout", str(int(90 * ctx.scale))], 100 * ctx.scale)
    code_s, status = ctx.cli(["status", job, "--json"], 30)
    with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
        data = json.loads(status)
        rows = data if isinstance(data, list) else data.get("jobs", [data])
        rec["state_after_signal"] = rows[0].get("state")
    code, out = ctx.cli(["resume", job, "--wait", "--poll", "0.5"], 300 * ctx.scale)
    new, _ = job_and_run_dir(out)
    if new:
        ctx.jobs.add(new)
    rec["resume_exit"] = code
    for ref in refs:  # they ran meanwhile
        if ref["job"]:
            ref["exit"], _ = ctx.cli(
                ["wait", ref["job"], "--timeout", str(int(120 * ctx.scale))], 130 * ctx.scale
            )
    resumes = [m for m in metrics(run_dir) if m.get("event") == "resume"]
    rec["resumed_from_step"] = resumes[-1]["step"] if resumes else None
    mine = losses_by_step(run_dir)
    others = [losses_by_step(r["run_dir"]) for r in refs if r["run_dir"] is not None and r["exit"] == 0]
    rec["reference_exits"] = [r["exit"] for r in refs]
    if rec["resumed_from_step"] is not None and others:
        after = [s for s in mine if s > rec["resumed_from_step"] and s in others[0]]
        rec["compared_steps"] = len(after)
        rec["max_abs_dloss_vs_uninterrupted"] = max(
            (abs(mine[s] - others[0][s]) for s in after), default=None
        )
        if len(others) == 2:
            common = [s for s in others[0] if s in others[1]]
            rec["max_abs_dloss_two_uninterrupted"] = max(
                (abs(others[0][s] - others[1][s]) for s in common), default=None
            )
            rec["max_abs_dloss_two_uninterrupted_after_resume_step"] = max(
                (abs(others[0][s] - others[1][s]) for s in after), default=None
            )
    rec.update(describe_run(run_dir))
    rec["ok"] = bool(
        code == 0
        and rec["resumed_from_step"]
        and rec.get("steps") == steps
        and rec.get("max_abs_dloss_vs_uninterrupted") is not None
    )
    if not rec["ok"]:
        rec["out_tail"] = tail(out)
        rec["log_tail"] = tail(node_logs(run_dir), 3000)
    return rec


def check_c_stacks(ctx: Ctx) -> dict[str, Any]:
    res = submit(ctx, "full_shard", "bf16", train_args(ctx, 100000), wait=False, timeout=60)
    job, run_dir = res["job"], res["run_dir"]
    if not job or run_dir is None:
        return {"ok": False, "problem": "submit failed", "out_tail": tail(res["out"])}
    try:
        started = poll(lambda: trains(run_dir) or job_ended(run_dir), 120 * ctx.scale)
        if not started or not trains(run_dir):
            return {"ok": False, "problem": "no training step", "log_tail": tail(node_logs(run_dir))}
        code, out = ctx.cli(["stacks", job, "--json"], 90)
        rec: dict[str, Any] = {"stacks_exit": code}
        try:
            data = json.loads(out[out.index("{") :])
            rec["stacks"] = json.dumps(data)[:3000]
            text = json.dumps(data)
            rec["mentions_train_py"] = "train.py" in text or "train/" in text
        except ValueError:
            rec["stacks_output"] = tail(out, 3000)
            rec["mentions_train_py"] = "train.py" in out
        rec["ok"] = code == 0 and rec["mentions_train_py"]
        rec.update(
            {k: v for k, v in describe_run(run_dir).items() if k in ("device", "launch", "self_check")}
        )
        return rec
    finally:
        ctx.kill_job(job)


def check_c_preflight(ctx: Ctx) -> dict[str, Any]:
    code = (
        "import json; from orchestrator.config.gpus import count_gpus; from orchestrator.node.preflight import "
        "gpu_problems; n = count_gpus(); print(json.dumps({'count': n.count, 'source': n.source, "
        "'expected_n': gpu_problems(max(n.count, 1)), 'expected_n_plus_1': gpu_problems(n.count + 1)}))"
    )
    rc, out, _ = run([PY, "-c", code], 60, ctx.env)
    rec: dict[str, Any] = {"exit": rc}
    try:
        rec.update(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        rec["out"] = tail(out)
        rec["ok"] = False
        return rec
    if ctx.cpu:
        rec["ok"] = rc == 0  # no nvidia-smi here: it says so
    else:
        rec["ok"] = rec["count"] >= 1 and rec["expected_n"] == [] and bool(rec["expected_n_plus_1"])
    return rec


def check_d(ctx: Ctx) -> dict[str, Any]:
    out_dir = ctx.work / "trainer_out"
    steps = 400 if ctx.cpu else 3000
    args = [str(REPO / "examples" / "trainer_cnn.py"), "--output-dir", str(out_dir), "--max-steps", str(steps),
            "--save-steps", "50" if ctx.cpu else "200", "--logging-steps", "10"]  # fmt: skip
    res = submit(ctx, "ddp", "no", args, wait=False, timeout=60)
    job, run_dir = res["job"], res["run_dir"]
    rec: dict[str, Any] = {"max_steps": steps}
    if not job or run_dir is None:
        return {**rec, "ok": False, "problem": "submit failed", "out_tail": tail(res["out"])}
    done = poll(
        lambda: list(out_dir.glob("checkpoint-*/COMPLETE.json")) or job_ended(run_dir), 180 * ctx.scale, 0.1
    )
    if done is True or not done:
        ctx.kill_job(job)
        return {
            **rec,
            "ok": False,
            "problem": "no complete checkpoint",
            "log_tail": tail(node_logs(run_dir), 3000),
        }
    rec["checkpoint_before_signal"] = sorted(p.parent.name for p in done)
    ctx.cli(["cancel", job, "--signal", "USR2"], 30)
    code, out = ctx.cli(["wait", job, "--timeout", str(int(90 * ctx.scale))], 100 * ctx.scale)
    rec["wait_after_signal_exit"] = code
    rec["checkpoints_after_signal"] = sorted(
        p.parent.name for p in out_dir.glob("checkpoint-*/COMPLETE.json")
    )
    code, out = ctx.cli(["resume", job, "--wait", "--poll", "0.5"], 300 * ctx.scale)
    new, _ = job_and_run_dir(out)
    if new:
        ctx.jobs.add(new)
    rec["resume_exit"] = code
    starts = {}
    for path in sorted((run_dir / "logs").glob("attempt_*/start.json")):
        with contextlib.suppress(OSError, ValueError):
            starts[path.parent.name] = json.loads(path.read_text())
    rec["attempt_starts"] = starts
    logs = node_logs(run_dir)
    rec["attempt_lines"] = [ln for ln in logs.splitlines() if "[orchestrator node] attempt" in ln][:4]
    rec["self_check"] = [
        ln.split("]:", 1)[-1].strip()[:300] for ln in logs.splitlines() if "self-check" in ln
    ][:2]
    rec["device"] = (re.findall(r"; device (\S+)", logs) or [None])[0]
    resumed = [s for s in starts.values() if isinstance(s, dict) and s.get("step")]
    rec["resumed_from_step"] = resumed[-1]["step"] if resumed else None
    rec["ok"] = bool(code == 0 and rec["resumed_from_step"])
    if not ctx.cpu:
        rec["ok"] = rec["ok"] and str(rec["device"]).startswith("cuda")
    if not rec["ok"]:
        rec["out_tail"] = tail(out)
        rec["log_tail"] = tail(logs, 3000)
    return rec


SITECUSTOMIZE = """\
import os
if os.environ.get("GSC_TOUCH_CUDA") == "1":
    try:
        import torch
        torch.cuda.init()
        torch.zeros(1, device="cuda")
    except Exception as exc:  # CPU dry run: nothing to touch
        os.environ["GSC_TOUCH_CUDA_FAILED"] = repr(exc)[:200]
"""


def check_e(ctx: Ctx) -> dict[str, Any]:
    folder = ctx.work / "touch_cuda"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(ctx.env)
    env["GSC_TOUCH_CUDA"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    res = submit(ctx, "ddp", "no", train_args(ctx, 20), timeout=240, env=env)
    rec = {"exit": res["exit"], "job": res["job"], **describe_run(res["run_dir"])}
    logs = node_logs(res["run_dir"]) if res["run_dir"] else ""
    rec["launcher_lines"] = [ln for ln in logs.splitlines() if "[orchestrator launch]" in ln][:3]
    if ctx.cpu:
        rec["ok"] = res["exit"] == 0  # no CUDA to touch: the plumbing only (ranks forked)
    else:
        rec["ok"] = res["exit"] == 0 and "CUDA was initialized in the launcher" in str(rec.get("launch"))
    if not rec["ok"]:
        rec["out_tail"] = tail(res["out"])
        rec["log_tail"] = tail(logs, 3000)
    return rec


# --------------------------------------------------------------------------- g: a kill, restarted in place


def check_g_one(ctx: Ctx, strategy: str) -> dict[str, Any]:
    from orchestrator.contract.heartbeat import read_heartbeats
    from orchestrator.contract.restarts import read_restarts
    from orchestrator.contract.run_dir import attempt_dirs

    args = train_args(ctx, 100000, ["--ckpt-every", "50", "--memory-ckpt-every", "5"])
    res = submit(ctx, strategy, "no", args, wait=False, timeout=60)
    job, run_dir = res["job"], res["run_dir"]
    if not job or run_dir is None:
        return {"ok": False, "problem": "submit failed", "out_tail": tail(res["out"])}
    rec: dict[str, Any] = {"job": job, "strategy": strategy}
    try:
        if not poll(lambda: len(trains(run_dir)) >= 60, 240 * ctx.scale, 0.2):
            return {
                **rec,
                "ok": False,
                "problem": "not at step 60",
                "log_tail": tail(node_logs(run_dir), 3000),
            }
        beats = read_heartbeats(attempt_dirs(run_dir)[-1][1])
        rank = max(beats)
        os.kill(int(beats[rank]["pid"]), signal.SIGKILL)
        at = time.time()
        back = poll(
            lambda: [m for m in trains(run_dir) if m["time"] > at + 0.5 and m.get("step", 0) > 0], 120, 0.1
        )
        events = [m for m in metrics(run_dir) if m.get("time", 0) > at]
        startup = next((m for m in events if m.get("event") == "startup"), {})
        resume = next((m for m in events if m.get("event") == "resume"), {})
        restarts = read_restarts(run_dir)
        start = {}
        with contextlib.suppress(OSError, ValueError):
            start = json.loads((attempt_dirs(run_dir)[-1][1] / "start.json").read_text())
        first = back[0] if back else {}
        rec.update(
            killed_rank=rank,
            restarts=[{k: r.get(k) for k in ("in_place", "step", "cause")} for r in restarts],
            resumed_from_step=start.get("step"),
            from_memory=start.get("memory") is True,
            kill_to_step_s=round(first["time"] - at, 2) if first else None,
            phases_s={
                "to the ranks' start": round(startup["process"] - at, 2) if startup.get("process") else None,
                "to the model built": round(startup["model"] - at, 2) if startup.get("model") else None,
                "to restored": round(resume["time"] - at, 2) if resume else None,
            },
            **{k: v for k, v in describe_run(run_dir).items() if k in ("device", "launch", "world_size")},
        )
        # DeepSpeed keeps no memory checkpoints (its engine's partitions): it restarts from the shared one.
        from_memory = not strategy.startswith("deepspeed")
        ok = bool(first) and len(restarts) == 1 and restarts[0].get("in_place") is True
        ok = ok and rec["from_memory"] is from_memory and bool(start.get("step"))
        if not ctx.cpu:
            ok = ok and str(rec.get("device", "")).startswith("cuda")
        rec["ok"] = ok
        if not ok:
            rec["log_tail"] = tail(node_logs(run_dir), 3000)
        return rec
    finally:
        ctx.kill_job(job)


# --------------------------------------------------------------------------- f: speed


def speed_args(ctx: Ctx, run_dir: Path | None = None) -> list[str]:
    preset, batch, seq = ("tiny", "4", "64") if ctx.cpu else ("1b", "8", "1024")
    args = [str(REPO / "train" / "train.py"), "--preset", preset, "--data", "synthetic", "--batch-size", batch,
            "--seq-len", seq, "--max-steps", "100000", "--log-every", "1", "--eval-every", "0"]  # fmt: skip
    return args + (["--run-dir", str(run_dir)] if run_dir else [])


WARMUP, MEASURED = 5, 15  # MEASURED: --measured's default


def step_figures(run_dir: Path) -> dict[str, Any]:
    t = trains(run_dir)[WARMUP:]
    if not t:
        return {}
    med = statistics.median(m["step_time_s"] for m in t)
    tokens_per_step = t[0]["tokens_per_s"] * t[0]["step_time_s"]
    return {
        "measured_steps": len(t),
        "step_times_s": [round(m["step_time_s"], 4) for m in t],
        "median_step_s": round(med, 5),
        "tokens_per_s": round(tokens_per_step / med, 1),
        "peak_mem_mb": t[-1].get("peak_mem_mb"),
        "last_loss": t[-1].get("loss"),
        "world_size": t[-1].get("world_size"),
    }


def params_of(run_dir: Path) -> float | None:
    m = re.search(r"([\d.]+)M parameters", node_logs(run_dir) + _plain_log(run_dir))
    return float(m.group(1)) * 1e6 if m else None


def _plain_log(run_dir: Path) -> str:
    with contextlib.suppress(OSError):
        return (run_dir / "gsc_launch.log").read_text(errors="replace")
    return ""


def speed_submit(ctx: Ctx, strategy: str, disable: str = "") -> dict[str, Any]:
    env = dict(ctx.env)
    if disable:
        env["ORCHESTRATOR_DISABLE_WORKAROUNDS"] = disable
    extra = ["--wrap-cls", "TransformerBlock"] if strategy == "full_shard" else []
    res = submit(ctx, strategy, "bf16", speed_args(ctx), wait=False, timeout=60, env=env, extra=extra)
    job, run_dir = res["job"], res["run_dir"]
    if not job or run_dir is None:
        return {"ok": False, "problem": "submit failed", "out_tail": tail(res["out"])}
    t0 = time.monotonic()
    try:
        got = poll(
            lambda: len(trains(run_dir)) >= WARMUP + ctx.measured or job_ended(run_dir),
            min(240 * ctx.scale, ctx.left() - 20),
            0.5,
        )
        got = len(trains(run_dir)) >= WARMUP + ctx.measured
    finally:
        ctx.kill_job(job)
    rec: dict[str, Any] = {
        "path": "orchestrator submit",
        "strategy": strategy,
        "job": job,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    rec.update(step_figures(run_dir))
    rec.update({k: v for k, v in describe_run(run_dir).items() if k in ("device", "launch", "self_check")})
    rec["params"] = params_of(run_dir)
    rec["ok"] = bool(got)
    if not got:
        rec["log_tail"] = tail(node_logs(run_dir), 3000)
    return rec


def speed_plain(ctx: Ctx, strategy: str) -> dict[str, Any]:
    """``accelerate launch --config_file <render> train/train.py ...`` with none of the node's machinery."""
    folder = ctx.work / f"render_{strategy}"
    extra = ["--wrap-cls", "TransformerBlock"] if strategy == "full_shard" else []
    code, out = ctx.cli(["render", "--profile", ctx.profile, "--strategy", strategy, "--mixed-precision", "bf16",
                         *ctx.procs, *extra, "--out", str(folder), "--", *speed_args(ctx)], 60)  # fmt: skip
    config = folder / "accelerate_config.node0.yaml"
    if code != 0 or not config.is_file():
        return {"ok": False, "problem": "render failed", "out_tail": tail(out)}
    run_dir = Path(tempfile.mkdtemp(prefix=f"plain_{strategy}_", dir=ctx.work))
    env = dict(ctx.env)
    if ctx.cpu and strategy.startswith("deepspeed"):  # what the rendered config's comment says
        from orchestrator.node.site_path import NODE_SITE_DIR

        env.update(
            OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([NODE_SITE_DIR, env.get("PYTHONPATH", "")])
        )
    elif ctx.cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    argv = [PY, "-m", "accelerate.commands.launch", "--config_file", str(config), *speed_args(ctx, run_dir)]
    t0 = time.monotonic()
    with open(run_dir / "gsc_launch.log", "w") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            got = poll(
                lambda: len(trains(run_dir)) >= WARMUP + ctx.measured or proc.poll() is not None,
                min(240 * ctx.scale, ctx.left() - 20),
                0.5,
            )
        finally:
            kill_tree(proc.pid)
            proc.wait()
    rec: dict[str, Any] = {
        "path": "accelerate launch",
        "strategy": strategy,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    rec.update(step_figures(run_dir))
    rec["params"] = params_of(run_dir)
    text = _plain_log(run_dir)
    dev = re.findall(r"; device (\S+?);", text)
    rec["device"] = dev[0] if dev else None
    rec["ok"] = bool(got) and len(trains(run_dir)) >= WARMUP + ctx.measured
    if not rec["ok"]:
        rec["log_tail"] = tail(text, 3000)
    return rec


def mfu(rec: dict[str, Any]) -> float | None:
    if not rec.get("params") or not rec.get("tokens_per_s"):
        return None
    return round(6 * rec["params"] * rec["tokens_per_s"] / PEAK_BF16, 4)


def check_f(ctx: Ctx, strategies: list[str]) -> None:
    """Sequential, alone on the GPU: submit vs plain per strategy (FSDP2 also without the fix), then
    the first strategy's pair again (the noise between two runs of the same thing)."""
    plan: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for strategy in strategies:
        plan.append((f"f {strategy} submit", functools.partial(speed_submit, ctx, strategy)))
        plan.append((f"f {strategy} accelerate", functools.partial(speed_plain, ctx, strategy)))
        if strategy == "full_shard":
            plan.append(("f full_shard submit no-fp32-reduce",
                         functools.partial(speed_submit, ctx, "full_shard", "fsdp2_fp32_reduce")))  # fmt: skip
    if strategies:  # the second pair in the other order (A B B A): a drift over the call cancels out
        first = strategies[0]
        plan.append((f"f {first} accelerate (repeat)", functools.partial(speed_plain, ctx, first)))
        plan.append((f"f {first} submit (repeat)", functools.partial(speed_submit, ctx, first)))
    done: dict[str, dict[str, Any]] = {}
    for name, fn in plan:
        need = 25 if ctx.cpu else (75 if "deepspeed" in name else 55)
        if ctx.left() < need:
            ctx.record({"check": name, "ok": None, "skipped": f"budget: {ctx.left():.0f} s left"})
            say(f"{name}: skipped (budget)")
            continue
        rec = guarded(name, fn)
        rec["mfu"] = mfu(rec)
        done[name] = rec
        ctx.record(rec)
        say(f"{name}: {'ok' if rec.get('ok') else 'FAILED'} median {rec.get('median_step_s')} s "
            f"{rec.get('tokens_per_s')} tok/s MFU {rec.get('mfu')}")  # fmt: skip

    def ratio(a: str, b: str) -> float | None:
        x, y = done.get(a, {}).get("tokens_per_s"), done.get(b, {}).get("tokens_per_s")
        return round(x / y, 4) if x and y else None

    ratios: dict[str, Any] = {"check": "f ratios", "ok": True}
    for strategy in strategies:
        ratios[f"{strategy} submit/accelerate"] = ratio(f"f {strategy} submit", f"f {strategy} accelerate")
        ratios[f"{strategy} submit/accelerate (repeat)"] = ratio(
            f"f {strategy} submit (repeat)", f"f {strategy} accelerate (repeat)"
        )
    if "full_shard" in strategies:
        ratios["full_shard fp32-reduce/bf16-reduce (submit)"] = ratio(
            "f full_shard submit", "f full_shard submit no-fp32-reduce"
        )
    ctx.record({k: v for k, v in ratios.items() if v is not None})


# --------------------------------------------------------------------------- h: doctor


def doctor_one_task(profile: str, profiles_dir: str) -> None:
    """``orchestrator doctor``'s own code (:func:`orchestrator.runner.doctor.run_doctor`: the Slurm
    step's script, the node's part, the verdict) on this machine as a one-node allocation. The device
    has no Slurm: the step that ``srun`` would run is run by bash, with the variables a one-node
    step's task has. Prints the result as JSON."""
    import shlex
    import socket

    import orchestrator.runner.doctor as runner_doctor
    from orchestrator.remote.routing import version
    from orchestrator.schedulers import get_scheduler

    class OneTaskStep:
        def __init__(self, name: str) -> None:
            self.real = get_scheduler(name)

        def doctor_step(self, profile: Any, nodes: int, script: str) -> list[str]:
            argv = self.real.doctor_step(profile, nodes, script)
            body = argv[argv.index("bash") + 2]  # the product's task script (srun's preamble in it)
            host = socket.gethostname()
            task = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0",
                    "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
                    "SLURM_JOB_NODELIST": host, "SLURM_STEP_NODELIST": host, "SLURMD_NODENAME": host}  # fmt: skip
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in task.items())
            return [
                "bash",
                "-c",
                f"export {exports}; bash -c {shlex.quote(body)} doctor 2>&1 | sed -u 's/^/0: /'",
            ]

    runner_doctor.get_scheduler = OneTaskStep  # type: ignore[assignment]
    result = runner_doctor.run_doctor(profile, version(), None, profiles_dir, timeout_s=120)
    print(json.dumps(result.as_json(), default=str))


def check_h_doctor(ctx: Ctx, gpus: int) -> dict[str, Any]:
    """The doctor on a GPU profile of this machine's GPU count (its GPU row: seen, health) and of one
    more (the negative control: the row must fail with the count)."""
    name = f"gpu_node_{gpus}"
    (ctx.profiles_dir / f"{name}.yaml").write_text(
        f"description: this machine as one Slurm node ({gpus} GPU(s))\nscheduler: slurm\npartition: gpu\n"
        f'time_limit: "00:30:00"\nnodes: {{default: 1, max: 1}}\ngpus_per_node: {gpus}\ncpus_per_task: 1\n'
    )
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import gpu_submit_check as g; "
        f"g.doctor_one_task({name!r}, {str(ctx.profiles_dir)!r})"
    )
    rc, out, seconds = run([PY, "-c", code], 180, ctx.env)
    rec: dict[str, Any] = {"gpus_per_node": gpus, "exit": rc}
    try:
        data = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {**rec, "ok": False, "out_tail": tail(out, 3000)}
    rows = data.get("rows") or []
    rec["rows"] = [{k: r.get(k) for k in ("check", "ok", "value", "fix")} for r in rows]
    rec["doctor_ok"] = data.get("ok")
    rec["doctor_seconds"] = data.get("seconds")
    gpu = [r for r in rows if r.get("check") == "GPUs"]
    rec["gpu_row"] = gpu[0] if gpu else None
    return rec


def check_h(ctx: Ctx) -> dict[str, Any]:
    from orchestrator.config.gpus import count_gpus

    seen = count_gpus().count
    right = check_h_doctor(ctx, seen if ctx.cpu else max(seen, 1))
    wrong = check_h_doctor(ctx, seen + 1)
    rec = {"gpus_counted": seen, "right_count": right, "one_more": wrong}
    right_row, wrong_row = right.get("gpu_row") or {}, wrong.get("gpu_row") or {}
    rec["ok"] = bool(right_row.get("ok") is True and wrong_row.get("ok") is False)
    if not ctx.cpu:
        rec["ok"] = rec["ok"] and "H" in str(right_row.get("value"))
    return rec


# --------------------------------------------------------------------------- driver


def guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.monotonic()
    say(f"{name}: start")
    try:
        rec = fn()
    except Exception as exc:  # a check's own bug must not stop the others
        import traceback

        rec = {
            "ok": False,
            "problem": f"{type(exc).__name__}: {exc}",
            "traceback": tail(traceback.format_exc(), 2000),
        }
    rec = {"check": name, **rec, "seconds": round(time.monotonic() - started, 1)}
    return rec


def run_parallel(ctx: Ctx, tasks: list[tuple[str, Callable[[], dict[str, Any]]]]) -> None:
    with concurrent.futures.ThreadPoolExecutor(ctx.parallel) as pool:
        futures = {pool.submit(guarded, name, fn): name for name, fn in tasks}
        for fut in concurrent.futures.as_completed(futures):
            rec = fut.result()
            ctx.record(rec)
            brief = {
                k: rec.get(k)
                for k in ("exit", "steps", "final_loss", "world_size", "device", "launch")
                if rec.get(k) is not None
            }
            say(f"{rec['check']}: {'ok' if rec.get('ok') else 'FAILED'} in {rec['seconds']} s {brief}")


def environment(ctx: Ctx) -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "host": platform.node(), "cpu_dry_run": ctx.cpu}
    code = (
        "import json, torch, accelerate, transformers; d = {'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'accelerate': accelerate.__version__, 'transformers': transformers.__version__}\n"
        "try:\n import deepspeed; d['deepspeed'] = deepspeed.__version__\n"
        "except Exception as e: d['deepspeed'] = 'import failed: ' + repr(e)[:300]\n"
        "for m in ('submitit', 'pydantic', 'setproctitle', 'pynvml'):\n"
        " try: __import__(m); d[m] = 'ok'\n except Exception as e: d[m] = repr(e)[:200]\n"
        "print(json.dumps(d))"
    )
    rc, out, _ = run([PY, "-c", code], 120, ctx.env)
    with contextlib.suppress(ValueError, IndexError):
        info.update(json.loads(out.strip().splitlines()[-1]))
    if rc != 0:
        info["versions_error"] = tail(out, 1500)
    if shutil.which("nvidia-smi"):
        rc, out, _ = run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,compute_mode",
                "--format=csv,noheader",
            ],
            30,
        )
        info["gpus"] = out.strip().splitlines()
    spy = shutil.which("py-spy", path=ctx.env.get("PATH"))
    info["py_spy"] = run([spy, "--version"], 30, ctx.env)[1].strip()[:100] if spy else "not on PATH"
    return info


def summary_md(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = ["# gpu_submit_check", "", "```", json.dumps(meta, indent=1, default=str)[:3000], "```", ""]
    lines += [
        "| check | ok | s | exit | steps | loss | world | device | launch | figures |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        figures = {k: r[k] for k in ("resumed_from_step", "kill_to_step_s", "phases_s",
                                     "max_abs_dloss_vs_uninterrupted", "max_abs_dloss_two_uninterrupted",
                                     "median_step_s", "tokens_per_s", "mfu", "problem", "skipped", "count",
                                     "ddp submit/accelerate", "full_shard submit/accelerate",
                                     "full_shard fp32-reduce/bf16-reduce (submit)") if r.get(k) is not None}  # fmt: skip
        lines.append(
            f"| {r.get('check')} | {r.get('ok')} | {r.get('seconds', '')} | {r.get('exit', r.get('resume_exit', ''))} | "
            f"{r.get('steps', '')} | {r.get('final_loss', '')} | {r.get('world_size', '')} | {r.get('device', '')} | "
            f"{r.get('launch', '')} | {json.dumps(figures, default=str)[:400]} |"
        )
    lines += ["", "Self-check lines:", ""]
    lines += [f"- {r.get('check')}: {r.get('self_check')}" for r in results if r.get("self_check")]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results.json and summary.md go here")
    p.add_argument("--cpu-dry-run", action="store_true")
    p.add_argument("--only", default=CHECKS, help="checks to run, e.g. a,b (default: all of a-h)")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for the whole invocation")
    p.add_argument("--parallel", type=int, default=0, help="concurrent checks (default 6 on GPU, 2 on CPU)")
    p.add_argument("--work-dir", default=None, help="where runs go (default: the system temp dir)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="a's strategies")
    p.add_argument("--resume-strategies", default="full_shard", help="b's strategies")
    p.add_argument("--restart-strategies", default="ddp,full_shard", help="g's strategies")
    p.add_argument("--speed-strategies", default="ddp,full_shard", help="f's strategies")
    p.add_argument("--measured", type=int, default=MEASURED, help="f: steps measured after the warm-up")
    args = p.parse_args()
    only = {c for c in args.only.replace(",", "") if c in CHECKS}
    ctx = Ctx(args)
    ctx.meta = environment(ctx)
    ctx.meta["only"] = "".join(sorted(only))
    say(
        f"work dir {ctx.work}; out {ctx.out}; versions {json.dumps({k: ctx.meta.get(k) for k in ('torch', 'accelerate', 'deepspeed', 'transformers')})}"
    )
    ctx.record(
        {"check": "environment", "ok": "import failed" not in str(ctx.meta.get("deepspeed")), **ctx.meta}
    )
    strategies = [s for s in args.strategies.split(",") if s]
    tasks: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if "b" in only:  # longest first
        for strategy in [s for s in args.resume_strategies.split(",") if s]:
            for precision in ("no", "bf16"):
                tasks.append(
                    (f"b preempt-resume {strategy} {precision}",
                     functools.partial(check_b_one, ctx, precision, strategy))
                )  # fmt: skip
    if "h" in only:
        tasks.append(("h doctor", lambda: check_h(ctx)))
    if "d" in only:
        tasks.append(("d trainer_cnn preempt-resume", lambda: check_d(ctx)))
    if "c" in only:
        tasks.append(("c stacks", lambda: check_c_stacks(ctx)))
        tasks.append(("c preflight gpu", lambda: check_c_preflight(ctx)))
    if "e" in only:
        tasks.append(("e cuda-touched launcher", lambda: check_e(ctx)))
    if "g" in only:
        for strategy in [s for s in args.restart_strategies.split(",") if s]:
            tasks.append((f"g restart in place {strategy}", functools.partial(check_g_one, ctx, strategy)))
    if "a" in only:
        for strategy in strategies:
            for precision in ("no", "bf16"):
                for launcher in ("direct", "torchrun"):
                    tasks.append(
                        (f"a {strategy} {precision} {launcher}",
                         functools.partial(check_a_one, ctx, strategy, precision, launcher))
                    )  # fmt: skip
    try:
        if tasks:
            run_parallel(ctx, tasks)
        if "f" in only:
            check_f(ctx, [s for s in args.speed_strategies.split(",") if s])
    finally:
        for job in sorted(ctx.jobs):  # nothing left running on the GPU
            with contextlib.suppress(Exception):
                run([PY, "-m", "orchestrator", "cancel", job, "--signal", "KILL"], 20, ctx.env)
    bad = [r["check"] for r in ctx.results if r.get("ok") is False]
    say(f"done: {len(ctx.results)} records, {len(bad)} failed: {bad}; {ctx.out / 'summary.md'}")
    if not os.environ.get("GSC_KEEP"):
        shutil.rmtree(ctx.work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
