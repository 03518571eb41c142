"""Users' own scripts on the real Slurm test cluster get train/'s guarantees (issue 12).

* an unchanged HF ``Trainer`` script: USR2 and then ``scontrol requeue``; each attempt starts at the
  newest complete ``checkpoint-N`` (a truncated newest one is skipped); then ``orchestrator cancel``
  (CANCELLED, no requeue, ``status`` shows its ``checkpoint-N``) and ``orchestrator resume``: a new job
  starts from that checkpoint (issue 27 item 1). W&B (offline) keeps one run id, and the final loss
  equals an uninterrupted run's;
* an Accelerate loop with orchestrator's three lines (examples/accelerate_cnn.py): the same preemption,
  bit-exact against an uninterrupted run;
* a loop that builds its own ``FullyShardedDataParallelPlugin`` and has no checkpoint hook, under
  ``full_shard`` at 2 x 2: really sharded, and after a preemption reported as restarted from step 0,
  never as resumed; under the profile's default ``ddp`` it stops at start (exit 3), and ``wait`` and
  ``status`` name the plugin in code as the cause and both fixes (issue 27 item 8).

The uninterrupted references run on the ``local`` profile at the same world size, in the background
while the cluster jobs run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.contract.attempt_start import NO_HOOK, read_attempt_start
from orchestrator.contract.run_dir import read_exit_status
from orchestrator.node.entry import tracker_run_id
from tests.helpers.cli import (
    REPO,
    job_and_run_dir,
    job_ended,
    kill_tree,
    poll,
    run_cli,
    sacct_state,
    status_row,
)
from tests.helpers.run_dirs import trains
from tests.helpers.slurm_cluster import slurm

pytestmark = pytest.mark.slow

TRAINER = str(REPO / "examples" / "trainer_cnn.py")
LOOP = str(REPO / "examples" / "accelerate_cnn.py")
FSDP_PLUGIN_LOOP = str(REPO / "tests" / "scripts" / "fsdp_plugin_loop.py")
TWO_NODES = ["--nodes", "2", "--procs-per-node", "1", "--strategy", "ddp"]
TRAINER_STEPS = 300
LOOP_STEPS = 120


@pytest.fixture(scope="module")
def env(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    base = tmp_path_factory.mktemp("own_scripts")
    env = dict(os.environ)
    env["ORCHESTRATOR_HOME"] = str(base / "home")
    env["ORCHESTRATOR_RUNS"] = str(base / "runs")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["WANDB_MODE"] = "offline"
    env["WANDB_DIR"] = str(base / "wandb")
    env["WANDB_SILENT"] = "true"
    (base / "wandb").mkdir()
    yield env


class Reference:
    """``orchestrator submit --profile local --wait``, started now, awaited later (killed on teardown)."""

    def __init__(self, env: dict[str, str], args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "submit", "--profile", "local", "--wait", *args],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def run_dir(self, timeout: float = 300) -> Path:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            raise AssertionError("the reference run did not finish") from None
        assert self.proc.returncode == 0, out + err
        return job_and_run_dir(out)[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)


def submit(env: dict[str, str], args: list[str]) -> tuple[str, Path]:
    res = run_cli(["submit", "--profile", "slurm_test", *args], env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return job_and_run_dir(res.stdout)


def node_log(run_dir: Path, attempt: int) -> str:
    path = run_dir / "logs" / f"attempt_{attempt}" / "node_0.log"
    return path.read_text(errors="replace") if path.exists() else ""


def diagnostics(job_id: str, run_dir: Path) -> Any:
    def show() -> str:
        state = slurm("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T %M %R", check=False).stdout.strip()
        logs = "\n".join(
            f"--- {p.relative_to(run_dir)}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
            for p in sorted(run_dir.glob("logs/attempt_*/node_*.log"))
        )
        return f"job {job_id}: {state}\nmetrics tail: {trains(run_dir)[-2:]}\n{logs}"

    return show


def live_progress(env: dict[str, str], job_id: str, show: Any) -> None:
    """``status --json`` shows a step that rises, and a loss, while the job runs."""
    first = poll(
        lambda: (s := status_row(env, job_id))["step"] is not None and s["loss"] is not None and s,
        180,
        "a step and a loss in status",
        diagnostics=show,
    )
    poll(
        lambda: (status_row(env, job_id)["step"] or 0) > first["step"], 120, "a rising step", diagnostics=show
    )


def wait_requeued(job_id: str, attempt_done: Path, show: Any) -> None:
    """The attempt ended (its node 0 wrote its exit code) and Slurm holds the job for its next start."""
    poll(lambda: attempt_done.exists(), 120, f"{attempt_done.name}", diagnostics=show)


def checkpoints(folder: Path) -> dict[int, Path]:
    return {
        int(p.name.split("-")[1]): p for p in folder.glob("checkpoint-*") if (p / "COMPLETE.json").exists()
    }


# ------------------------------------------------------------------------------------ Trainer
def test_unchanged_trainer_script_resumes_from_complete_checkpoints(
    env: dict[str, str], tmp_path: Path
) -> None:
    args = ["--max-steps", str(TRAINER_STEPS), "--save-steps", "10", "--logging-steps", "5"]
    reference = Reference(env, [*TWO_NODES, "--", TRAINER, *args, "--output-dir", str(tmp_path / "ref_out")])
    out = tmp_path / "out"
    job_id, run_dir = submit(
        env, [*TWO_NODES, "--", TRAINER, *args, "--output-dir", str(out), "--report-to", "wandb"]
    )
    show = diagnostics(job_id, run_dir)
    resumed_job = ""
    try:
        live_progress(env, job_id, show)
        poll(lambda: max(checkpoints(out), default=0) >= 10, 180, "checkpoint-10", diagnostics=show)

        # 1. USR2 (the pre-timeout signal): the ranks agree on a step, save it, and the job requeues.
        slurm("scancel", "--signal=USR2", job_id)
        wait_requeued(job_id, run_dir / "logs" / "attempt_0" / "node_0.exit", show)
        stopped = json.loads((run_dir / "exit_status.json").read_text())
        assert stopped["code"] == 75, stopped
        saved = checkpoints(out)
        assert max(saved) == stopped["step"], (sorted(saved), stopped)
        # 2. While Slurm holds the requeued job: tear the newest checkpoint (as a kill mid-save would).
        newest = saved[max(saved)]
        (newest / "model.safetensors").write_bytes(b"torn")
        previous = max(s for s in saved if s < max(saved))
        start1 = poll(lambda: read_attempt_start(run_dir, 1), 180, "attempt 1 started", diagnostics=show)
        assert start1["step"] == previous and start1["hook"] == "trainer", (start1, sorted(saved))

        # 3. scontrol requeue (TERM): the same, from the step the ranks agreed on.
        poll(
            lambda: max((e["step"] for e in trains(run_dir)), default=0) >= previous + 10,
            120,
            "10 steps in attempt 1",
            diagnostics=show,
        )
        slurm("scontrol", "requeue", job_id)
        wait_requeued(job_id, run_dir / "logs" / "attempt_1" / "node_0.exit", show)
        stopped2 = json.loads((run_dir / "exit_status.json").read_text())
        assert stopped2["code"] == 75 and stopped2["step"] > previous, stopped2
        start2 = poll(lambda: read_attempt_start(run_dir, 2), 180, "attempt 2 started", diagnostics=show)
        assert start2["step"] == stopped2["step"], (start2, stopped2)

        # 4. `orchestrator cancel` (no requeue: the job ends CANCELLED), then `orchestrator resume`: a new
        # job continues from the newest complete checkpoint-N, which lives in the Trainer's output_dir.
        poll(
            lambda: max((e["step"] for e in trains(run_dir)), default=0) >= stopped2["step"] + 5,
            120,
            "5 steps in attempt 2",
            diagnostics=show,
        )
        assert run_cli(["cancel", job_id], env, timeout=60).returncode == 0
        assert sacct_state(job_id, timeout=120) == "CANCELLED", show()
        poll(lambda: job_ended(env, job_id), 120, f"job {job_id} to end", interval=0.5, diagnostics=show)
        stopped3 = json.loads((run_dir / "exit_status.json").read_text())
        step3 = int(stopped3["step"])
        assert step3 > stopped2["step"] and max(checkpoints(out)) == step3, (
            stopped3,
            sorted(checkpoints(out)),
        )
        row = status_row(env, job_id)
        assert row["state"] == "CANCELLED", row
        assert row["checkpoint_step"] == step3 and row["checkpoint_path"] == str(
            out / f"checkpoint-{step3}"
        ), row
        table = run_cli(["status", job_id], env, timeout=60).stdout.splitlines()
        assert table[0].split()[-2:] == ["CKPT", "REQUEUES"] and table[1].split()[-2] == str(step3), table
        res = run_cli(["resume", job_id], env, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"resuming job {job_id} from step {step3} (checkpoint-{step3})" in res.stdout, res.stdout
        resumed_job = res.stdout.split("submitted job ")[1].split()[0]
        start3 = poll(lambda: read_attempt_start(run_dir, 3), 180, "attempt 3 started", diagnostics=show)
        assert start3["step"] == step3 and start3["hook"] == "trainer", (start3, stopped3)
        assert start3["checkpoint"] == str(out / f"checkpoint-{step3}"), start3
        assert sacct_state(resumed_job, timeout=240) == "COMPLETED", show()
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
        if resumed_job:
            subprocess.run(["scancel", resumed_job], capture_output=True, timeout=30, check=False)
        reference.stop()

    # No step trained twice beyond the last complete save: attempt k+1 starts where attempt k saved.
    assert all(f"attempt {a} resumed at step" in node_log(run_dir, a) for a in (1, 2, 3))
    ref_dir = reference.run_dir()
    final = [e for e in trains(run_dir) if e["step"] == TRAINER_STEPS and "lr" in e]
    ref_final = [e for e in trains(ref_dir) if e["step"] == TRAINER_STEPS and "lr" in e]
    # The loss Trainer logs at the last step averages steps 296-300 over both ranks. With the weights,
    # optimizer, scheduler, RNG and the seedable sampler's position restored, those are the same float32
    # operations in the same order as the uninterrupted run's (gloo sums two ranks the same way over veth
    # and loopback): equal to the bit, tolerance 0. (Only windows cut by a resume differ: Trainer's loss
    # accumulator restarts at the resumed step.)
    assert final and ref_final, (final, ref_final)
    assert final[-1]["loss"] == ref_final[-1]["loss"], (final[-1], ref_final[-1])
    # W&B: every attempt logged to one run, the id the node entry exported.
    runs = sorted(p.name for p in Path(env["WANDB_DIR"]).glob("wandb/offline-run-*"))
    assert len(runs) >= 3, runs
    assert {name.rsplit("-", 1)[1] for name in runs} == {tracker_run_id(run_dir).rsplit("-", 1)[1]} or all(
        name.endswith(tracker_run_id(run_dir)) for name in runs
    ), runs


# ------------------------------------------------------------------------------------ Accelerate loop
def test_accelerate_loop_with_the_three_lines_resumes_bit_exactly(env: dict[str, str]) -> None:
    args = ["--max-steps", str(LOOP_STEPS), "--save-every", "10", "--samples", "1024", "--epochs", "20"]
    reference = Reference(env, [*TWO_NODES, "--", LOOP, *args])
    job_id, run_dir = submit(env, [*TWO_NODES, "--", LOOP, *args])
    show = diagnostics(job_id, run_dir)
    try:
        live_progress(env, job_id, show)
        poll(lambda: len(trains(run_dir)) >= 15, 180, "15 steps", diagnostics=show)
        slurm("scancel", "--signal=USR2", job_id)
        wait_requeued(job_id, run_dir / "logs" / "attempt_0" / "node_0.exit", show)
        stopped = json.loads((run_dir / "exit_status.json").read_text())
        assert stopped["code"] == 75, stopped
        start1 = poll(lambda: read_attempt_start(run_dir, 1), 180, "attempt 1 started", diagnostics=show)
        assert start1["step"] == stopped["step"] and start1["hook"] == "accelerate", (start1, stopped)
        assert sacct_state(job_id, timeout=240) == "COMPLETED", show()
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
        reference.stop()
    steps = [e["step"] for e in trains(run_dir)]
    assert steps == list(range(1, LOOP_STEPS + 1)), "each step trained exactly once"
    ref = {e["step"]: e["loss"] for e in trains(reference.run_dir())}
    got = {e["step"]: e["loss"] for e in trains(run_dir)}
    assert got == ref, [(s, got[s], ref.get(s)) for s in sorted(got) if got[s] != ref.get(s)][:5]


# ------------------------------------------------------------------------------------ no hook, FSDP in code
def test_fsdp_plugin_in_code_is_sharded_and_a_restart_is_never_called_a_resume(
    env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "fsdp"
    args = ["--nodes", "2", "--procs-per-node", "2", "--strategy", "full_shard"]
    job_id, run_dir = submit(env, [*args, "--", FSDP_PLUGIN_LOOP, "--out", str(out), "--steps", "300"])
    show = diagnostics(job_id, run_dir)
    progress = Path(f"{out}.progress")

    def steps_of(attempt: str) -> list[int]:
        lines = progress.read_text().split("\n") if progress.exists() else []
        return [int(line.split()[1]) for line in lines if line.startswith(f"{attempt} ")]

    try:
        poll(lambda: len(steps_of("0")) >= 5, 180, "5 steps", diagnostics=show)
        slurm("scancel", "--signal=USR2", job_id)
        assert sacct_state(job_id, timeout=300) == "COMPLETED", show()
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    records = [
        json.loads(line)
        for p in sorted(out.parent.glob(f"{out.name}.rank*"))
        for line in p.read_text().split("\n")
        if line
    ]
    assert {(r["attempt"], r["rank"]) for r in records} == {(a, r) for a in ("0", "1") for r in range(4)}, (
        records
    )
    for r in records:
        # Sharded for real: FSDP (not the MULTI_CPU DDP Accelerate falls back to on CPU), a quarter each.
        assert r["distributed_type"] == "FSDP" and r["world_size"] == 4, r
        assert r["local_params"] < r["total_params"] / 2, r
    assert steps_of("1")[0] == 1 and steps_of("1")[-1] == 300, "attempt 1 trained again from step 0"
    # Said as such everywhere: the node logs, status (JSON and the line under the table), the registry.
    assert "starts again from step 0" in node_log(run_dir, 0), node_log(run_dir, 0)
    assert f"attempt 1 {NO_HOOK}" in node_log(run_dir, 1), node_log(run_dir, 1)
    row = status_row(env, job_id)
    assert row["started_from"] == NO_HOOK and row["reason"] == NO_HOOK and row["resumes"] == 0, row
    table = run_cli(["status", job_id], env, timeout=60).stdout
    assert NO_HOOK in table and "resumed" not in table, table


def test_fsdp_plugin_in_code_under_the_default_ddp_stops_at_start_naming_the_plugin(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Seed 003's pattern, submitted with the profile's default strategy (ddp): Accelerate lets the plugin
    in code override the launch, so the self-check stops it, and says that the plugin is why."""
    out = tmp_path / "probe"
    job_id, run_dir = submit(
        env,
        ["--nodes", "2", "--procs-per-node", "2", "--", FSDP_PLUGIN_LOOP, "--out", str(out), "--steps", "5"],
    )
    show = diagnostics(job_id, run_dir)
    try:
        res = run_cli(["wait", job_id, "--poll", "0.5", "--timeout", "150"], env, timeout=180)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    assert res.returncode == 1, res.stdout + res.stderr + show()
    cause = "cause: the script passes its own FSDP plugin (Accelerator(fsdp_plugin=...))"
    fixes = ("--strategy full_shard", "drop fsdp_plugin= from Accelerator(...)")
    assert "SELF-CHECK FAILED (exit 3)" in res.stdout and cause in res.stdout, res.stdout
    assert all(fix in res.stdout for fix in fixes), res.stdout
    stopped = read_exit_status(run_dir)
    assert stopped is not None and stopped["code"] == 3 and stopped["reason"] == "selfcheck", stopped
    assert stopped["problems"][0].startswith(cause) and "launch (ddp)" in stopped["problems"][0], stopped
    row = status_row(env, job_id)
    assert row["state"] == "FAILED" and cause in row["reason"], row
    # Stopped at start: no step trained, on any rank.
    assert trains(run_dir) == [] and not Path(f"{out}.progress").exists(), trains(run_dir)
