"""orchestrator.node.cuda_driver: the direct launcher forks ranks unless the CUDA driver was initialised
in it. On an H200 (torch 2.11+cu130) ``import torch`` maps ``libcuda`` without initialising it, and a
child forked then used CUDA (bench/gpu_diag.py, bench/results.md): a check on the mapping alone sent
every GPU launch to torchrun."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.node import cuda_driver

PROBE = """
from orchestrator.node.cuda_driver import driver_initialized, libcuda_mapped
import torch
before = driver_initialized()
torch.cuda.init()
print(libcuda_mapped(), before, driver_initialized())
"""


def test_a_process_without_libcuda_has_no_driver_to_initialise() -> None:
    assert not cuda_driver.libcuda_mapped()  # this suite's interpreter: no CUDA touched
    assert cuda_driver.driver_initialized() is False


@pytest.mark.gpu
def test_the_driver_says_when_it_was_initialised() -> None:
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "False", "True"]
