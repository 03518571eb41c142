"""Whether this process has initialised the CUDA driver: the one thing that makes forking ranks from
it unsafe (a child cannot use a driver its parent initialised).

``libcuda`` being mapped is not that: the prewarmed launcher had it mapped on an H200 (torch
2.11+cu130) with CUDA not initialised, and every direct launch fell back to torchrun. The driver
itself answers: ``cuCtxGetCurrent`` returns ``CUDA_ERROR_NOT_INITIALIZED`` before ``cuInit`` and
initialises nothing. Standard library only (``ctypes``), looked up only where ``libcuda`` is mapped.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

#: The driver's answer to any call before ``cuInit`` (cuda.h).
CUDA_ERROR_NOT_INITIALIZED = 3


def libcuda_mapped() -> bool:
    try:
        return "/libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def driver_initialized() -> bool:
    """True when something in this process called ``cuInit`` (or when it cannot be told: then the
    safe answer). False where ``libcuda`` is not even mapped."""
    if not libcuda_mapped():
        return False
    try:
        # RTLD_NOLOAD: the library already mapped, never a second copy.
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
        context = ctypes.c_void_p()
        return int(lib.cuCtxGetCurrent(ctypes.byref(context))) != CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):
        return True
