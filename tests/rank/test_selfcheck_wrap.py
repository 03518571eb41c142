"""Wrapping is checked at start (orchestrator/rank/selfcheck.py: check_wrap_class, candidate_layer_classes): a
``--wrap-cls`` the model lacks stops the run within the first minute, naming the classes it has,
instead of failing inside ``accelerator.prepare`` after the job queued; built-in profiles name no
model's class."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import REPO, job_and_run_dir, run_cli

TRAIN = str(REPO / "train" / "train.py")


def test_candidates_are_repeated_layers_or_hf_no_split_modules() -> None:
    import torch

    from orchestrator.rank import selfcheck
    from train.model import build_model

    gpt = build_model("tiny", 32, seed=0)
    assert selfcheck.candidate_layer_classes(gpt)[0] == "TransformerBlock"

    class HFLike(torch.nn.Module):
        _no_split_modules = ["LlamaDecoderLayer"]

        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])

    assert selfcheck.candidate_layer_classes(HFLike()) == ["LlamaDecoderLayer"]


def test_builtin_profiles_name_no_model_class() -> None:
    for path in sorted((REPO / "cluster_profiles").glob("*.yaml")):
        defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults") or {}
        assert "wrap_cls" not in defaults, f"{path.name} defaults to one model's layer class"


@pytest.mark.slow
@pytest.mark.usefixtures("reap_local_jobs")
def test_wrong_wrap_cls_fails_at_once_with_candidates(orch_env: dict[str, str]) -> None:
    started = time.monotonic()
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "2", "--strategy", "full_shard",
         "--wrap-cls", "LlamaDecoderLayer", "--wait", "--poll", "0.5",
         "--", TRAIN, "--preset", "tiny", "--data", "synthetic", "--max-steps", "5"],
        orch_env,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert time.monotonic() - started < 60
    assert "--wrap-cls LlamaDecoderLayer: the model (GPT) has no such layer class" in res.stdout
    assert "candidates: TransformerBlock" in res.stdout
    job_id, run_dir = job_and_run_dir(res.stdout)
    # Every rank refuses; the explanation names one of them and the command that shows its log.
    assert re.search(rf"see: orchestrator logs {job_id} --node [01] --rank [0-3]\n", res.stdout), res.stdout
    assert not (Path(run_dir) / "metrics.jsonl").exists() or not (Path(run_dir) / "metrics.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.usefixtures("reap_local_jobs")
def test_wrapping_reports_its_units_and_only_applied_workarounds(orch_env: dict[str, str]) -> None:
    """Transformer-based wrapping does not claim the size-based workaround; size-based wrapping that
    made no layer a unit (each tiny GPT block is under min_num_params) says so and names the candidates."""

    def self_check_line(*wrap: str) -> str:
        res = run_cli(
            ["submit", "--profile", "local", "--nodes", "1", "--strategy", "full_shard", *wrap, "--wait",
             "--poll", "0.5", "--", TRAIN, "--preset", "tiny", "--data", "synthetic", "--max-steps", "2"],
            orch_env,
            timeout=180,
        )  # fmt: skip
        assert res.returncode == 0, res.stdout + res.stderr
        _job, run_dir = job_and_run_dir(res.stdout)
        log = (Path(run_dir) / "logs" / "attempt_0" / "node_0.log").read_text()
        (line,) = [ln for ln in log.splitlines() if "self-check ok" in ln]
        return line

    by_class = self_check_line("--wrap-cls", "TransformerBlock")
    assert "TransformerBlock x" in by_class and "fsdp2_size_based_wrap" not in by_class, by_class
    by_size = self_check_line()
    assert "fsdp2_size_based_wrap" in by_size, by_size
    assert (
        "made none of the model's layers a unit of its own" in by_size
        and "--wrap-cls TransformerBlock" in by_size
    ), by_size
