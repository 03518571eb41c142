"""Memory checkpoints (``train/ --memory-ckpt-every``): a restart in place resumes from the newest step
every rank holds in node memory, not from the shared checkpoint many steps back.

Real local jobs through ``orchestrator submit``: two simulated nodes of one process each (DDP: one node of
two processes, whose rank 1 restores the parameters and optimizer state from rank 0's file), real
gloo, a real SIGKILL of rank 1; the restarted attempt starts at a memory checkpoint's step past the newest shared
checkpoint and re-trains only the steps after it, each with the loss the first attempt logged for it,
to the bit; the node's memory checkpoint folder is gone once the job has ended."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from orchestrator.contract.memory_checkpoints import (
    AUTO_MEMORY_CKPT_PROBE_STEP,
    memory_ckpt_root,
    node_memory_ckpt_dir,
)
from orchestrator.contract.restarts import read_restarts
from tests.helpers.cli import REPO, job_and_run_dir, run_cli, status_row
from tests.helpers.hold import rank_pid
from tests.helpers.run_dirs import launcher_pids, trains
from tests.helpers.train_launch import losses

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

TRAIN = str(REPO / "train" / "train.py")
CKPT_EVERY, MEMORY_CKPT_EVERY, KILL_AT, MAX_STEPS = 20, 4, 31, 60
RUN_ARGS = [
    *("--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"),
    *(
        "--max-steps",
        str(MAX_STEPS),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--memory-ckpt-every",
        str(MEMORY_CKPT_EVERY),
    ),
]


def _losses_by_step(run_dir: Path) -> dict[int, list[float]]:
    seen: dict[int, list[float]] = {}
    for event in trains(run_dir):
        seen.setdefault(event["step"], []).append(event["loss"])
    return seen


def _sizes(folder: Path) -> dict[str, int]:
    """The memory checkpoints' sizes (the ranks go on saving and pruning while this looks)."""
    found = {}
    for path in folder.glob("*.pt"):
        try:
            found[path.name] = path.stat().st_size
        except FileNotFoundError:
            pass
    return found


