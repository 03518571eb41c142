"""The run-directory contract: every file name, who writes it, and the one rule for each fact.

Standard library only, so ``train/``, users' own scripts and the node entry point import it
without pulling in the CLI's dependencies (``python -c "import orchestrator.contract.run_dir"`` is cheap).
The layout, complete (``A`` = attempt number from 0, ``N`` = node rank)::

    <run_dir>/
      job.json                      the current plan: the newest submission into this run (written by
                                    submit/resume/auto-resume; read by status, resume, auto-resume)
      job.attempt_<A>.json          the plan of the submission that started at attempt A, never
                                    rewritten: the nodes of that job read it (one per submission)
      job_id                        the newest job's id (local jobs: which job owns the run now)
      run_name                      the run's name, its first job's id (orchestrator.contract.run_name)
      sbatch.sh                     the batch script exactly as submitted (Slurm)
      submitit/                     submitit's pickles and the batch/task stdout+stderr
        array_task.pkl              a sweep task's node task, linked by its batch script to the name
                                    submitit looks up for that array task (Slurm arrays)
      snapshot/                     the script's folder copied at submit time (--snapshot)
      metrics.jsonl                 JSON lines from rank 0 (train / eval / resume events); the last
                                    line may be torn mid-write
      tensorboard/                  TensorBoard events (train/)
      checkpoints/step_<8 digits>/  one folder per checkpoint, complete only with COMPLETE.json
        COMPLETE.json               {"step", "world_size", "strategy", "files": {rel: size},
                                     "sha256": {rel: hex digest}, ...}
        CORRUPT.json                written by a restore that found the content does not match
                                    COMPLETE.json's digests: the folder is never chosen again
      checkpoints/.tmp-step_*       checkpoints being written (never read)
      checkpoint_dirs.json          folders outside the run where its hook's library writes checkpoints
                                    (a Trainer's output_dir: checkpoint-N, counted when their
                                    COMPLETE.json names this run): orchestrator.contract.hook_checkpoints
      exit_status.json              rank 0's last word: {"code", "reason", "step", "time"}
      loaded.json, final.json       train/: what a resume restored; the final checksums
      replicas/rank<R>.json         train/: per-rank shard checksums at the end
      auto_resume.jsonl             the after-step check's decisions, one JSON object a line (Slurm)
      start_estimates.jsonl         the scheduler's start estimate at each submission: {"job_id", "estimate", "asked"}
      restarts.jsonl                restarts inside the allocation, one JSON object a line: {"job_id",
                                    "failed_attempt", "attempt", "cause", "step", "time"} (Slurm)
      cancel_requested.json         written by ``orchestrator cancel``: no requeue after it
      budget_stop.json              node 0, when ``--budget`` stops the run: {"attempt", "job_id", "reason",
                                    "spent", "budget", "time"}: every node stops its ranks, no requeue, BUDGET
      .run.lock                     held (flock) by a command that changes the run: submit into it,
                                    resume, auto-resume, cancel; the holder's pid and command inside
      local_pids.json               local jobs: {"controller": pid}
      local_state.json              local jobs: {"state", "exit_code", "reason", "nodes"} at the end
      logs/attempt_<A>/
        node_<N>.log                the node entry point's log (launcher output included)
        node_<N>.exit               that node's exit code, written when it finishes
        node_<N>.pid                the launcher's pid
        node_<N>.held.json          local jobs, as the node ends: {"job_id", "node", "pid", "start" (its
                                    process's own start), "end", "procs", "cpus", "gpus"}: cost's bill
        budget.json                 node 0's meter of the attempt (``--budget``): {"start", "end", "per_hour"}
        start.json                  what this attempt's training started from, written by rank 0 of a
                                    script with a checkpoint hook (train/, orchestrator.loop,
                                    orchestrator.hf): {"step", "checkpoint", "hook", "memory"?}; none: no hook
        node_<N>_ranks/             per-rank logs (rank_<R>.log; torchrun's layout under launcher: torchrun)
          rank_pids.json            forked ranks (launcher: direct): {"launcher": pid, "ranks": {R: pid}}
        accelerate_config.node<N>.yaml  the node's rendered Accelerate config
        deepspeed_config.node<N>.json   DeepSpeed with gradient clipping off: the config file that yaml names
        main_ip                     node 0's address, when the profile names an interface
        nccl_trace_rank_<R>         GPUs: NCCL's flight recorder, dumped by torch when NCCL's own timeout fires
        heartbeat/rank_<R>.json     rank R's heartbeat: its step, phase and time, one fixed-size record
                                    rewritten in place on every beat (orchestrator.contract.heartbeat)
      hang/attempt_<A>/             the hang watchdog's evidence (orchestrator.supervise.watchdog), or what
                                    ``orchestrator stacks`` collected (``stacks_<time>/`` inside):
        hang.json                   why it fired, the rank and node found to differ, every rank's state
        rank_<R>.txt                rank R's Python stacks (py-spy), with its host, pid and process state
      preflight/attempt_<A>/        the checks before training (orchestrator.supervise.preflight):
        node_<N>.json               node N's own results: run directory, free space, GPUs, its link to node 0
        preflight.json              the verdict: the node(s) named, the reason, every figure, its cost
      notify/                       ``notify:``: events/ recorded once, sent/ per channel, notify.log

A sweep (``orchestrator sweep``) is a directory of run directories: ``<sweep_dir>/sweep.json`` (the grid, each
task's parameters), ``<sweep_dir>/sbatch.sh`` (the job array's script, Slurm) and one run directory
``<sweep_dir>/task_<i>/`` per grid point, laid out as above. A local sweep (no job arrays) also has
``<sweep_dir>/sweep.log``, the output of the process that starts its tasks K at a time,
``<sweep_dir>/local_pids.json`` (that process's pid) and ``<sweep_dir>/cancel_requested.json`` once the sweep
was cancelled; ``<sweep_dir>/notify/`` (its end, notified once); ``<sweep_dir>/budget_refused.json``, the
tasks a sweep's ``--budget`` refused and why.

Attempts are numbered across every job that used the run directory: a submission starts at
:func:`next_attempt`, and a Slurm requeue of the same job adds one (:func:`attempt_number`); a
restart inside the allocation (``restarts.jsonl``), and a requeue after one, takes the number after
every attempt logged (:func:`next_attempt`). A submission
reserves its number by creating ``job.attempt_<A>.json`` exclusively (:func:`reserve_attempt`): two
submissions never share an attempt, and none overwrites another's.

Permissions: the run directory and everything in it are owner-only (0700 directories, 0600 files), like the
registry, because ``sbatch.sh`` carries the profile's ``env:`` values and the checkpoints the model. A
profile's ``share_with_group: true`` opens them to the group (0750 / 0640): ``contract/permissions.py``'s ``run_umask``
is the umask a submission runs (and its job inherits) under.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.hook_checkpoints import (
    hook_checkpoint_dirs,
    hook_checkpoint_folders,
    run_identity,
)
from orchestrator.contract.jsonfiles import read_json, write_json_atomic

JOB_FILE = "job.json"
JOB_ID_FILE = "job_id"
SBATCH_FILE = "sbatch.sh"
SUBMITIT_DIR = "submitit"
ARRAY_TASK_FILE = "array_task.pkl"
SWEEP_FILE = "sweep.json"
SWEEP_LOG = "sweep.log"
SNAPSHOT_DIR = "snapshot"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE.json"
CORRUPT_MARKER = "CORRUPT.json"
RUN_LOCK_FILE = ".run.lock"
EXIT_STATUS_FILE = "exit_status.json"
DECISIONS_FILE = "auto_resume.jsonl"
#: Restarts inside the allocation (the batch step relaunched the training step), one JSON a line.
RESTARTS_FILE = "restarts.jsonl"
START_ESTIMATES_FILE = "start_estimates.jsonl"
CANCEL_MARKER = "cancel_requested.json"
BUDGET_STOP_FILE = "budget_stop.json"
BUDGET_METER_FILE = "budget.json"
#: In a sweep directory: the tasks its budget refused, ``{task: reason}`` (the local starter writes it).
SWEEP_REFUSED_FILE = "budget_refused.json"
LOCAL_PIDS_FILE = "local_pids.json"
LOCAL_STATE_FILE = "local_state.json"
#: ``node_<N>.held.json`` (a name per node: the layout says it as node_<N>)
NODE_HELD_PATTERN = "node_{node}.held.json"
LOGS_DIR = "logs"
MAIN_IP_FILE = "main_ip"
ATTEMPT_START_FILE = "start.json"
HEARTBEAT_DIR = "heartbeat"
RANK_PIDS_FILE = "rank_pids.json"
HANG_DIR = "hang"
HANG_REPORT_FILE = "hang.json"
PREFLIGHT_DIR = "preflight"
PREFLIGHT_REPORT_FILE = "preflight.json"
NOTIFY_DIR = "notify"

#: Exit codes of a training process, as the launcher and ``status`` read them.
EXIT_OK = 0
EXIT_SELFCHECK = 3
"""The training self-check found the launch is not what was asked (world size, strategy)."""
EXIT_BAD_RESTORE = 4
"""A resume restored state that does not match the checkpoint's checksums."""
EXIT_REQUEUE = 75
"""Checkpointed on a stop signal and wants to be requeued (EX_TEMPFAIL)."""

_CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
_ATTEMPT_RE = re.compile(r"^attempt_(\d+)$")
_ATTEMPT_PLAN_RE = re.compile(r"^job\.attempt_(\d+)\.json$")
NODE_LOG_RE = re.compile(r"^node_(\d+)\.log$")
NODE_EXIT_RE = re.compile(r"^node_(\d+)\.exit$")
NODE_RANKS_RE = re.compile(r"^node_(\d+)_ranks$")


# ---------------------------------------------------------------------------- plans
def plan_file(run_dir: Path, attempt_base: int) -> Path:
    """The immutable plan of the submission that started at ``attempt_base``."""
    return Path(run_dir) / f"job.attempt_{attempt_base}.json"


def write_plan(run_dir: Path, attempt_base: int, data: dict[str, Any]) -> None:
    """Record a submission's plan: its own file first, then ``job.json`` as the current plan."""
    record = {**data, "attempt_base": attempt_base}
    write_json_atomic(plan_file(run_dir, attempt_base), record, indent=2)
    write_json_atomic(Path(run_dir) / JOB_FILE, record, indent=2)


def reserve_attempt(run_dir: Path, data: dict[str, Any], first: int | None = None) -> int:
    """Create the next ``job.attempt_<A>.json`` exclusively (``O_EXCL``) and return ``A``: a number
    another submission already took is never reused or overwritten. ``job.json`` is left alone
    until the submission is made (:func:`set_current_plan`)."""
    attempt = next_attempt(run_dir) if first is None else first
    while True:
        path = plan_file(run_dir, attempt)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            attempt += 1
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({**data, "attempt_base": attempt}, fh, indent=2)
        return attempt


