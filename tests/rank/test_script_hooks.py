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


@pytest.mark.parametrize("fsdp_version", ["1", "2"])
def test_save_model_under_fsdp_with_sharded_state_dict_saves_loadable_full_weights(
    orch_env: dict[str, str], tmp_path: Path, fsdp_version: str
) -> None:
    """Transformers' ``save_model`` writes nothing under FSDP unless the state dict is full; the product's
    default is ``--state-dict sharded``. The hook gathers the full weights and rank 0 writes them."""
    import torch
    from transformers import GPT2LMHeadModel, set_seed

    final = tmp_path / "final"
    res = run_cli(
        ["submit", *ONE_NODE, "--strategy", "full_shard", "--fsdp-version", fsdp_version, "--state-dict",
         "sharded", "--wait", "--", TINY_GPT2, "--output-dir", str(tmp_path / "out"), "--max-steps", "6",
         "--save-steps", "100", "--save-model", str(final)],
        orch_env,
        timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file(), sorted(
        final.iterdir()
    )
    model, info = GPT2LMHeadModel.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    set_seed(0)
    initial = GPT2LMHeadModel(model.config)
    trained = dict(model.named_parameters())
    # Every weight was gathered in full (no shard, no empty tensor), and they are the trained ones.
    for name, p in initial.named_parameters():
        assert trained[name].shape == p.shape, name
    assert any(not torch.equal(trained[name], p) for name, p in initial.named_parameters())
