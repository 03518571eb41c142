"""The start-up checks on users' own scripts, through the node's script hooks (issue 27), on the ``local``
profile:

* a ``--wrap-cls`` the model lacks stops an unchanged ``Trainer`` script with exit 3 and the model's
  candidate classes (its ``_no_split_modules``), not Accelerate's plain error inside ``prepare``;
* a script that builds its own ``FullyShardedDataParallelPlugin`` submitted under ``--strategy ddp``
  stops with the plugin in code named as the cause, and both fixes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.contract.run_dir import read_exit_status
from tests.helpers.cli import REPO, job_and_run_dir, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

TINY_GPT2 = str(REPO / "tests" / "scripts" / "trainer_tiny_gpt2.py")
FSDP_PLUGIN_LOOP = str(REPO / "tests" / "scripts" / "fsdp_plugin_loop.py")
ONE_NODE = ["--profile", "local", "--nodes", "1", "--procs-per-node", "2"]


def test_a_wrong_wrap_cls_on_a_trainer_script_exits_3_with_the_candidates(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    res = run_cli(
        ["submit", *ONE_NODE, "--strategy", "full_shard", "--wrap-cls", "LlamaDecoderLayer", "--wait",
         "--", TINY_GPT2, "--output-dir", str(tmp_path / "out"), "--max-steps", "5"],
        orch_env,
        timeout=180,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    expected = "--wrap-cls LlamaDecoderLayer: the model (GPT2LMHeadModel) has no such layer class; candidates: GPT2Block"
    assert expected in res.stdout, res.stdout
    assert "Could not find the transformer layer class" not in res.stdout, res.stdout
    _job, run_dir = job_and_run_dir(res.stdout)
    status = read_exit_status(run_dir)
    assert status is not None and status["code"] == 3 and status["reason"] == "selfcheck", status
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("checkpoint-*"))


def test_an_fsdp_plugin_in_code_under_ddp_is_named_as_the_cause(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    res = run_cli(
        ["submit", *ONE_NODE, "--strategy", "ddp", "--wait",
         "--", FSDP_PLUGIN_LOOP, "--out", str(tmp_path / "probe"), "--steps", "5"],
        orch_env,
        timeout=180,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert "SELF-CHECK FAILED (exit 3)" in res.stdout, res.stdout
    _job, run_dir = job_and_run_dir(res.stdout)
    status = read_exit_status(run_dir)
    assert status is not None and status["code"] == 3, status
    cause = status["problems"][0]
    assert cause.startswith("cause: the script passes its own FSDP plugin (Accelerator(fsdp_plugin=...))"), (
        cause
    )
    assert "--strategy full_shard" in cause and "drop fsdp_plugin= from Accelerator(...)" in cause, cause
    assert "cause: the script passes its own FSDP plugin" in res.stdout, res.stdout