def set_current_plan(run_dir: Path, attempt_base: int) -> None:
    """Make the plan of the submission at ``attempt_base`` the run's current one (``job.json``)."""
    data = read_json(plan_file(run_dir, attempt_base))
    if data is not None:
        write_json_atomic(Path(run_dir) / JOB_FILE, data, indent=2)


def read_job_json(run_dir: Path) -> dict[str, Any]:
    """``job.json`` (the current plan) or an empty dict if it is missing or unreadable."""
    return read_json(Path(run_dir) / JOB_FILE) or {}


def read_plan_json(run_dir: Path, attempt_base: int) -> dict[str, Any] | None:
    """The plan the submission starting at ``attempt_base`` was made with. Run directories made
    before attempt files existed for attempt 0 kept that plan in ``job.json`` only."""
    data = read_json(plan_file(run_dir, attempt_base))
    if data is None and attempt_base == 0:
        data = read_json(Path(run_dir) / JOB_FILE)
    return data


def read_current_plan_json(run_dir: Path) -> dict[str, Any]:
    """The newest submission's plan. ``job.json`` is it; older run directories wrote later
    submissions only to ``job.attempt_<A>.json`` and kept the first plan in ``job.json``, so a newer
    attempt file wins."""
    current = read_job_json(run_dir)
    base = current.get("attempt_base", 0)
    newest = max(_plan_attempts(run_dir), default=-1)
    if isinstance(base, int) and newest > base:
        return read_json(plan_file(run_dir, newest)) or current
    return current


def _plan_attempts(run_dir: Path) -> Iterator[int]:
    try:
        names = os.listdir(run_dir)
    except OSError:
        return
    for name in names:
        m = _ATTEMPT_PLAN_RE.match(name)
        if m:
            yield int(m.group(1))


# ---------------------------------------------------------------------------- attempts
def attempt_number(attempt_base: int, restarts: int) -> int:
    """The attempt a job is in: where its submission started plus the scheduler's requeues."""
    return attempt_base + restarts


def attempt_dir(run_dir: Path, attempt: int) -> Path:
    return Path(run_dir) / LOGS_DIR / f"attempt_{attempt}"


def attempt_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """``[(attempt, path)]`` sorted by attempt number (attempt_10 after attempt_9)."""
    root = Path(run_dir) / LOGS_DIR
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    out = []
    for entry in entries:
        m = _ATTEMPT_RE.match(entry.name)
        if m and entry.is_dir():
            out.append((int(m.group(1)), Path(entry.path)))
    return sorted(out)


