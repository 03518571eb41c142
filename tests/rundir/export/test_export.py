"""``orchestrator export`` (issue 32): every strategy's checkpoint out of the run, verified, on CPU.

The oracle for ``train/`` checkpoints is what training itself recorded: each marker's
``param_checksum``, taken from the live model at save time over the fully gathered parameters. An
export must reproduce it exactly (``--verify`` checks it; the test checks it again from the written
file with the safetensors library). The runs are the 20-step two-rank runs the equivalence, resume
and DeepSpeed tests compare (``tests/helpers/train_launch.cached_run``: in one pytest process each
is launched once, whichever module asks first); each saves its checkpoint at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from orchestrator import api
from orchestrator.contract.errors import UserError
from orchestrator.rundir.export.verify import VerifyFailed, weights_checksum
from tests.helpers import train_launch as tl
from tests.helpers.cli import run_cli

pytestmark = pytest.mark.slow

STEPS = 20
ARGS = ("--max-steps", str(STEPS))
BLOCK = "TransformerBlock"
#: (strategy, fsdp_version, nodes, procs per node, wrap_cls, options): every strategy and checkpoint
#: layout, keyed as test_train_equivalence, test_train_resume and test_deepspeed launch them.
CASES = {
    "ddp": ("ddp", 2, 1, 2, None, None),
    "full_shard-fsdp1": ("full_shard", 1, 1, 2, None, None),
    "full_shard-fsdp2": ("full_shard", 2, 1, 2, None, None),
    "full_shard-fsdp2-full_state_dict": ("full_shard", 2, 1, 2, None, {"state_dict": "full"}),
    "shard_grad_op-fsdp2": ("shard_grad_op", 2, 1, 2, BLOCK, None),
    "no_shard-fsdp1": ("no_shard", 1, 1, 2, None, None),
    "hybrid_shard-fsdp2": ("hybrid_shard", 2, 2, 2, None, None),
    "hybrid_shard_zero2-fsdp1": ("hybrid_shard_zero2", 1, 2, 2, BLOCK, None),
    "deepspeed_zero1": ("deepspeed_zero1", 2, 1, 2, None, None),
    "deepspeed_zero2": ("deepspeed_zero2", 2, 1, 2, None, None),
    "deepspeed_zero3": ("deepspeed_zero3", 2, 1, 2, None, None),
}
#: The layout each strategy's checkpoint has, as the export names it (others: FSDP sharded (DCP)).
KINDS = {
    "ddp": "safetensors",
    "full_shard-fsdp2-full_state_dict": "FSDP full state dict",
    "deepspeed_zero1": "DeepSpeed ZeRO (pytorch_model/)",
    "deepspeed_zero2": "DeepSpeed ZeRO (pytorch_model/)",
    "deepspeed_zero3": "DeepSpeed ZeRO (pytorch_model/)",
}


def _run(case: str) -> Path:
    strategy, version, nodes, procs, wrap_cls, options = CASES[case]
    launch = tl.cached_run(strategy, version, nodes, procs, ARGS, 300, wrap_cls=wrap_cls, options=options)
    assert launch.returncodes and all(c == 0 for c in launch.returncodes), launch.output()
    return launch.run_dir


def _single_threaded_checksum(names: list[str], read: object) -> float:
    """Ranks sum with one thread (OMP_NUM_THREADS=1); a float64 dot's last bits depend on threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return weights_checksum(names, read)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(before)


