"""Commands that do not train import neither torch nor accelerate, and every --help works.

Each command runs in a fresh interpreter through a small wrapper that calls
``orchestrator.cli.main.main`` and then reports which torch/accelerate modules are in
``sys.modules``. No timing assertions: the import list is what keeps start-up fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.main import COMMANDS, MODULES
from tests.helpers.cli import REPO

HEAVY = ("torch", "accelerate")

WRAPPER = """\
import json, sys
args = json.loads(sys.argv[1])
rc = 0
try:
    from orchestrator.cli.main import main
    rc = main(args)
except SystemExit as exc:  # argparse's --help and usage errors
    rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
finally:
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
    sys.stderr.write("\\nHEAVY_MODULES=" + json.dumps(heavy) + "\\n")
sys.exit(rc)
""".replace("{heavy!r}", repr(HEAVY))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["ORCHESTRATOR_HOME"] = str(tmp_path / "home")
    env["ORCHESTRATOR_RUNS"] = str(tmp_path / "runs")
    return env


def run_wrapped(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, json.dumps(args)],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    marker = [line for line in proc.stderr.splitlines() if line.startswith("HEAVY_MODULES=")]
    assert marker, f"wrapper did not report (crashed?):\n{proc.stderr}"
    return proc, json.loads(marker[-1].split("=", 1)[1])


LIGHT_COMMANDS = [
    pytest.param(["--help"], id="help"),
    pytest.param([], id="no-args"),
    pytest.param(["render"], id="render-local"),
    pytest.param(
        ["render", "--profile", "slurm_a100", "--strategy", "hybrid_shard", "--", "train.py"],
        id="render-a100",
    ),
    pytest.param(["render", "--profile", "slurm_test", "--out", "rendered"], id="render-out"),
    pytest.param(["profiles", "list"], id="profiles-list"),
    pytest.param(["profiles", "show", "slurm_h100"], id="profiles-show"),
    pytest.param(["profiles", "validate"], id="profiles-validate"),
    pytest.param(["strategies"], id="strategies"),
    pytest.param(["strategies", "--json"], id="strategies-json"),
    pytest.param(["export", "--help"], id="export-help"),
]


@pytest.mark.parametrize("args", LIGHT_COMMANDS)
def test_no_torch_or_accelerate(args: list[str], tmp_path: Path) -> None:
    proc, heavy = run_wrapped(args, tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert heavy == [], f"orchestrator {' '.join(args)} imported {heavy[:5]}"
    assert proc.returncode == (2 if args == [] else 0), proc.stderr
    assert proc.stdout.strip()


def test_importtime_render(tmp_path: Path) -> None:
    """Second route: -X importtime of the real `python -m orchestrator render`."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "orchestrator", "render", "--profile", "slurm_a100"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "orchestrator.config.render" in imported
    assert not [m for m in imported if m.split(".")[0] in HEAVY]


def test_every_command_has_its_module() -> None:
    """A command listed in the CLI whose module is missing is a broken command, not one to skip."""
    missing = [n for n in COMMANDS if not importlib.util.find_spec(f"orchestrator.cli.{MODULES.get(n, n)}")]
    assert missing == []


@pytest.mark.parametrize("command", list(COMMANDS))
def test_subcommand_help(command: str, tmp_path: Path) -> None:
    proc, _heavy = run_wrapped([command, "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.startswith(f"usage: orchestrator {command}"), proc.stdout[:200]
    assert COMMANDS[command].split()[0] in proc.stdout


def test_top_level_help_lists_every_command(tmp_path: Path) -> None:
    proc, _ = run_wrapped(["--help"], tmp_path)
    for command in COMMANDS:
        assert command in proc.stdout
    assert "Exit codes" in proc.stdout
