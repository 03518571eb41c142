"""orchestrator.rank.shard_plan: a sharded load through each rank's load plan (no DCP planning, no
state-dict round trips) restores exactly what DCP's own load restores, to the bit, warm in the
saving processes and in fresh processes as a resume; and the ranks' own digest checks refuse a
checkpoint whose flipped byte lies in a shard only rank 1 reads. Real Accelerate + FSDP2 over a
real 2-process gloo group (tests/scripts/shard_plan_probe.py), real files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract.run_dir import CORRUPT_MARKER
from orchestrator.rank.shard_plan import write_load_plan
from tests.helpers.cli import REPO
from tests.helpers.net import free_port

pytestmark = pytest.mark.slow

PROBE = REPO / "tests" / "scripts" / "shard_plan_probe.py"
ENV = {
    "ACCELERATE_USE_CPU": "1",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "TransformerBlock",
    "OMP_NUM_THREADS": "1",
}


def probe(mode: str, out: Path) -> tuple[list[dict], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "ORCHESTRATOR_"))}
    env.update(ENV, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(PROBE), mode, str(out)],
        env=env, capture_output=True, text=True, timeout=240, cwd=out,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    name = "warm" if mode == "save" else "resume"
    return [json.loads((out / f"{name}_{rank}.json").read_text()) for rank in (0, 1)], res.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("shard_plan")
    results, _ = probe("save", out)
    return out, results


def test_a_load_through_the_plan_equals_dcps_own_load_bit_for_bit(saved: tuple[Path, list[dict]]) -> None:
    out, results = saved
    for rank, r in enumerate(results):
        fast, stock = r["fast"], r["stock"]
        assert fast["model"] and fast["optimizer"] and not fast["why_not"], (rank, fast)
        # every parameter (tiny: 53 tensors, sharded) and its AdamW exp_avg, exp_avg_sq and step
        assert fast["tensors"] == 53 * 4, fast
        assert not stock.get("model"), "the comparison load went through DCP's own path"
        assert r["fast_equal"] and r["stock_equal"], r
        assert r["fast_loss"] == r["stock_loss"], r  # the next step, to the bit
    step3 = out / "run" / "checkpoints" / "step_00000003"
    marker = json.loads((step3 / "COMPLETE.json").read_text())
    assert {"load_plan_0.json", "load_plan_1.json"} <= set(marker["files"]) <= set(marker["sha256"])


def test_a_flipped_byte_in_a_shard_only_rank_1_reads_is_refused(
    saved: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    """Rank 0 no longer hashes the shards (find_resumable(..., shards=False)); rank 1 finds the byte
    in its own model shard, the newest checkpoint is marked corrupt on every rank's word, and the
    older one is loaded, in fresh processes as a resume does (an optimizer that never stepped),
    through the load plan, exactly."""
    src, _ = saved
    out = tmp_path / "copy"

    shutil.copytree(src, out, ignore=shutil.ignore_patterns("warm_*", "resume_*"))
    newest = out / "run" / "checkpoints" / "step_00000005"
    shard = newest / "pytorch_model_fsdp_0" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # sizes intact: only its digest tells
    shard.write_bytes(bytes(data))
    results, stdout = probe("resume", out)
    for r in results:
        assert r["picked"] == "step_00000005" and r["checked"] == "step_00000003", r
        assert r["fast"]["model"] and r["fast"]["optimizer"] and r["equal"], r
    assert (newest / CORRUPT_MARKER).is_file()
    assert f"skipping checkpoint {newest}" in stdout and "pytorch_model_fsdp_0/__1_0.distcp" in stdout, stdout
    assert stdout.count(f"skipping checkpoint {newest}") == 1, stdout  # reported once, not again on re-choice
    # and with no older checkpoint left, nothing is loaded
    shutil.rmtree(out / "run" / "checkpoints" / "step_00000003")
    (newest / CORRUPT_MARKER).unlink()
    results, _ = probe("resume", out)
    assert all(r["picked"] == "step_00000005" and "checked" not in r for r in results), results
    assert (newest / CORRUPT_MARKER).is_file()


def test_no_plan_for_a_checkpoint_without_dcp_folders(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    assert write_load_plan(tmp_path, 0, 1) is None
    assert not list(tmp_path.glob("load_plan_*"))
