"""Why did ranks started through ``orchestrator submit --profile local_gpu`` train on CPU (issue 34, first
device run)? One short run on the GPU machine: where CUDA is and is not available, and what the launcher's
"driver loaded" check sees.

* ``env``: CUDA availability in this interpreter, and the variables that steer CUDA;
* ``launcher``: the prewarmed launcher's imports (with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), step by
  step: is ``libcuda`` mapped, and does the driver say it was initialised (``cuCtxGetCurrent`` answers
  ``CUDA_ERROR_NOT_INITIALIZED`` = 3 before ``cuInit``; calling it initialises nothing); then a forked
  child uses CUDA (a matmul): whether forking after those imports is safe;
* ``probe``: a script printing its environment's CUDA view, run as ``python3``, through ``torchrun``,
  through ``accelerate launch`` of the rendered ``local_gpu`` config, and through ``orchestrator submit``.

``python bench/gpu_diag.py OUT_DIR`` writes ``OUT_DIR/gpu_diag.json`` and prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STEER = ("CUDA", "NVIDIA", "LD_LIBRARY_PATH", "PYTORCH", "ACCELERATE", "TORCH", "PYTHONPATH", "OMP")

PROBE = r"""
import json, os, sys
out = {"argv0": sys.argv[0], "pid": os.getpid(),
       "env": {k: v for k, v in os.environ.items() if k.startswith(STEER_PREFIXES)}}
try:
    import torch
    out["available"] = torch.cuda.is_available()
    out["count"] = torch.cuda.device_count()
    try:
        torch.cuda.init()
        out["init"] = "ok"
        x = torch.ones(256, 256, device="cuda")
        out["matmul"] = float((x @ x).sum().item())
    except Exception as exc:  # noqa: BLE001
        out["init"] = repr(exc)[:500]
except Exception as exc:  # noqa: BLE001
    out["torch"] = repr(exc)[:500]
for dev in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"):
    out[dev] = os.access(dev, os.R_OK | os.W_OK)
print("GPUDIAG " + json.dumps(out), flush=True)
""".replace("STEER_PREFIXES", repr(STEER))

LAUNCHER = r"""
import ctypes, json, os, sys
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
steps = []
def state(name):
    maps = open("/proc/self/maps").read()
    rec = {"after": name, "libcuda_mapped": "/libcuda.so" in maps}
    if rec["libcuda_mapped"]:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            ctx = ctypes.c_void_p()
            rec["cuCtxGetCurrent"] = lib.cuCtxGetCurrent(ctypes.byref(ctx))
        except OSError as exc:
            rec["cuCtxGetCurrent"] = repr(exc)
    try:
        import torch
        rec["torch_initialized"] = torch.cuda.is_initialized()
    except Exception:
        pass
    steps.append(rec)
state("start")
import torch; state("import torch")
import torch._dynamo; state("import torch._dynamo")
import torch.distributed; state("import torch.distributed")
import accelerate.commands.launch; state("import accelerate.commands.launch")
torch.cuda.is_available(); state("torch.cuda.is_available() under NVML check")
del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        x = torch.ones(256, 256, device="cuda")
        msg = {"child": "ok", "sum": float((x @ x).sum().item())}
    except Exception as exc:
        msg = {"child": repr(exc)[:500]}
    os.write(w, json.dumps(msg).encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
child = os.read(r, 65536).decode()
print("GPUDIAG " + json.dumps({"steps": steps, "fork": json.loads(child or "{}")}), flush=True)
"""


def run(argv: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None) -> dict[str, Any]:
    try:
        res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        text = res.stdout + res.stderr
        code: int | str = res.returncode
    except subprocess.TimeoutExpired as exc:
        text = str(exc.stdout or "") + str(exc.stderr or "")
        code = "timeout"
    found = [json.loads(line.split("GPUDIAG ", 1)[1]) for line in text.splitlines() if "GPUDIAG {" in line]
    return {"exit": code, "found": found, "tail": text[-3000:]}


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpudiag_"))
    probe = work / "probe.py"
    probe.write_text(PROBE)
    env = dict(os.environ)
    env.update(
        ORCHESTRATOR_HOME=str(work / "home"), ORCHESTRATOR_RUNS=str(work / "runs"), PYTHONUNBUFFERED="1"
    )
    report: dict[str, Any] = {"env": {k: v for k, v in os.environ.items() if k.startswith(STEER)}}

    def save() -> None:
        (out / "gpu_diag.json").write_text(json.dumps(report, indent=1))

    report["python3"] = run([sys.executable, str(probe)], env, 60)
    save()
    report["launcher"] = run([sys.executable, "-c", LAUNCHER], env, 90)
    save()
    report["torchrun"] = run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", str(probe)], env, 90
    )
    save()
    render = work / "render"
    report["render"] = run(
        [sys.executable, "-m", "orchestrator", "render", "--profile", "local_gpu", "--strategy", "ddp", "--out",
         str(render), "--", str(probe)], env, 60)  # fmt: skip
    config = render / "accelerate_config.node0.yaml"
    if config.is_file():
        report["config"] = config.read_text()
        report["accelerate_launch"] = run(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(probe)],
            env,
            90,
        )
    save()
    for launcher in ("direct", "torchrun"):
        profiles = work / f"profiles_{launcher}"
        profiles.mkdir()
        base = (REPO / "cluster_profiles" / "local_gpu.yaml").read_text()
        (profiles / "local_gpu.yaml").write_text(base + f"\nlauncher: {launcher}\n")
        sub = run(
            [sys.executable, "-m", "orchestrator", "submit", "--profile", "local_gpu", "--profiles-dir",
             str(profiles), "--wait", "--", str(probe)], env, 120)  # fmt: skip
        logs = sorted((work / "runs").glob("*/logs/attempt_0/node_0.log"), key=lambda p: p.stat().st_mtime)
        if logs:
            text = logs[-1].read_text(errors="replace")
            sub["found"] += [
                json.loads(line.split("GPUDIAG ", 1)[1]) for line in text.splitlines() if "GPUDIAG {" in line
            ]
            sub["node_log"] = text[-4000:]
        report[f"submit_{launcher}"] = sub
        save()
    print(json.dumps(report, indent=1)[-12000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
