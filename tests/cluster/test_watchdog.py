"""The hang watchdog on the real Slurm test cluster: a stopped rank ends the job with every rank's
stack saved and its node named, ``--auto-resume`` finishes the run without that node from the last
checkpoint with the uninterrupted run's result, and a checkpoint slower than ``hang_timeout`` does
not trip it. One 2-node ``train/`` job carries all of it (suite time).

The rank is stopped for real (SIGSTOP: its process cannot run, exactly as a rank stuck in a
driver or a swapped-out host looks to its peers). ``--hang-timeout 20`` instead of the issue's 60:
the same code path, 80 s less of the suite's budget (the watchdog's clock is the only difference).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.contract.heartbeat import read_heartbeats
from orchestrator.contract.run_dir import attempt_dir, hang_dir, last_complete_checkpoint, read_json
from tests.helpers import train_launch
from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli, sacct_state
from tests.helpers.slurm_cluster import job_nodes, slurm, slurm_node_pids

pytestmark = pytest.mark.slow

TRAIN = str(REPO / "train" / "train.py")
#: Rank 1 is slowed until the straggler is reported, and parked inside the first checkpoint at least
#: CKPT_EVERY steps after the slowing began should that take longer (SlowedRank): every phase ends by
#: step ~65 however fast or slow the machine, within STEPS.
STEPS = 100
CKPT_EVERY = 20
ARGS = [
    *("--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"),
    *("--max-steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY)),
    # Every value the reference launcher's defaults (tests/helpers/train_launch.TINY_ARGS) set too.
    *("--seed", "0", "--lr", "3e-3", "--warmup-steps", "5", "--eval-every", "0"),
]
TWO_NODES = ["--strategy", "ddp", "--nodes", "2", "--procs-per-node", "1"]
HANG_TIMEOUT = 20


@pytest.fixture()
def env(slurm_cluster: dict[str, str], tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ)
    e["ORCHESTRATOR_HOME"] = str(tmp_path / "home")
    e["ORCHESTRATOR_RUNS"] = str(tmp_path / "runs")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def rank_record(run_dir: Path, rank: int) -> dict[str, Any]:
    return read_heartbeats(attempt_dir(run_dir, 0)).get(rank, {})


def batch_log(run_dir: Path, job_id: str) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob(f"{job_id}_0_log.err"))


def stop_rank_in_phase(
    run_dir: Path, rank: int, node: str, job_id: str, want: set[str], min_step: int
) -> tuple[int, int]:
    """SIGSTOP ``rank`` while its heartbeat says one of ``want`` at ``min_step`` or later; retried
    until the stopped process's record still says so (the phase it is really stopped in)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rec = rank_record(run_dir, rank)
        if rec.get("phase") not in want or int(rec.get("step", 0)) < min_step:
            time.sleep(0.002)
            continue
        pid = int(rec["pid"])
        assert pid in slurm_node_pids(node, job_id=job_id), (pid, node)
        os.kill(pid, signal.SIGSTOP)
        poll(lambda p=pid: psutil.Process(p).status() == psutil.STATUS_STOPPED, 10, "the rank stopped")
        again = rank_record(run_dir, rank)
        if again.get("phase") in want:
            return pid, int(again["step"])
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"rank {rank} never seen in {want} from step {min_step}")


class SlowedRank(threading.Thread):
    """Rank 1 slowed for real: stopped for 0.1 s inside the forward of each step (a phase that waits for
    no other rank, so only its own local time grows). Once it is inside the checkpoint of step
    ``park_at`` or later it is parked there (stopped; the watchdog stands aside during a checkpoint), so
    the run cannot end, however fast it trains, while the test waits for ``status`` and the batch step
    to report the straggler. The sleep is the slowness injected, not synchronisation."""

    def __init__(self, run_dir: Path, pid: int, park_at: int) -> None:
        super().__init__(name="slowed-rank", daemon=True)
        self.run_dir, self.pid, self.park_at = run_dir, pid, park_at
        self.done = threading.Event()
        self.parked_step: int | None = None

    def _parked(self) -> bool:
        rec = rank_record(self.run_dir, 1)
        if rec.get("phase") != "checkpoint" or int(rec.get("step", 0)) < self.park_at:
            return False
        os.kill(self.pid, signal.SIGSTOP)
        poll(lambda: psutil.Process(self.pid).status() == psutil.STATUS_STOPPED, 10, "rank 1 stopped")
        again = rank_record(self.run_dir, 1)
        if again.get("phase") == "checkpoint":  # still inside it, now that it is stopped
            self.parked_step = int(again["step"])
            return True
        os.kill(self.pid, signal.SIGCONT)
        return False

    def run(self) -> None:
        slowed = -1
        with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
            while not self.done.is_set():
                if self._parked():
                    return  # stays stopped: the test holds it there, then continues it
                rec = rank_record(self.run_dir, 1)
                step = int(rec.get("step", -1))
                if rec.get("phase") == "forward" and step != slowed:
                    os.kill(self.pid, signal.SIGSTOP)
                    if rank_record(self.run_dir, 1).get("phase") == "forward":  # stopped inside it
                        slowed = step
                        time.sleep(0.1)
                    os.kill(self.pid, signal.SIGCONT)
                time.sleep(0.0005)

    def finish(self) -> int | None:
        """Stop slowing; the step rank 1 is parked (stopped) in, or None (then it runs on)."""
        self.done.set()
        self.join(timeout=30)
        if self.parked_step is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
        return self.parked_step


