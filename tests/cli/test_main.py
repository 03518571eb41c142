"""The command line guides (orchestrator/cli/main.py, commands/profiles.py, commands/submit.py): usage
errors are one line with a did-you-mean, `--version`, options after the action, `profiles validate`
refuses what `render` refuses, and submit names the next commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import REPO, run_cli


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_strategy_typo_gets_a_did_you_mean(orch_env: dict[str, str]) -> None:
    res = run_cli(["render", "--strategy", "fulshard"], orch_env, timeout=60)
    assert res.returncode == 2
    line = _one_line(res.stderr)
    assert line.startswith("orchestrator render: error: argument --strategy: invalid choice 'fulshard'")
    assert "(did you mean 'full_shard'?)" in line


def test_command_typo_gets_a_did_you_mean(orch_env: dict[str, str]) -> None:
    res = run_cli(["stauts"], orch_env, timeout=60)
    assert res.returncode == 2 and "did you mean 'status'?" in _one_line(res.stderr)


def test_version(orch_env: dict[str, str]) -> None:
    from orchestrator import __version__

    res = run_cli(["--version"], orch_env, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"orchestrator {__version__}"


def test_profiles_dir_after_the_action(orch_env: dict[str, str], tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tiny.yaml").write_text("description: mine\nscheduler: local\n")
    for args in (
        ["profiles", "list", "--profiles-dir", str(mine)],
        ["profiles", "--profiles-dir", str(mine), "list"],
    ):
        res = run_cli(args, orch_env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert "tiny" in res.stdout and "mine" in res.stdout


def test_wrap_cls_with_ddp_says_drop_it(orch_env: dict[str, str]) -> None:
    res = run_cli(["render", "--strategy", "ddp", "--wrap-cls", "Block"], orch_env, timeout=60)
    assert res.returncode == 2 and "drop --wrap-cls" in _one_line(res.stderr)


@pytest.mark.parametrize(
    "profile, key",
    [
        ("gpu_type: v100\ngpus_per_node: 8\npartition: gpu\nscheduler: slurm\n"
         "defaults: {strategy: full_shard, mixed_precision: bf16}\n", "defaults.mixed_precision"),
        ("scheduler: local\ndefaults: {strategy: full_shard, mixed_precision: fp16}\n", "defaults.mixed_precision"),
        ("scheduler: local\nnodes: {default: 1, max: 1}\ndefaults: {strategy: hybrid_shard}\n", "defaults.strategy"),
    ],
)  # fmt: skip
def test_profiles_validate_refuses_what_render_refuses(
    orch_env: dict[str, str], tmp_path: Path, profile: str, key: str
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(profile)
    render = run_cli(["render", "--profile", str(path)], orch_env, timeout=60)
    validate = run_cli(["profiles", "validate", str(path)], orch_env, timeout=60)
    assert render.returncode == 2 and validate.returncode == 2, validate.stdout + validate.stderr
    render_why = _one_line(render.stderr).split("error: ", 1)[1]
    validate_why = _one_line(validate.stderr).split("error: ", 1)[1]
    assert render_why == validate_why and key in validate_why and str(path) in validate_why


def test_builtin_profiles_still_validate(orch_env: dict[str, str]) -> None:
    res = run_cli(["profiles", "validate"], orch_env, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("ok  ") >= 4


def test_help_texts_tell_the_truth(orch_env: dict[str, str]) -> None:
    res = run_cli(["submit", "--help"], orch_env, timeout=60)
    text = " ".join(res.stdout.split())
    assert "1 on CPU" not in text and "local: 2" in text
    assert (REPO / "cluster_profiles" / "local.yaml").read_text().count("procs_per_node: 2") == 1
