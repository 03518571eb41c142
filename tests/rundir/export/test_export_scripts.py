"""``orchestrator export JOB`` of users' own scripts' checkpoints (issue 32), on the ``local`` profile:

* an unchanged HF ``Trainer`` script (a tiny GPT-2) under FSDP and under ZeRO-3: its ``checkpoint-N``
  folders live in the Trainer's ``output_dir``, found through the run's record of them; exported as
  ``hf`` with no ``--config`` (under FSDP the hook saved the model's config into each checkpoint),
  ``from_pretrained`` reloads them with the logits of an independent copy of the same weights (FSDP:
  the Trainer's own ``save_model`` at that step; ZeRO-3: DeepSpeed's own whole-checkpoint
  ``zero_to_fp32`` conversion); an ``--out`` in one of those checkpoints is refused;
* a ``ResumableLoop`` script (Accelerate ``save_state`` under FSDP: sharded DCP folders).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, job_and_run_dir, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

TINY_GPT2 = str(REPO / "tests" / "scripts" / "trainer_tiny_gpt2.py")
LOOP = str(REPO / "examples" / "accelerate_cnn.py")
ONE_NODE = ["--profile", "local", "--nodes", "1", "--procs-per-node", "2"]
STEPS = 4


def _submit(env: dict[str, str], strategy: str, script: str, *args: str) -> tuple[str, Path]:
    res = run_cli(
        ["submit", *ONE_NODE, "--strategy", strategy, "--wait", "--", script, *args], env, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return job_and_run_dir(res.stdout)


def _logits(model_dir: Path | None, state: dict | None = None, config: Path | None = None) -> object:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if model_dir is not None:
        model = GPT2LMHeadModel.from_pretrained(model_dir)
    else:
        assert config is not None and state is not None
        model = GPT2LMHeadModel(GPT2Config.from_pretrained(config))
        model.load_state_dict(state, strict=False)
        model.tie_weights()
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(24).reshape(2, 12) * 13 % 64).logits


@pytest.mark.parametrize("strategy", ["full_shard", "deepspeed_zero3"])
def test_a_trainer_checkpoint_exports_as_hf_and_reloads_with_equal_logits(
    orch_env: dict[str, str], tmp_path: Path, strategy: str
) -> None:
    import torch

    out, final = tmp_path / "trainer_out", tmp_path / "final"
    job, _run_dir = _submit(orch_env, strategy, TINY_GPT2, "--output-dir", str(out), "--max-steps", str(STEPS),
                            "--save-steps", "2", "--save-model", str(final))  # fmt: skip
    exported = tmp_path / "hf"
    # No --config: under FSDP (a sharded state dict) the Trainer saves no config.json into checkpoint-N;
    # the hook does, before the checkpoint's marker (issue 41).
    res = run_cli(
        ["export", job, "--format", "hf", "--out", str(exported), "--verify"], orch_env, timeout=180
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"exporting step {STEPS} from {out / f'checkpoint-{STEPS}'}" in res.stdout, res.stdout
    assert "verify: GPT2LMHeadModel loaded from the export gives the checkpoint's logits" in res.stdout, (
        res.stdout
    )
    got = _logits(exported)
    if strategy == "full_shard":
        want = _logits(final)  # the Trainer's own save_model after the last step
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(out / f"checkpoint-{STEPS}"))
        want = _logits(None, state, out / f"checkpoint-{STEPS}")
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    assert torch.equal(got, want)
    for step in (
        2,
        STEPS,
    ):  # every checkpoint the hook counted carries the model's config, listed in its marker
        marker = json.loads((out / f"checkpoint-{step}" / "COMPLETE.json").read_text())
        assert {"config.json", "generation_config.json"} <= set(marker["files"]), sorted(marker["files"])
    config = json.loads((out / f"checkpoint-{STEPS}" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_embd"] == 32, config


def test_an_fsdp_trainer_export_stays_out_of_its_checkpoints(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 41: the Trainer's ``checkpoint-N`` lie outside the run directory, in its ``output_dir``; an
    ``--out`` inside one, or named as one beside them, is refused before the read and writes nothing.
    ``--config`` still names another folder's config (here the Trainer's own ``save_model``)."""
    out, final = tmp_path / "trainer_out", tmp_path / "final"
    job, run_dir = _submit(orch_env, "full_shard", TINY_GPT2, "--output-dir", str(out), "--max-steps", "2",
                           "--save-steps", "2", "--save-model", str(final))  # fmt: skip
    ckpt = out / "checkpoint-2"
    before = sorted(str(p) for p in out.rglob("*"))
    for target, expected in [
        (ckpt / "hf", f"--out {ckpt / 'hf'}: inside the checkpoint {ckpt} of run {run_dir}"),
        (out / "checkpoint-9", f"--out {out / 'checkpoint-9'}: a checkpoint folder name in {out.resolve()}"),
    ]:
        res = run_cli(["export", job, "--out", str(target)], orch_env, timeout=60)
        assert res.returncode == 2, res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], lines
    assert sorted(str(p) for p in out.rglob("*")) == before
    res = run_cli(["export", job, "--format", "hf", "--config", str(final), "--out", str(tmp_path / "hf"),
                   "--verify"], orch_env, timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"copied config.json, generation_config.json from {final}" in res.stdout, res.stdout
    # A valid config of another model (wider): --verify's forward pass refuses it in one line, exit 1.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({**json.loads((final / "config.json").read_text()), "n_embd": 48})
    )
    res = run_cli(["export", job, "--format", "hf", "--config", str(other), "--out", str(tmp_path / "wrong"),
                   "--verify"], orch_env, timeout=180)  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"orchestrator export: error: verify: GPT2LMHeadModel built from {other / 'config.json'} does not fit "
        "the checkpoint's weights ("
    ), lines
    assert not (tmp_path / "wrong").exists()


def test_a_resumable_loop_checkpoint_exports_verified(orch_env: dict[str, str], tmp_path: Path) -> None:
    from safetensors import safe_open

    job, run_dir = _submit(orch_env, "full_shard", LOOP, "--epochs", "1", "--samples", "128", "--save-every", "2",
                           "--max-steps", str(STEPS))  # fmt: skip
    res = run_cli(["export", job, "--out", str(tmp_path / "out"), "--verify"], orch_env, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    marker = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE.json").read_text())
    assert marker["step"] == STEPS
    assert (
        f"exporting step {STEPS} from {run_dir / 'checkpoints' / f'step_{STEPS:08d}'} (FSDP sharded (DCP)"
        in res.stdout
    )
    assert "equal the checkpoint's, bit for bit" in res.stdout, res.stdout
    names = list(safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt").keys())  # noqa: SIM118
    assert names and not [n for n in names if "_fsdp" in n or n.startswith("module.")], names