def test_stopped_rank_fails_the_job_with_stacks_and_auto_resume_completes(
    env: dict[str, str], tmp_path: Path
) -> None:
    # The uninterrupted run at the same world size (each batch is a function of (step, rank)),
    # launched directly on a free port meanwhile.
    reference = train_launch.start(tmp_path / "reference", "ddp", nodes=1, procs=2, args=ARGS, timeout=400)
    stopped: list[int] = []
    try:
        res = run_cli(
            [
                "submit",
                "--profile",
                "slurm_test",
                *TWO_NODES,
                "--auto-resume",
                "--hang-timeout",
                str(HANG_TIMEOUT),
            ]
            + ["--", TRAIN, *ARGS],
            env,
            timeout=90,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        job_id, run_dir = job_and_run_dir(res.stdout)
        poll(lambda: len(rank_record(run_dir, 1)) and len(job_nodes(job_id)) == 2, 120, "rank 1's heartbeat")
        nodes = job_nodes(job_id)
        victim = nodes[rank_record(run_dir, 1)["node"]]

        # A slow rank, slowed for real (SlowedRank) until status --json flags it (its last 5 steps' time
        # outside collectives all > 2x the others') and the batch step logs it.
        pid1 = int(rank_record(run_dir, 1)["pid"])
        stopped.append(pid1)

        def flagged() -> dict[str, Any] | None:
            row = json.loads(run_cli(["status", job_id, "--json"], env).stdout)["jobs"][0]
            found = (row.get("liveness") or {}).get("stragglers") or {}
            return found if found.get("flagged_ranks") == [1] else None

        start_step = int(rank_record(run_dir, 1).get("step", 0))
        slowed = SlowedRank(run_dir, pid1, park_at=(start_step // CKPT_EVERY + 2) * CKPT_EVERY)
        slowed.start()
        try:
            slow = poll(flagged, 90, "status --json to flag rank 1 as a straggler", interval=0)
            # The batch step re-reads the heartbeats whenever a rank moves to another phase.
            poll(
                lambda: f"straggler: rank 1 on {victim}" in batch_log(run_dir, job_id),
                90,
                f"the batch step to log the straggler (rank 1 at step {rank_record(run_dir, 1).get('step')})",
                diagnostics=lambda: (
                    f"rank 0: {rank_record(run_dir, 0)}\nrank 1: {rank_record(run_dir, 1)}\n"
                    + batch_log(run_dir, job_id)[-3000:]
                ),
            )
        finally:
            parked = slowed.finish()
        assert slow["slowest_rank"] == 1 and slow["slowest_host"] == victim and slow["ratio"] > 2, slow

        # No false positive: rank 1 held inside a checkpoint for longer than hang_timeout.
        if parked is None:
            pid, ckpt_step = stop_rank_in_phase(
                run_dir, 1, victim, job_id, {"checkpoint"}, int(rank_record(run_dir, 1)["step"]) + 1
            )
        else:  # parked there already
            pid, ckpt_step = pid1, parked
        stopped.append(pid)
        held_until = time.monotonic() + HANG_TIMEOUT + 8
        while time.monotonic() < held_until:
            assert not hang_dir(run_dir, 0).exists(), "the watchdog fired during a slow checkpoint"
            assert slurm("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip() == "RUNNING"
            time.sleep(0.5)
        os.kill(pid, signal.SIGCONT)

        # A stopped rank outside a checkpoint: FAILED within hang_timeout + 30 s.
        pid, at_step = stop_rank_in_phase(
            run_dir, 1, victim, job_id, {"forward", "backward", "data"}, ckpt_step + 2
        )
        last_ckpt = (at_step - 1) // CKPT_EVERY * CKPT_EVERY
        stopped.append(pid)
        t_stop = time.monotonic()
        assert sacct_state(job_id, timeout=HANG_TIMEOUT + 60) == "FAILED"
        failed_after = time.monotonic() - t_stop
        print(f"[watchdog] FAILED {failed_after:.1f} s after SIGSTOP (hang_timeout {HANG_TIMEOUT})")
        assert failed_after <= HANG_TIMEOUT + 30

        evidence = hang_dir(run_dir, 0)
        report = read_json(evidence / "hang.json")
        assert report is not None
        assert report["bad_node"] == victim and report["culprit_rank"] == 1, report
        assert {r["rank"] for r in report["ranks"]} == {0, 1}
        for rank in (0, 1):
            text = (evidence / f"rank_{rank}.txt").read_text()
            assert "py-spy" in text and "train.py" in text, text  # a real Python stack of train.py
        assert "state stopped" in (evidence / "rank_1.txt").read_text()
        # squeue says COMPLETING for a while after sacct's FAILED: poll status until it agrees.
        status = poll(
            lambda: next(
                (
                    j
                    for j in json.loads(run_cli(["status", job_id, "--json"], env).stdout)["jobs"]
                    if j["state"] == "FAILED"
                ),
                None,
            ),
            60,
            "status to say FAILED",
        )
        assert status["state"] == "FAILED" and f"rank 1 on node {victim} differs" in status["reason"], status

        # --auto-resume: a new job without the victim, from the last complete checkpoint, ends like
        # the uninterrupted run.
        decisions = [json.loads(x) for x in (run_dir / "auto_resume.jsonl").read_text().splitlines()]
        assert decisions[-1]["action"] == "resubmitted" and victim in decisions[-1]["exclude_nodes"], (
            decisions
        )
        new_job = decisions[-1]["new_job_id"]
        assert decisions[-1]["checkpoint"].endswith(f"step_{last_ckpt:08d}"), decisions
        poll(lambda: job_nodes(new_job) or (run_dir / "final.json").exists(), 120, "the new job to start")
        assert victim not in job_nodes(new_job)
        assert sacct_state(new_job, timeout=240) == "COMPLETED"
        assert reference.wait() == [0], reference.output()  # one launcher, two ranks
        ref_dir = tmp_path / "reference"
        # To the bit: the final loss and checksums, and every loss either job logged.
        final, ref = read_json(run_dir / "final.json"), read_json(ref_dir / "final.json")
        assert final is not None and ref is not None and final["step"] == ref["step"] == STEPS
        for key in ("loss", "param_checksum", "optim_checksum"):
            assert final[key] == ref[key], (key, final[key], ref[key])
        want = train_launch.losses(ref_dir)
        got = [
            (e["step"], e["loss"])
            for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e.get("event") == "train"
        ]
        assert sorted(want) == sorted({step for step, _ in got}) == list(range(1, STEPS + 1))
        differ = {step: (loss, want[step]) for step, loss in got if loss != want[step]}
        assert not differ, f"losses differ from the uninterrupted run's at (got, want): {differ}"
        resumed = [
            e
            for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e.get("event") == "resume"
        ]
        assert [e["step"] for e in resumed] == [last_ckpt]
        assert last_complete_checkpoint(run_dir) is not None
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        reference.kill()


def test_uneven_inputs_hang_without_heartbeats_status_silence_and_stacks(env: dict[str, str]) -> None:
    """A script without hooks hangs in collectives: ``status`` shows how long no rank wrote anything,
    and ``orchestrator stacks`` shows both ranks inside a collective (rank 0 in the barrier, rank 1
    in the backward whose all-reduce rank 0 never joins)."""
    from orchestrator.rundir.liveness import SILENT_NOTE_S

    script = str(REPO / "tests" / "scripts" / "uneven_inputs.py")
    res = run_cli(["submit", "--profile", "slurm_test", *TWO_NODES, "--", script], env, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    try:
        logs = run_dir / "logs" / "attempt_0"

        def both_stuck() -> bool:
            text = "".join(p.read_text(errors="replace") for p in logs.glob("node_*.log"))
            return "rank 0 out of data" in text and "rank 1 step 4" in text

        poll(both_stuck, 120, "both ranks at the uneven step")

        def silent() -> dict[str, Any] | None:
            row = json.loads(run_cli(["status", job_id, "--json"], env).stdout)["jobs"][0]
            live = row.get("liveness") or {}
            return row if row["state"] == "RUNNING" and (live.get("silent_s") or 0) >= SILENT_NOTE_S else None

        poll(silent, 90, f"status --json to report {SILENT_NOTE_S:.0f} s without output", interval=2)
        table = run_cli(["status", job_id], env).stdout
        assert f"{job_id}: no output from any rank for" in table, table

        res = run_cli(["stacks", job_id], env, timeout=90)
        assert res.returncode == 0, res.stdout + res.stderr
        lines = [x for x in res.stdout.splitlines() if x.startswith("rank ")]
        assert len(lines) == 2 and all("inside a collective" in x for x in lines), res.stdout
        folder = Path(res.stdout.split(" in ")[-1].strip())
        rank0, rank1 = ((folder / f"rank_{r}.txt").read_text() for r in (0, 1))
        assert "barrier" in rank0 and "wait_for_everyone" in rank0, rank0
        assert "backward" in rank1 and "uneven_inputs.py" in rank1, rank1
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
