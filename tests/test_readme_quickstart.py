"""The README's quick start, run out of the README text itself: its install line is the one CI runs
(.ci/run installs the suite's venv the same way), and its commands, in order, in a fresh folder
(with the repository's train/ and examples/), with a fresh registry: the demo completes, the Trainer
script is stopped as a preemption would stop it and `resume` continues it from its checkpoint."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import REPO

pytestmark = pytest.mark.slow


def quickstart_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return [line[4:] for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_the_install_line_is_the_one_ci_runs() -> None:
    install = next(line for line in quickstart_lines() if "pip install" in line)
    ci = next(line for line in (REPO / ".ci" / "run").read_text().splitlines() if "pip install" in line)
    quick_steps, ci_steps = install.split(" && "), ci.split(" && ")
    # the same venv and torch, then the package with extras CI's install covers (plot: matplotlib,
    # which the test extra has too)
    assert quick_steps[:-1] == ci_steps[: len(quick_steps) - 1]
    extras = re.fullmatch(r'pip install -e "\.\[(.*)\]"', quick_steps[-1])
    assert extras is not None, quick_steps[-1]
    assert set(extras.group(1).split(",")) <= {"train", "plot"}


def test_the_quick_start_commands_do_what_it_says(orch_env: dict[str, str], tmp_path: Path) -> None:
    commands = [
        line.split("  #")[0].strip() for line in quickstart_lines() if line.startswith("orchestrator ")
    ]
    assert [c.split()[1] for c in commands] == [
        "submit",
        "submit",
        "wait",
        "cancel",
        "wait",
        "resume",
        "status",
    ]
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("train", "examples"):
        (work / name).symlink_to(REPO / name)
    cli = [sys.executable, "-m", "orchestrator"]
    results = []
    for command in commands:
        words = shlex.split(command)
        res = subprocess.run(
            [*cli, *words[1:]], cwd=work, env=orch_env, capture_output=True, text=True, timeout=600
        )
        results.append((command, res))
    codes = [res.returncode for _, res in results]
    shown = "\n".join(f"$ {c}\n-> {r.returncode}\n{r.stdout[-1500:]}{r.stderr[-1500:]}" for c, r in results)
    # demo, submit, wait for its first checkpoint, cancel, wait (PREEMPTED), resume, status
    assert codes == [0, 0, 0, 0, 1, 0, 0], shown
    first = re.search(
        r"job local-2 RUNNING: its run has a complete checkpoint, step (\d+) \(checkpoint-\1\)",
        results[2][1].stdout,
    )
    assert first is not None, shown
    assert "job local-1 ended COMPLETED" in results[0][1].stdout, shown
    assert "ended PREEMPTED (checkpointed on a signal and stopped)" in results[4][1].stdout, shown
    resumed = re.search(r"resuming job local-2 from step (\d+) \(checkpoint-(\d+)\)", results[5][1].stdout)
    # the signal's own save, at or after the checkpoint `wait --for checkpoint` saw
    assert resumed is not None and int(resumed.group(1)) == int(resumed.group(2)) >= int(first.group(1)), (
        shown
    )
    assert "job local-3 ended COMPLETED" in results[5][1].stdout, shown
    assert re.search(r"local-2 .*PREEMPTED -> local-3 COMPLETED .* 1000/1000", results[6][1].stdout), shown
    assert (work / "trainer_out" / "checkpoint-1000").is_dir()  # the relative output_dir: where we ran