def _marker(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_export_of_every_strategy_is_the_model_training_recorded(tmp_path: Path, case: str) -> None:
    from safetensors import safe_open

    run_dir = _run(case)
    lines: list[str] = []
    result = api.export(str(run_dir), tmp_path / "out", verify=True, say=lines.append)
    assert result.step == STEPS
    assert result.kind == KINDS.get(case, "FSDP sharded (DCP)"), result.kind
    recorded = _marker(run_dir, STEPS)["param_checksum"]
    assert f"verify: param_checksum {recorded!r} equals the one training recorded at step {STEPS}" in lines
    handle = safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt")
    names = list(handle.keys())  # noqa: SIM118
    assert len(names) == 53 and "blocks.0.attn.qkv.weight" in names, names  # unwrapped names, every tensor
    assert _single_threaded_checksum(names, handle.get_tensor) == recorded


def test_bf16_and_torch_formats(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    run_dir = _run("full_shard-fsdp2")
    api.export(str(run_dir), tmp_path / "bf16", dtype="bf16", verify=True, say=lambda _: None)
    api.export(str(run_dir), tmp_path / "torch", fmt="torch", verify=True, say=lambda _: None)
    half = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    full = torch.load(tmp_path / "torch" / "pytorch_model.bin", weights_only=True)
    assert set(half) == set(full) and all(t.dtype == torch.bfloat16 for t in half.values())
    assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)


def test_torn_newest_is_skipped_and_step_of_a_torn_one_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(_run("ddp") / "checkpoints", run_dir / "checkpoints")
    newest = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    # An older complete checkpoint, and the newest one torn (a save killed before its marker).
    shutil.copytree(newest, run_dir / "checkpoints" / "step_00000001")
    marker = json.loads((newest / "COMPLETE.json").read_text())
    (run_dir / "checkpoints" / "step_00000001" / "COMPLETE.json").write_text(
        json.dumps({**marker, "step": 1})
    )
    (newest / "COMPLETE.json").unlink()

    res = run_cli(
        ["export", str(run_dir), "--out", str(tmp_path / "out"), "--verify"], dict(os.environ), timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (
        f"skipping checkpoint {newest} (step {STEPS}): no COMPLETE.json (the save did not finish)"
        in res.stdout
    )
    assert "exporting step 1 from" in res.stdout, res.stdout

    res = run_cli(
        ["export", str(run_dir), "--step", str(STEPS), "--out", str(tmp_path / "refused")],
        dict(os.environ),
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [
        f"orchestrator export: error: --step {STEPS}: checkpoint not complete, refusing to export it "
        f"({newest}: no COMPLETE.json (the save did not finish))"
    ]
    assert not (tmp_path / "refused").exists()

    # Same sizes, other bytes: the marker's digests catch it, and the export goes to the older one.
    (newest / "COMPLETE.json").write_text(json.dumps(marker))
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    lines: list[str] = []
    assert api.export(str(run_dir), tmp_path / "again", say=lines.append).step == 1
    assert lines[0].startswith(f"skipping checkpoint {newest} (step {STEPS}): its content does not match"), (
        lines
    )
    assert not (newest / "CORRUPT.json").exists()  # an export writes nothing into the run


def test_verify_fails_when_the_export_is_not_what_training_recorded(tmp_path: Path) -> None:
    """The checksum check can fail: a recorded checksum 1e-9 (relative) off is caught; it allows 1e-12,
    the tolerance of training's own restore check (the float64 sum's order depends on threads)."""
    run_dir = tmp_path / "run"
    shutil.copytree(_run("full_shard-fsdp1") / "checkpoints", run_dir / "checkpoints")
    path = run_dir / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE.json"
    marker = json.loads(path.read_text())
    marker["param_checksum"] *= 1 + 1e-9
    path.write_text(json.dumps(marker))
    with pytest.raises(VerifyFailed, match="the export's param_checksum is .*, training recorded"):
        api.export(str(run_dir), tmp_path / "out", verify=True, say=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_bad_input_is_one_line_and_creates_nothing(tmp_path: Path) -> None:
    ddp = _run("ddp")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (["--out", str(tmp_path / "o")], "name a RUN|JOB (a job id or a run directory) or give --checkpoint PATH"),
        ([str(ddp), "--step", "7", "--out", str(tmp_path / "o")], f"--step 7: run {ddp} has no checkpoint of that step (steps: {STEPS})"),
        ([str(ddp), "--out", str(tmp_path / "full")], f"--out {tmp_path / 'full'}: exists and is not an empty folder; name a new one"),
        ([str(ddp), "--format", "hf", "--out", str(tmp_path / "o")], "--format hf: no transformers config.json in"),
        (["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o")], f"--checkpoint {tmp_path}: not a complete checkpoint (no COMPLETE.json"),
    ]  # fmt: skip
    for args, expected in cases:
        res = run_cli(["export", *args], dict(os.environ), timeout=60)
        assert res.returncode == 2, (args, res.stdout + res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, lines)
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_bad_checkpoint_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such folder"):
        api.export(None, tmp_path / "o", checkpoint=tmp_path / "nope")


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _copied_run(tmp_path: Path) -> Path:
    """A copy of the DDP run's checkpoints (a real checkpoint, which a write into it would not spoil)."""
    run_dir = tmp_path / "run"
    shutil.copytree(_run("ddp") / "checkpoints", run_dir / "checkpoints")
    return run_dir


def test_out_in_the_run_or_a_checkpoint_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    """Issue 41: ``--out`` inside the run directory, even inside the checkpoint, exited 0 and wrote there."""
    run_dir = _copied_run(tmp_path)
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    (tmp_path / "alias").symlink_to(run_dir)  # a path that reaches into the run through a link
    before = _files(run_dir)
    res = run_cli(["export", str(run_dir), "--out", str(ckpt / "exp")], dict(os.environ), timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [
        f"orchestrator export: error: --out {ckpt / 'exp'}: inside the checkpoint {ckpt} of run {run_dir}; "
        "an export never writes into the run, name a folder outside it"
    ]
    assert "exporting" not in res.stdout
    cases = [
        (str(run_dir), run_dir / "exp", f"inside the run directory {run_dir}"),
        (str(run_dir), run_dir, f"is the run directory {run_dir}"),
        (str(run_dir), run_dir / "checkpoints", f"inside the run directory {run_dir}"),
        (str(run_dir), tmp_path / "alias" / "checkpoints" / "exp", f"inside the run directory {run_dir}"),
        (None, ckpt / "exp", f"inside the checkpoint {ckpt}"),
        (None, run_dir / "exp", f"inside the run directory {run_dir}"),
    ]
    for run, out, expected in cases:
        lines: list[str] = []
        kwargs = {"checkpoint": ckpt} if run is None else {}
        with pytest.raises(UserError) as caught:
            api.export(run, out, say=lines.append, **kwargs)  # type: ignore[arg-type]
        assert expected in str(caught.value), (out, str(caught.value))
        assert "never writes into the run" in str(caught.value) and not lines, lines
    assert _files(run_dir) == before  # nothing written, no temporary sibling either


def test_a_symlink_out_is_refused_before_the_read(tmp_path: Path) -> None:
    """Issue 41: a symbolic link ``--out`` failed only after the whole read, naming a temporary folder."""
    run_dir = _copied_run(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for link, target in [
        (tmp_path / "link", tmp_path / "target"),
        (tmp_path / "dangling", tmp_path / "nowhere"),
    ]:
        res = run_cli(["export", str(run_dir), "--out", str(link)], dict(os.environ), timeout=60)
        assert res.returncode == 2, res.stdout + res.stderr
        assert res.stderr.strip().splitlines() == [
            f"orchestrator export: error: --out {link}: is a symbolic link (to {target}); name a real folder, "
            f"e.g. --out {target}"
        ]
        assert "exporting" not in res.stdout, res.stdout  # refused before the checkpoint was read
    assert not list((tmp_path / "target").iterdir()) and not (tmp_path / "nowhere").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


#: config.json files an export must not ship or load: each refused before the read, with a reason.
BAD_CONFIGS = {
    "not JSON": ("{not json", "is not valid JSON"),
    "a list": ("[1, 2]", 'is not a transformers config (no "model_type")'),
    "no model_type": ('{"vocab_size": 64}', 'is not a transformers config (no "model_type")'),
    "unknown model_type": ('{"model_type": "no-such-model"}', "is not a config transformers can load"),
    "a wrong field type": ('{"model_type": "gpt2", "n_head": "x"}', "is not a config transformers can load"),
}


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_an_invalid_config_is_refused_before_the_read(tmp_path: Path, verify: bool) -> None:
    """Issue 41: ``--config DIR`` with an invalid ``config.json`` gave a traceback with ``--verify`` and
    shipped the broken file without."""
    run_dir = _run("ddp")
    for name, (text, expected) in BAD_CONFIGS.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "config.json").write_text(text)
        out = tmp_path / f"out-{folder.name}"
        args = ["export", str(run_dir), "--format", "hf", "--config", str(folder), "--out", str(out)]
        res = run_cli(args + (["--verify"] if verify else []), dict(os.environ), timeout=60)
        assert res.returncode == 2, (name, res.stdout + res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"orchestrator export: error: --config {folder}: {folder / 'config.json'} {expected}"
        ), (name, lines)
        assert "exporting" not in res.stdout and not out.exists(), (name, res.stdout)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