def next_attempt(run_dir: Path) -> int:
    """The attempt a new submission into ``run_dir`` starts at: after every attempt that logged and
    every submission that was planned (one that never ran still used its number)."""
    logged = [a for a, _ in attempt_dirs(run_dir)]
    planned = list(_plan_attempts(run_dir))
    if not planned and (Path(run_dir) / JOB_FILE).exists():
        planned = [0]
    return max([*logged, *planned], default=-1) + 1


def node_logs(attempt_path: Path) -> list[tuple[int, Path]]:
    """``[(node, path)]`` of ``node_<N>.log`` files in one attempt folder, sorted by node."""
    try:
        entries = list(os.scandir(attempt_path))
    except OSError:
        return []
    out = []
    for entry in entries:
        m = NODE_LOG_RE.match(entry.name)
        if m and entry.is_file():
            out.append((int(m.group(1)), Path(entry.path)))
    return sorted(out)


def node_log_file(attempt_path: Path, node: int) -> Path:
    return Path(attempt_path) / f"node_{node}.log"


def node_exit_file(attempt_path: Path, node: int) -> Path:
    return Path(attempt_path) / f"node_{node}.exit"


def node_pid_file(attempt_path: Path, node: int) -> Path:
    return Path(attempt_path) / f"node_{node}.pid"


def node_ranks_dir(attempt_path: Path, node: int) -> Path:
    return Path(attempt_path) / f"node_{node}_ranks"


def rank_pids_file(ranks_dir: Path) -> Path:
    """Where the direct launcher names its ranks' pids: a forked rank's ``/proc/<pid>/environ`` is
    still its launcher's, so it cannot be found by its ``RANK`` as torchrun's workers are."""
    return Path(ranks_dir) / RANK_PIDS_FILE


def heartbeat_dir(attempt_path: Path) -> Path:
    return Path(attempt_path) / HEARTBEAT_DIR


def heartbeat_file(attempt_path: Path, rank: int) -> Path:
    return heartbeat_dir(attempt_path) / f"rank_{rank}.json"


def hang_dir(run_dir: Path, attempt: int) -> Path:
    return Path(run_dir) / HANG_DIR / f"attempt_{attempt}"


def preflight_dir(run_dir: Path, attempt: int) -> Path:
    return Path(run_dir) / PREFLIGHT_DIR / f"attempt_{attempt}"


def rank_stack_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank_{rank}.txt"


def node_config_file(attempt_path: Path, node: int) -> Path:
    return Path(attempt_path) / f"accelerate_config.node{node}.yaml"


def node_deepspeed_config_file(attempt_path: Path, node: int) -> Path:
    return Path(attempt_path) / f"deepspeed_config.node{node}.json"


# ---------------------------------------------------------------------------- exit status
def write_exit_status(run_dir: Path, code: int, reason: str, **details: Any) -> None:
    """Rank 0's last word. Survives torchrun, which turns a worker's exit code into 1."""
    write_json_atomic(
        Path(run_dir) / EXIT_STATUS_FILE, {"code": code, "reason": reason, **details, "time": time.time()}
    )


def read_exit_status(run_dir: Path) -> dict[str, Any] | None:
    return read_json(Path(run_dir) / EXIT_STATUS_FILE)


def requeue_recorded_since(run_dir: Path, since: float) -> bool:
    """Did training checkpoint on a stop signal and ask for a requeue after ``since``? A record
    older than that belongs to an earlier attempt."""
    data = read_exit_status(run_dir) or {}
    when = data.get("time", 0)
    return data.get("code") == EXIT_REQUEUE and isinstance(when, (int, float)) and when >= since


# ---------------------------------------------------------------------------- cancel marker
def write_cancel_marker(run_dir: Path, signal_name: str, user: str | None = None) -> None:
    """Record that ``cancel`` was asked, so the job is not requeued and reads CANCELLED."""
    data = {"signal": signal_name, "time": time.time(), "user": user or os.environ.get("USER")}
    write_json_atomic(Path(run_dir) / CANCEL_MARKER, data)


def cancel_requested(run_dir: Path) -> bool:
    return (Path(run_dir) / CANCEL_MARKER).exists()


# ---------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint folder whose COMPLETE.json marker and listed files all check out."""

    step: int
    path: Path
    world_size: int | None
    strategy: str | None
    n_files: int
    total_bytes: int
    #: The run that wrote it (:func:`run_identity`), when its marker says.
    run: str | None = None


def checkpoint_folder_name(step: int) -> str:
    return f"step_{step:08d}"