@pytest.mark.parametrize(
    "strategy", ["ddp", "full_shard", pytest.param("shard_grad_op", id="shard_grad_op-fsdp1")]
)
def test_a_restart_in_place_resumes_from_the_nodes_memory_checkpoints(
    orch_env: dict[str, str], tmp_path: Path, strategy: str
) -> None:
    extra = ["--fsdp-version", "1"] if strategy == "shard_grad_op" else []
    nodes = 1 if strategy == "ddp" else 2  # DDP: the node's ranks keep one copy of the model
    shape = ["--nodes", str(nodes), "--procs-per-node", str(3 - nodes)]
    submit = ["submit", "--profile", "local", "--strategy", strategy, *extra, *shape]
    # The uninterrupted run every step's loss is compared with (the kill's moment is not exact: how
    # many steps come again varies, so the attempts' own overlap may be too short to prove anything).
    ref = run_cli([*submit, "--wait", "--poll", "0.5", "--", TRAIN, *RUN_ARGS], orch_env, timeout=240)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    reference = _losses_by_step(job_and_run_dir(ref.stdout)[1])
    res = run_cli([*submit, "--", TRAIN, *RUN_ARGS], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    folders = [
        node_memory_ckpt_dir(memory_ckpt_root(), run_dir, job_id, f"node{node}") for node in range(nodes)
    ]  # the job's own, as the node entry names them
    victim = rank_pid(run_dir, 1, min_step=KILL_AT)
    held = _sizes(folders[0])
    os.kill(victim, signal.SIGKILL)
    if strategy == "ddp":  # one copy of the model on the node: rank 1's files leave it to rank 0's
        whole = [size for name, size in held.items() if "-r0-" in name]
        replica = [size for name, size in held.items() if "-r1-" in name]
        assert whole and replica and max(replica) * 20 < min(whole), held
    waited = run_cli(["wait", job_id, "--poll", "0.5", "--timeout", "180"], orch_env, timeout=240)
    logs = "\n".join(p.read_text() for p in sorted(run_dir.glob("logs/attempt_*/node_*.log")))
    assert waited.returncode == 0, waited.stdout + waited.stderr + logs[-4000:]

    [restart] = read_restarts(run_dir)
    assert restart["in_place"] is True and restart["step"] % CKPT_EVERY == 0, restart
    assert launcher_pids(run_dir, 0, nodes) == launcher_pids(run_dir, 1, nodes)
    # Attempt 1 started from the newest memory checkpoint every rank held when rank 1 died working on
    # step 31 or later (rank 0 may still have been writing the newest), never older than the shared
    # checkpoint (a memory checkpoint is taken before a shared one of the same step).
    start = json.loads((run_dir / "logs" / "attempt_1" / "start.json").read_text())
    assert start["memory"] is True and start["step"] % MEMORY_CKPT_EVERY == 0, start
    assert max(KILL_AT - 1 - MEMORY_CKPT_EVERY, restart["step"]) <= start["step"] < MAX_STEPS, start
    loaded = json.loads((run_dir / "loaded.json").read_text())
    assert loaded["memory_checkpoint"] == start["step"] and loaded["checkpoint"] is None, loaded

    # Exact: every step of both attempts has the uninterrupted run's loss, to the bit; none before
    # the memory checkpoint came again.
    seen = _losses_by_step(run_dir)
    assert {step: set(losses) for step, losses in seen.items()} == {s: {v[0]} for s, v in reference.items()}
    again = sorted(step for step, losses in seen.items() if len(losses) > 1)
    assert min(again, default=start["step"] + 1) == start["step"] + 1, (start, again)
    assert len(seen[MAX_STEPS]) == 1, again
    print(f"[memory_checkpoints {strategy}] from step {start['step']}: {len(again)} step(s) again")

    row = status_row(orch_env, job_id)
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, row
    described = run_cli(["status", job_id], orch_env, timeout=60).stdout
    assert f"resumed at step {start['step']} from the nodes' memory checkpoints" in described, described
    then = f"last as attempt 1 (newest complete checkpoint then: step {restart['step']})"
    assert then in described, described  # not to be read as where it resumed
    assert not any(folder.exists() for folder in folders), folders  # gone with the node tasks


LOOP = str(REPO / "examples" / "accelerate_cnn.py")
# auto's interval is aligned to a divisor below it: room for a few. And room for a loaded machine's
# measure: auto takes an interval below this only where a save costs under 2 % of that many steps,
# and one save timed against the median step swings with load (0.6 to 1.2 steps measured here; at 60
# a CI run measured a save of 0.013 s, a step of 0.011 s, and chose none).
LOOP_SAVE_EVERY = 240
LOOP_STEPS = 250  # 64 steps per epoch; the kill (step 31, or later: the poller lags) falls inside
LOOP_ARGS = [
    "--epochs",
    "4",
    "--max-steps",
    str(LOOP_STEPS),
    "--save-every",
    str(LOOP_SAVE_EVERY),
    "--memory-ckpt-every",
    "auto",
]


def test_a_resumable_loop_restarts_from_its_memory_checkpoints(orch_env: dict[str, str]) -> None:
    """``ResumableLoop(memory_ckpt_every="auto")`` in a user's own Accelerate loop (examples/accelerate_cnn.py,
    a shuffled seedable loader, a prepared scheduler): the same, through the loop's own restore, on the
    interval ``auto`` measured and said."""
    submit = ["submit", "--profile", "local", "--strategy", "ddp", "--nodes", "2", "--procs-per-node", "1"]
    ref = run_cli([*submit, "--wait", "--poll", "0.5", "--", LOOP, *LOOP_ARGS], orch_env, timeout=240)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    want = losses(job_and_run_dir(ref.stdout)[1])
    res = run_cli([*submit, "--", LOOP, *LOOP_ARGS], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    os.kill(rank_pid(run_dir, 1, min_step=KILL_AT), signal.SIGKILL)
    waited = run_cli(["wait", job_id, "--poll", "0.5", "--timeout", "180"], orch_env, timeout=240)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    [restart] = read_restarts(run_dir)
    start = json.loads((run_dir / "logs" / "attempt_1" / "start.json").read_text())
    assert restart["in_place"] is True and restart["step"] % LOOP_SAVE_EVERY == 0, restart
    said = (run_dir / "logs" / "attempt_0" / "node_0_ranks" / "rank_0.log").read_text(errors="replace")
    chosen = re.search(r"memory checkpoints, auto: every (\d+) steps \(a save [\d.]+s, a step [\d.]+s", said)
    assert chosen is not None, said[-3000:]
    every = int(chosen[1])
    print(f"[memory_checkpoints loop] {chosen[0]}")
    # Below --save-every, and its divisor where one lies between (a loaded run chose 31: none in 31..59).
    assert 0 < every < LOOP_SAVE_EVERY, every
    assert LOOP_SAVE_EVERY % every == 0 or all(LOOP_SAVE_EVERY % n for n in range(every, LOOP_SAVE_EVERY)), (
        every
    )
    assert start["memory"] is True and start["hook"] == "accelerate", start
    assert max(KILL_AT - 1 - every, restart["step"]) <= start["step"] < LOOP_STEPS, (start, every)
    # On the interval, or the one save auto measured (a kill before the interval's first save).
    assert start["step"] % every == 0 or start["step"] == AUTO_MEMORY_CKPT_PROBE_STEP, (start, every)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, LOOP_STEPS + 1)) and got == want, [
        s for s in want if got.get(s) != want[s]
    ]


def test_a_memory_checkpoint_that_cannot_be_written_turns_them_off_and_training_goes_on(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """A folder another user could write to (here: the per-user folder left open, mode 0777) is never
    written: train/ says memory checkpoints are off and trains to the end. ``auto`` then measures no
    save and chooses none; train/ once divided by the interval a failed save had set to 0."""
    root = tmp_path / "shm"
    (root / f"orchestrator-{os.getuid()}").mkdir(parents=True)
    (root / f"orchestrator-{os.getuid()}").chmod(0o777)
    env = {**orch_env, "ORCHESTRATOR_MEMORY_CKPT_ROOT": str(root)}
    args = [*RUN_ARGS[: RUN_ARGS.index("--max-steps")], "--max-steps", "12", "--memory-ckpt-every", "auto"]
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "1", "--wait", "--poll", "0.5", "--", TRAIN, *args],
        env,
        timeout=240,
    )
    job_id, run_dir = job_and_run_dir(res.stdout)
    said = (run_dir / "logs" / "attempt_0" / "node_0_ranks" / "rank_0.log").read_text(errors="replace")
    assert res.returncode == 0 and f"job {job_id} ended COMPLETED" in res.stdout, res.stdout + said[-3000:]
    assert "memory checkpoints off on rank 0: " in said and "is not a folder of this user's alone" in said, (
        said
    )
    assert "memory checkpoints, auto: none (a save 0.000s" in said, said[-3000:]
    assert max(e["step"] for e in trains(run_dir)) == 12
    assert not list(root.rglob("*.pt")), list(root.rglob("*"))
