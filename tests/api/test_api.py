"""The Python API without a cluster: start-up cost, one planning path with the CLI, sweep planning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract.errors import UserError
from tests.helpers.cli import REPO, run_cli

SCRIPT = str(REPO / "tests" / "scripts" / "sweep_task.py")


def test_import_orchestrator_and_its_api_import_no_torch() -> None:
    code = (
        "import sys, orchestrator; orchestrator.submit; orchestrator.sweep; orchestrator.get_job; "
        "import orchestrator.api, orchestrator.runner.sweep_submit, orchestrator.runner.sweep_status; "
        "print(sorted(m for m in ('torch', 'accelerate', 'transformers', 'deepspeed', 'submitit') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_api_and_the_cli_build_the_same_plan(orch_env: dict[str, str]) -> None:
    """``orchestrator.make_plan`` is the plan ``submit --dry-run`` shows: same keywords, same defaults."""
    import orchestrator

    plan = orchestrator.make_plan(
        profile="slurm_a100",
        strategy="full_shard",
        script=SCRIPT,
        args=["--lr", "3e-4"],
        nodes=2,
        after=["12:any"],
        options={"mixed_precision": "bf16"},
    )
    res = run_cli(
        ["render", "--profile", "slurm_a100", "--strategy", "full_shard", "--nodes", "2"]
        + ["--after", "12:any", "--mixed-precision", "bf16", "--", SCRIPT, "--lr", "3e-4"],
        orch_env,
    )
    assert res.returncode == 0, res.stderr
    from orchestrator.config.render import render_sbatch

    assert plan.after == ("afterany:12",) and plan.options.mixed_precision == "bf16"
    sbatch = render_sbatch(plan, "/SAMPLE/run_dir", "/SAMPLE/run_dir/submitit", sys.executable)
    assert "#SBATCH --dependency=afterany:12\n#SBATCH --kill-on-invalid-dep=yes\n" in sbatch
    assert "#SBATCH --dependency=afterany:12" in res.stdout
    with pytest.raises(UserError, match="unknown option 'mixed'"):
        orchestrator.make_plan(script=SCRIPT, options={"mixed": "bf16"})
    with pytest.raises(UserError, match="runs locally"):
        orchestrator.submit(profile="local", script=SCRIPT, after=["3"])


def test_sweep_plans_fill_each_grid_point(tmp_path: Path) -> None:
    import orchestrator
    from orchestrator.config.sweep_plan import grid_from_yaml, parse_grid, sweep_plans

    base = orchestrator.make_plan(profile="slurm_a100", script=SCRIPT, args=["--lr={lr}", "--seed", "{seed}"])
    points = sweep_plans(base, parse_grid(["lr=1e-3,3e-4", "seed=0,1"]))
    assert [(p, plan.script_args) for p, plan in points] == [
        ({"lr": "1e-3", "seed": "0"}, ["--lr=1e-3", "--seed", "0"]),
        ({"lr": "1e-3", "seed": "1"}, ["--lr=1e-3", "--seed", "1"]),
        ({"lr": "3e-4", "seed": "0"}, ["--lr=3e-4", "--seed", "0"]),
        ({"lr": "3e-4", "seed": "1"}, ["--lr=3e-4", "--seed", "1"]),
    ]
    assert {plan.script_args[0] for _, plan in points} == {"--lr=1e-3", "--lr=3e-4"}
    assert all(plan.options == base.options and plan.nodes == base.nodes for _, plan in points)
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text("grid:\n  lr: [0.001, 3.0e-4]\n  seed: [0, 1]\nmax_parallel: 2\n")
    assert grid_from_yaml(sweep_file) == (parse_grid(["lr=0.001,0.0003", "seed=0,1"]), {"max_parallel": 2})
    sweep_file.write_text("grid: {lr: [1]}\nparallel: 2\n")
    with pytest.raises(UserError, match="unknown key"):
        grid_from_yaml(sweep_file)


def test_the_registry_keeps_sweeps(tmp_path: Path) -> None:
    from orchestrator.registry.store import Registry

    with Registry.open(tmp_path) as reg:
        for i in range(3):
            reg.add_job(
                job_id=f"9_{i}", name="s", profile="p", scheduler="slurm", strategy="ddp", nodes=2,
                procs_per_node=1, command=["x"], run_dir=tmp_path / f"task_{i}",
            )  # fmt: skip
        reg.add_sweep(
            sweep_id="9", name="s", scheduler="slurm", sweep_dir=tmp_path, grid={"lr": ["1", "2", "3"]},
            max_parallel=2, tasks=[(i, f"9_{i}", {"lr": str(i + 1)}) for i in range(3)],
        )  # fmt: skip
        sweep = reg.get_sweep("9")
        assert sweep.job_ids == ["9_0", "9_1", "9_2"] and sweep.tasks[2].params == {"lr": "3"}
        assert reg.sweep_of(["9_1", "7"]) == {"9_1": ("9", 1)}
        assert [s.sweep_id for s in reg.list_sweeps()] == ["9"]
        assert json.loads(json.dumps(sweep.to_json()))["max_parallel"] == 2
        with pytest.raises(UserError, match="unknown sweep id"):
            reg.get_sweep("8")
