"""This machine's GPUs, counted without torch: for a ``local`` profile with ``gpus_per_node > 0``
(``local_gpu``), planning uses the GPUs the machine has, one rank per GPU.

Never through torch (``import torch`` costs the CLI a second, and a CUDA query there would create a
driver context in the process that later forks ranks): NVML (``pynvml`` from nvidia-ml-py) when
importable, else ``nvidia-smi -L``; then ``CUDA_VISIBLE_DEVICES``, when set, narrows the count, as
it narrows what every rank sees.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

#: nvidia-smi should answer in well under a second; a hung driver must not hang ``submit``.
NVIDIA_SMI_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class GpuCount:
    count: int
    source: str
    """How it was found, for messages: ``NVML``, ``nvidia-smi -L``, ``CUDA_VISIBLE_DEVICES=...``."""
    visible: tuple[str, ...]
    """The devices a rank may be given, in order: ``CUDA_VISIBLE_DEVICES``' entries, else the indices."""


def visible_devices_env(env: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """``CUDA_VISIBLE_DEVICES`` as entries (None when unset). CUDA stops at the first invalid entry;
    ``-1`` or an empty value hides every GPU."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    out: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if not part or part.startswith("-"):
            break
        out.append(part)
    return tuple(out)


def _nvml_count() -> int | None:
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except Exception:  # not installed, or a broken install: try nvidia-smi
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: no GPUs
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: S110 (nothing to do about a failed shutdown)
            pass


def _nvidia_smi_count() -> int | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def count_gpus(env: dict[str, str] | None = None) -> GpuCount:
    """The GPUs of this machine a job may use (0 with the reason when there are none)."""
    physical = _nvml_count()
    source = "NVML"
    if physical is None:
        physical = _nvidia_smi_count()
        source = "nvidia-smi -L"
    if physical is None:
        physical, source = 0, "no NVML (nvidia-ml-py) and no nvidia-smi"
    visible = visible_devices_env(env)
    if visible is None:
        return GpuCount(physical, source, tuple(str(i) for i in range(physical)))
    if physical == 0:
        return GpuCount(0, source, ())
    entries = visible[:physical]
    cvd = ",".join(visible)
    return GpuCount(len(entries), f"{source}, CUDA_VISIBLE_DEVICES={cvd}", entries)
