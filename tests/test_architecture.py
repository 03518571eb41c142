"""The architecture's rules, checked on the source: one place asks which scheduler it is, one place
reads ``SLURM_*``, one definition of each exit code, one rule for a complete checkpoint, and the
run-directory contract importable with the standard library alone."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract import run_dir
from tests.helpers.cli import REPO

PACKAGE = REPO / "orchestrator"
SCHEDULERS = PACKAGE / "schedulers"
#: "No module is over ~500 lines": past this a module has more than one job.
MAX_MODULE_LINES = 500


def sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def test_no_code_outside_the_schedulers_asks_which_scheduler_it_is() -> None:
    branch = re.compile(r"""scheduler\s*[!=]=\s*['"](slurm|local)['"]""")
    hits = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in sources(PACKAGE)
        if SCHEDULERS not in p.parents
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert hits == []


def test_only_the_slurm_scheduler_reads_slurm_variables() -> None:
    reads = re.compile(r"""["']SLURM_[A-Z_]+["']""")
    hits = [
        f"{p.relative_to(REPO)}:{n}"
        for p in sources(PACKAGE)
        if p != SCHEDULERS / "slurm" / "environment.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert hits == []


def test_modules_stay_small() -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in sources(PACKAGE)}
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


@pytest.mark.parametrize("name", ["EXIT_REQUEUE", "EXIT_SELFCHECK", "EXIT_BAD_RESTORE"])
def test_each_exit_code_is_defined_once(name: str) -> None:
    definition = re.compile(rf"^\s*{name}\s*(:[^=]+)?=", re.M)
    defined_in = [
        str(p.relative_to(REPO)) for p in sources(PACKAGE, REPO / "train") if definition.search(p.read_text())
    ]
    assert defined_in == ["orchestrator/contract/run_dir.py"]


def test_the_training_program_uses_the_contract_objects_themselves() -> None:
    from orchestrator.rank import selfcheck
    from train import checkpointing
    from train import train as train_main

    assert train_main.EXIT_REQUEUE is run_dir.EXIT_REQUEUE
    assert selfcheck.EXIT_SELFCHECK is run_dir.EXIT_SELFCHECK
    assert checkpointing.MARKER == run_dir.COMPLETE_MARKER


def _checkpoint(root: Path, name: str, files: dict[str, bytes], marker: object) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    if marker is not None:
        (folder / run_dir.COMPLETE_MARKER).write_text(
            marker if isinstance(marker, str) else json.dumps(marker)
        )
    return folder


def test_one_rule_for_a_complete_checkpoint(tmp_path: Path) -> None:
    """``resume`` and ``status`` (orchestrator.contract.run_dir) and training itself (train/checkpointing) agree
    on every kind of checkpoint, complete or torn."""
    from train import checkpointing

    shard = {"model/__0_0.distcp": b"x" * 10, "model/.metadata": b"m"}
    sizes = {k: len(v) for k, v in shard.items()}
    cases = {
        "complete": (shard, {"step": 4, "files": sizes}, True),
        "no marker": (shard, None, False),
        "torn marker": (shard, '{"step": 4, "fi', False),
        "short file": ({**shard, "model/__0_0.distcp": b"x" * 9}, {"step": 4, "files": sizes}, False),
        "missing file": ({"model/.metadata": b"m"}, {"step": 4, "files": sizes}, False),
        "no files listed": (shard, {"step": 4, "files": {}}, False),
        "no step": (shard, {"files": sizes}, False),
        "path escapes": (shard, {"step": 4, "files": {**sizes, "../outside": 1}}, False),
        "a folder listed": (shard, {"step": 4, "files": {"model": 4096}}, False),
    }
    for i, (label, (files, marker, complete)) in enumerate(cases.items()):
        folder = _checkpoint(tmp_path, f"step_{i:08d}", files, marker)
        ours = run_dir.verify_checkpoint(folder) is not None
        theirs = checkpointing.validate(folder)[0] is not None
        assert (ours, theirs) == (complete, complete), label


def test_the_run_dir_contract_needs_only_the_standard_library() -> None:
    code = (
        "import sys, orchestrator.contract.run_dir as r; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('orchestrator', 'yaml', 'pydantic', 'jinja2', 'psutil', 'submitit', 'torch', 'accelerate')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(
        [
            "orchestrator",
            "orchestrator.contract",
            "orchestrator.contract.hook_checkpoints",
            "orchestrator.contract.jsonfiles",
            "orchestrator.contract.run_dir",
        ]
    )


def test_every_scheduler_name_has_its_implementation() -> None:
    from orchestrator.config.scheduler_kinds import SCHEDULER_NAMES
    from orchestrator.schedulers import IMPLEMENTATIONS, get_scheduler

    assert tuple(IMPLEMENTATIONS) == SCHEDULER_NAMES
    assert [get_scheduler(name).name for name in SCHEDULER_NAMES] == list(SCHEDULER_NAMES)