def check_checkpoint(ckpt_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The one rule for a complete checkpoint: ``(marker, "")``, or ``(None, why not)``.

    Complete means: ``COMPLETE.json`` parses, names an integer step and a non-empty file list, and
    every listed file exists, is a regular file inside the folder, and has exactly the listed size.
    A save killed mid-way has no marker; a marker written before its data reached the disk (odd
    file systems) shows as a short file. ``stat`` only: ``status`` checks 1,000 runs per call.
    """
    marker_path = Path(ckpt_dir) / COMPLETE_MARKER
    corrupt = read_json(Path(ckpt_dir) / CORRUPT_MARKER)
    if corrupt is not None:
        return None, f"its content did not match {COMPLETE_MARKER}: {corrupt.get('reason', '?')}"
    marker = read_json(marker_path)
    if marker is None:
        if not marker_path.exists():
            return None, f"no {COMPLETE_MARKER} (the save did not finish)"
        return None, f"unreadable {COMPLETE_MARKER} (torn or not a JSON object)"
    files, step = marker.get("files"), marker.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None, f"{COMPLETE_MARKER} names no integer step"
    if not isinstance(files, dict) or not files:
        return None, f"{COMPLETE_MARKER} lists no files"
    for rel, size in files.items():
        rel_s = str(rel)
        # The marker is data, not trusted code: a path may not leave the folder. (A string check:
        # resolve() costs several syscalls per file.)
        if rel_s.startswith(("/", "\\")) or ".." in rel_s.replace("\\", "/").split("/"):
            return None, f"{COMPLETE_MARKER} lists a path outside the checkpoint: {rel_s}"
        try:
            st = os.stat(os.path.join(ckpt_dir, rel_s))
        except OSError:
            return None, f"missing file {rel_s}"
        if not stat.S_ISREG(st.st_mode):
            return None, f"{rel_s} is not a file"
        if type(size) is not int or st.st_size != size:
            return (
                None,
                f"file {rel_s} has {st.st_size} bytes, {COMPLETE_MARKER} says {size} (truncated or torn)",
            )
    return marker, ""


def verify_checkpoint(ckpt_dir: Path) -> CheckpointInfo | None:
    """:func:`check_checkpoint` as a :class:`CheckpointInfo`, or None when incomplete."""
    marker, _why = check_checkpoint(ckpt_dir)
    if marker is None:
        return None
    files = marker["files"]
    ws, strategy = marker.get("world_size"), marker.get("strategy")
    return CheckpointInfo(
        step=marker["step"],
        path=Path(ckpt_dir),
        world_size=ws if isinstance(ws, int) and not isinstance(ws, bool) else None,
        strategy=strategy if isinstance(strategy, str) else None,
        n_files=len(files),
        total_bytes=sum(files.values()),
        run=marker["run"] if isinstance(marker.get("run"), str) else None,
    )


def checkpoint_folders(run_dir: Path) -> list[tuple[int, Path]]:
    """``[(step, folder)]`` of every ``step_*`` folder, newest first (not yet checked); temp and
    trash folders are never candidates."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    found = []
    for entry in entries:
        m = _CHECKPOINT_RE.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), Path(entry.path)))
    return sorted(found, reverse=True)


def all_checkpoint_folders(run_dir: Path) -> list[tuple[int, Path, bool]]:
    """``[(step, folder, in_run_dir)]``: the run's own ``step_*`` folders and the ``checkpoint-N``
    folders of the directories its hook recorded, newest first (not yet checked)."""
    found = [(step, path, True) for step, path in checkpoint_folders(run_dir)]
    for folder in hook_checkpoint_dirs(run_dir):
        found += [(step, path, False) for step, path in hook_checkpoint_folders(folder)]
    return sorted(found, key=lambda t: (t[0], t[2]), reverse=True)


def last_complete_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """Newest checkpoint of the run that is complete by :func:`check_checkpoint`; torn ones are
    skipped. Besides ``checkpoints/step_*``, the ``checkpoint-N`` folders in the directories the
    run's hook recorded (``checkpoint_dirs.json``) whose marker names this run."""
    own = None
    for _, path, in_run_dir in all_checkpoint_folders(run_dir):
        info = verify_checkpoint(path)
        if info is None:
            continue
        if not in_run_dir:
            own = own or run_identity(run_dir)
            if info.run != own:
                continue
        return info
    return None


def corrupt_checkpoints(run_dir: Path) -> list[tuple[int, str]]:
    """``[(step, reason)]`` of the checkpoints a restore skipped as corrupt, newest first."""
    out, own = [], run_identity(run_dir)
    for step, path, in_run_dir in all_checkpoint_folders(run_dir):
        data = read_json(path / CORRUPT_MARKER)
        if data is not None and (in_run_dir or (read_json(path / COMPLETE_MARKER) or {}).get("run") == own):
            out.append((step, str(data.get("reason", "?"))))
    return out
