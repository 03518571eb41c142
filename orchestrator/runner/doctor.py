"""``orchestrator doctor PROFILE``: a short step on N nodes that checks what a job relies on, before
the first job does.

The scheduler starts the step (:meth:`Scheduler.doctor_step`: a new allocation with the profile's
partition, account, QOS, GPUs), each task runs the profile's set-up lines and environment exactly
as a job's node task does, then :mod:`orchestrator.node.doctor` with the interpreter they give. This
module writes the host's file into a fresh folder in the run root, reads every task's output lines
as they come (the node's clock line stamped with the host's clock on arrival: the skew), checks
which node files the host sees, and hands it all to the pure decision
(:func:`orchestrator.supervise.doctor.diagnose`). The folder is removed when every check passed;
kept (and named) otherwise.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config.container import image_start_argv, image_to_check
from orchestrator.config.profile.load import load_profile
from orchestrator.config.render import shell_quote
from orchestrator.contract.errors import UserError
from orchestrator.runner.submission import check_runs_root
from orchestrator.schedulers import get_scheduler
from orchestrator.supervise.doctor import (
    CLOCK_MARKER,
    HOST_FILE,
    NO_PYTHON_MARKER,
    NODE_FILE,
    NODE_MODULE,
    NODE_NAME_VAR,
    REPORT_MARKER,
    Diagnosis,
    Expected,
    NodeResult,
    diagnose,
)

#: The whole doctor's bound: queueing for the nodes included. Past it the step is stopped and what
#: the nodes said so far is judged (a node that said nothing fails).
DOCTOR_TIMEOUT_S = 300.0
#: The run root's folder for the doctor's own files (one sub-folder per call).
DOCTOR_FOLDER = ".doctor"

_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")


@dataclass
class DoctorResult:
    profile: str
    nodes: int
    diagnosis: Diagnosis
    seconds: float
    folder: Path | None
    """Where the nodes' files were kept (a failure), None when removed."""

    @property
    def ok(self) -> bool:
        return not self.diagnosis.failed

    def as_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "nodes": self.nodes,
            "seconds": round(self.seconds, 2),
            "folder": None if self.folder is None else str(self.folder),
            **self.diagnosis.as_json(),
        }


def node_script(setup: list[str], env: dict[str, Any], python: str, spec: dict[str, Any]) -> str:
    """What each task runs: its clock and name, the set-up lines as written, the profile's
    environment (quoted: values are data), the interpreter looked up after them, the node's part."""
    lines = [
        "exec 2>&1",
        f'echo "{CLOCK_MARKER} $(date +%s.%N) ${{{NODE_NAME_VAR}:-$(hostname -s)}}"',
        *setup,
        *(f"export {name}={shell_quote(value)}" for name, value in sorted(env.items())),
        f'PY=$(command -v {shlex.quote(python)}) || {{ echo "{NO_PYTHON_MARKER}"; exit 1; }}',
        f'exec "$PY" -u -m {NODE_MODULE} {shlex.quote(json.dumps(spec))}',
    ]
    return "\n".join(lines) + "\n"


def read_step(
    argv: list[str], nodes: int, timeout_s: float
) -> tuple[list[NodeResult], list[str], list[str], int]:
    """Run the step; each task's lines sorted to its node (clock stamped on arrival). Also each task's
    node name, the lines that belong to no task (the scheduler's own words), the step's exit status."""
    results = [NodeResult(report=None) for _ in range(nodes)]
    names: dict[int, str] = {}
    other: list[str] = []
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            arrived = time.time()
            line = raw.rstrip("\n")
            m = _LABEL.match(line)
            if not m or int(m.group(1)) >= nodes:
                other.append(line)
                continue
            task, text = int(m.group(1)), m.group(2)
            result = results[task]
            words = text.split()
            if words[:1] == [CLOCK_MARKER] and len(words) >= 2:
                try:
                    result.skew_s = float(words[1]) - arrived
                except ValueError:
                    pass
                if len(words) >= 3:
                    names[task] = words[2]
            elif words[:1] == [REPORT_MARKER]:
                try:
                    result.report = json.loads(text[len(REPORT_MARKER) :])
                except json.JSONDecodeError:
                    result.output.append(text)
            elif words[:1] == [NO_PYTHON_MARKER]:
                result.no_python = True
            else:
                result.output.append(text)
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return results, [names.get(task, f"task{task}") for task in range(nodes)], other, code


def run_doctor(
    profile_name: str,
    version: str,
    nodes: int | None = None,
    profiles_dir: str | None = None,
    timeout_s: float = DOCTOR_TIMEOUT_S,
) -> DoctorResult:
    """Check the profile's nodes; UserError for a bad profile or node count (nothing started).
    ``version``: this orchestrator's, which the nodes must run too."""
    name, _, profile = load_profile(profile_name, profiles_dir)
    count = profile.nodes.default if nodes is None else nodes
    if count < 1 or count > profile.nodes.max:
        raise UserError(f"--nodes {count}: profile {name} allows 1 to {profile.nodes.max} nodes (nodes.max)")
    scheduler = get_scheduler(profile.scheduler)
    root = check_runs_root()
    folder = root / DOCTOR_FOLDER / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    python = profile.python or sys.executable
    token = secrets.token_hex(8)
    image = image_to_check(profile.container)
    start_argv = image_start_argv(profile)
    spec = {
        "scheduler": profile.scheduler,
        "folder": str(folder),
        "token": token,
        "gpus": profile.gpus_per_node,
        "image": image,
        "image_start": start_argv,
        "port_range": [profile.port_range.start, profile.port_range.end],
    }
    argv = scheduler.doctor_step(
        profile, count, node_script(list(profile.setup), dict(profile.env), python, spec)
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HOST_FILE).write_text(token)
    started = time.monotonic()
    results, node_names, other, code = read_step(argv, count, timeout_s)
    seconds = time.monotonic() - started
    for rank, result in enumerate(results):
        try:
            result.file_seen = (folder / NODE_FILE.format(rank=rank)).read_text() == token
        except OSError:
            result.file_seen = False
    want = Expected(
        nodes=node_names,
        gpus_per_node=profile.gpus_per_node,
        python=python,
        version=version,
        run_root=str(root),
        container=image is not None,
        min_bandwidth_mbps=profile.preflight.min_bandwidth_mbps,
        image_start=start_argv is not None,
    )
    step_error = None
    if code != 0 and not any(r.report for r in results):
        step_error = " ".join(line.strip() for line in other[-3:]) or f"the step exited {code}"
    diagnosis = diagnose(want, results, step_error)
    kept: Path | None = folder
    if not diagnosis.failed:
        shutil.rmtree(folder, ignore_errors=True)
        kept = None
    return DoctorResult(name, count, diagnosis, seconds, kept)
