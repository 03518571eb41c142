"""``ResumableLoop`` resumes as train/ does (``checkpoint_io.checked_choice``): rank 0 picks the newest
complete checkpoint without reading its DCP shard files, every rank hashes the shards it will read,
and a shard that does not match its marker's digest marks the checkpoint corrupt and the older one is
loaded. A user's loop (tests/scripts/loop_shard_reads.py) under ``--strategy full_shard`` (FSDP2, 2
processes, gloo on CPU, through ``orchestrator submit``/``resume`` on the local profile), and the same
loop as one plain process with no process group.

Which rank read which shard file is seen from inside the ranks through Python's ``open`` audit
events (the script records every ``*.distcp`` its process opened while the loop restored): the
corrupt checkpoint is never loaded, so the only reads of its shards are the digest checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract.attempt_start import read_attempt_start
from orchestrator.contract.run_dir import CORRUPT_MARKER
from tests.helpers.cli import REPO, job_and_run_dir, run_cli
from tests.helpers.train_launch import losses, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

LOOP = str(REPO / "tests" / "scripts" / "loop_shard_reads.py")
FSDP2 = ["--profile", "local", "--nodes", "1", "--procs-per-node", "2", "--strategy", "full_shard"]
STEPS, EVERY, STOP = 16, 4, 10  # checkpoints at 4 and 8, the signal's at 10; the resume from 8
ARGS = ["--max-steps", str(STEPS), "--save-every", str(EVERY)]
SHARDS = ("pytorch_model_fsdp_0", "optimizer_0")


def _flip_byte_in_place(path: Path) -> None:
    """One byte in the middle of ``path`` inverted where it lies: sizes intact, only the digest tells."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def _opened(reads: Path, attempt: int, rank: int, checkpoint: Path) -> set[str]:
    """The shard files of ``checkpoint`` that ``rank`` opened while the loop of ``attempt`` restored."""
    record = json.loads((reads / f"reads.attempt{attempt}.rank{rank}.json").read_text())
    return {
        Path(p).relative_to(checkpoint).as_posix()
        for p in record["opened"]
        if Path(p).parent.parent == checkpoint
    }


def test_a_flipped_byte_in_rank_1s_shard_is_found_by_rank_1_and_the_loop_resumes_from_the_older(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    reference = run_cli(["submit", *FSDP2, "--wait", "--", LOOP, *ARGS], orch_env, timeout=300)
    assert reference.returncode == 0 and "ended COMPLETED" in reference.stdout, (
        reference.stdout + reference.stderr
    )
    ref_dir = job_and_run_dir(reference.stdout)[1]

    reads = tmp_path / "reads"
    reads.mkdir()
    res = run_cli(
        ["submit", *FSDP2, "--wait", "--", LOOP, *ARGS, "--stop-at", str(STOP), "--reads", str(reads)],
        orch_env, timeout=300,
    )  # fmt: skip
    assert "ended PREEMPTED" in res.stdout, res.stdout + res.stderr
    job, run_dir = job_and_run_dir(res.stdout)
    ckpts = run_dir / "checkpoints"
    newest, previous = ckpts / f"step_{STOP:08d}", ckpts / f"step_{2 * EVERY:08d}"
    assert (newest / "COMPLETE.json").is_file() and (previous / "COMPLETE.json").is_file()
    _flip_byte_in_place(newest / "optimizer_0" / "__1_0.distcp")  # a shard only rank 1 reads

    res = run_cli(["resume", job, "--wait"], orch_env, timeout=300)
    assert res.returncode == 0 and "ended COMPLETED" in res.stdout, res.stdout + res.stderr
    log = (run_dir / "logs" / "attempt_1" / "node_0.log").read_text()
    assert (
        f"warning: skipping checkpoint {newest}: content does not match COMPLETE.json: "
        "file optimizer_0/__1_0.distcp: sha256 " in log
    ), log
    assert log.count(f"skipping checkpoint {newest}") == 1, log  # once, by rank 0, not again on re-choice
    assert f"resumed from {previous}: step {2 * EVERY}" in log, log
    assert (newest / CORRUPT_MARKER).is_file()
    assert "optimizer_0/__1_0.distcp" in json.loads((newest / CORRUPT_MARKER).read_text())["reason"]
    assert read_attempt_start(run_dir, 1) == {
        "step": 2 * EVERY,
        "checkpoint": str(previous),
        "hook": "accelerate",
    }
    resumes = read_metrics(run_dir, "resume")
    assert [(r["step"], r["checkpoint"]) for r in resumes] == [(2 * EVERY, str(previous))], resumes

    # Each rank hashed the shards it writes and reads, rank 1 its own and so found the byte; rank 0
    # opened none of rank 1's (before: rank 0 alone hashed every file of the checkpoint).
    assert _opened(reads, 1, 0, newest) == {f"{sub}/__0_0.distcp" for sub in SHARDS}
    assert _opened(reads, 1, 1, newest) == {f"{sub}/__1_0.distcp" for sub in SHARDS}

    want, got = losses(ref_dir), losses(run_dir)
    assert sorted(want) == list(range(1, STEPS + 1)) and sorted(got) == sorted(want), (want, got)
    assert {s: got[s] for s in want} == want  # to the bit, the steps trained again after 8 included


def test_one_process_without_a_process_group_skips_a_corrupt_checkpoint(tmp_path: Path) -> None:
    """Plain ``python script.py``: no launcher, torch.distributed never initialised."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "ORCHESTRATOR_"))
    }
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

    def run(run_dir: Path, attempt: int, *extra: str) -> subprocess.CompletedProcess[str]:
        env = {**base, "ORCHESTRATOR_RUN_DIR": str(run_dir), "ORCHESTRATOR_ATTEMPT": str(attempt)}
        return subprocess.run(
            [sys.executable, LOOP, *ARGS, "--samples", "512", *extra],
            env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip

    ref = run(tmp_path / "ref", 0)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    run_dir = tmp_path / "run"
    first = run(run_dir, 0, "--stop-at", str(STOP))
    assert first.returncode == 75, first.stdout + first.stderr  # EXIT_REQUEUE
    newest, previous = (run_dir / "checkpoints" / f"step_{s:08d}" for s in (STOP, 2 * EVERY))
    marker = json.loads((newest / "COMPLETE.json").read_text())
    assert not [rel for rel in marker["files"] if rel.endswith(".distcp")], "one process saves no DCP shards"
    _flip_byte_in_place(newest / max(marker["files"], key=marker["files"].__getitem__))
    second = run(run_dir, 1)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"skipping checkpoint {newest}: content does not match COMPLETE.json" in second.stderr, (
        second.stderr
    )
    assert f"resumed from {previous}: step {2 * EVERY}" in second.stdout, second.stdout
    assert (newest / CORRUPT_MARKER).is_file()
    assert read_attempt_start(run_dir, 1) == {
        "step": 2 * EVERY,
        "checkpoint": str(previous),
        "hook": "accelerate",
    }
    want, got = losses(tmp_path / "ref"), losses(run_dir)
    assert sorted(want) == list(range(1, STEPS + 1)) and got == want
