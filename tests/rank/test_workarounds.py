"""FSDP2 in bf16 (orchestrator/rank/workarounds.py: fsdp2_fp32_reduce): parameters in bf16 for compute,
gradients reduced and outputs returned in fp32. Accelerate 1.15's own policy (the negative control,
with the workaround disabled) reduces gradients across ranks in bf16 and casts the model's fp32 loss
to bf16. Two CPU ranks over gloo, FSDP2 made real on CPU by the other workarounds; bf16 is allowed
on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import REPO
from tests.helpers.net import free_port

PROBE = REPO / "tests" / "scripts" / "fsdp2_mp_probe.py"


def probe(tmp_path: Path, disable: str = "") -> dict[str, object]:
    out = tmp_path / f"mp{disable or '_fixed'}.json"
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "OMP_NUM_THREADS": "1",
        "ORCHESTRATOR_DISABLE_WORKAROUNDS": disable,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(PROBE), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    record: dict[str, object] = json.loads(out.read_text())
    assert record["distributed_type"] == "FSDP" and record["world_size"] == 2, record
    return record


@pytest.mark.parametrize("disable", ["", "fsdp2_fp32_reduce"], ids=["fixed", "accelerate_default"])
def test_fsdp2_bf16_reduces_and_returns_fp32(tmp_path: Path, disable: str) -> None:
    record = probe(tmp_path, disable)
    assert record["param_dtype"] == "torch.bfloat16"  # compute stays in bf16 either way
    if disable:
        # What Accelerate 1.15 does on its own: the control that the fix is needed (and still is).
        assert record["reduce_dtype"] == "torch.bfloat16", record
        assert record["output_dtype"] == "torch.bfloat16", record
        assert record["loss_dtype"] == "torch.bfloat16", record
        assert "fsdp2_fp32_reduce" not in record["applied"]  # type: ignore[operator]
    else:
        assert record["reduce_dtype"] == "torch.float32", record
        assert record["output_dtype"] == "torch.float32", record
        assert record["loss_dtype"] == "torch.float32", record
        assert "fsdp2_fp32_reduce" in record["applied"]  # type: ignore[operator]
