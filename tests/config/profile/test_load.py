"""Cluster profiles: loading, the search order, and the built-ins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
from orchestrator.config.profile.load import (
    ClusterProfile,
    available_profiles,
    builtin_profiles_dir,
    load_profile,
    parse_profile,
    profile_search_path,
)
from orchestrator.contract.errors import UserError
from tests.helpers.cli import REPO

BUILTINS = sorted(p.stem for p in (REPO / "cluster_profiles").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user profiles leak in: empty working directory, no $ORCHESTRATOR_PROFILES."""
    monkeypatch.delenv("ORCHESTRATOR_PROFILES", raising=False)
    monkeypatch.delenv("ORCHESTRATOR_PROFILE", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)


def write_profile(folder: Path, name: str, description: str, scheduler: str = "local") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(
        f"description: {description}\nscheduler: {scheduler}\n"
        + ("partition: p\n" if scheduler == "slurm" else "")
    )
    return path


# ---------------------------------------------------------------------------- built-ins


def test_builtins_are_the_shipped_files() -> None:
    assert builtin_profiles_dir().resolve() == (REPO / "cluster_profiles").resolve()
    assert {"local", "slurm_a100", "slurm_h100", "slurm_test"} <= set(BUILTINS)
    assert set(BUILTINS) <= set(available_profiles())


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_validates(name: str) -> None:
    loaded_name, path, profile = load_profile(name)
    assert loaded_name == name
    assert path.resolve() == (REPO / "cluster_profiles" / f"{name}.yaml").resolve()
    assert isinstance(profile, ClusterProfile)
    assert profile.description, "shown by `profiles list`"
    if profile.scheduler == "slurm":
        assert profile.partition
    # The profile's own defaults make a valid plan (render with no options works).
    options = merge_options(profile)
    plan = build_plan(name, profile, options, "train.py")
    assert plan.world_size == plan.nodes * plan.procs_per_node
    # JSON round trip (what submit stores for resume) gives the same plan back.
    again = LaunchPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan


def test_builtin_facts() -> None:
    local = load_profile("local")[2]
    assert (local.scheduler, local.gpus_per_node, local.default_procs_per_node) == ("local", 0, 2)
    assert local.supports_bf16 and not local.supports_fp16
    a100 = load_profile("slurm_a100")[2]
    assert a100.default_procs_per_node == 8 and a100.supports_bf16 and a100.supports_fp16
    assert a100.nodes.max == 32 and a100.defaults.strategy == "full_shard"
    h100 = load_profile("slurm_h100")[2]
    assert h100.defaults.strategy == "hybrid_shard" and h100.nodes.default >= 2
    test = load_profile("slurm_test")[2]
    assert test.partition == "debug" and test.gpus_per_node == 0


def test_gpu_precision_support() -> None:
    v100 = parse_profile("scheduler: slurm\npartition: p\ngpus_per_node: 4\ngpu_type: V100\n", "v100.yaml")
    assert not v100.supports_bf16 and v100.supports_fp16
    assert v100.default_procs_per_node == 4


def test_parse_profile_fills_defaults() -> None:
    profile = parse_profile("scheduler: local\n", "x.yaml")
    assert profile.nodes.default == 1 and profile.nodes.max == 1
    assert profile.time_limit == "01:00:00"
    assert profile.port_range.start <= profile.port_range.end
    assert profile.defaults.strategy == "ddp" and profile.defaults.fsdp_version == 2


def test_parse_profile_names_source_in_error() -> None:
    with pytest.raises(UserError) as err:
        parse_profile("scheduler: local\nnodes: {max: two}\n", "some/where.yaml")
    assert str(err.value) == "some/where.yaml: nodes.max: expected an integer, got 'two'"


def test_several_problems_one_line_each() -> None:
    with pytest.raises(UserError) as err:
        parse_profile("scheduler: local\ngpus_per_node: x\ncpus_per_task: y\nfoo: 1\n", "p.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 3
    assert all(line.startswith("p.yaml: ") for line in lines)


def test_python_key() -> None:
    """The node-side interpreter: None (the submitting one) unless the profile names one."""
    assert parse_profile("scheduler: local\n", "p.yaml").python is None
    for value in ("python3", "/shared/venvs/train/bin/python"):
        profile = parse_profile(f"scheduler: local\npython: {value}\n", "p.yaml")
        assert profile.python == value
        assert ClusterProfile.model_validate(profile.model_dump(mode="json"), strict=False) == profile


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('python: "py\\nthon"', "a non-empty single-line path or command name"),
        ('python: ""', "a non-empty single-line path or command name"),
        ("python: 3", "a string"),
        ("pyhton: python3", "unknown key (did you mean 'python'?)"),
    ],
)
def test_python_key_refused_with_the_key_named(text: str, expected: str) -> None:
    with pytest.raises(UserError) as err:
        parse_profile(f"scheduler: local\n{text}\n", "p.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("p.yaml: py") and expected in message, message


def test_cli_refuses_bad_python_key(tmp_path: Path) -> None:
    """Exit 2, one line naming the file and key, no traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text('scheduler: local\npython: ""\n')
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "render", "--profile", str(path), "--", "train/train.py"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "bad.yaml: python: expected a non-empty single-line path" in proc.stderr.strip(), proc.stderr


# ---------------------------------------------------------------------------- search order


def test_search_path_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = tmp_path / "explicit"
    from_env = tmp_path / "from_env"
    monkeypatch.setenv("ORCHESTRATOR_PROFILES", str(from_env))
    path = profile_search_path(explicit)
    assert path == [
        explicit.resolve(),
        from_env.resolve(),
        (Path.cwd() / "cluster_profiles").resolve(),
        builtin_profiles_dir().resolve(),
    ]


def test_search_path_deduplicates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    same = Path.cwd() / "cluster_profiles"
    monkeypatch.setenv("ORCHESTRATOR_PROFILES", str(same))
    path = profile_search_path(same)
    assert path.count(same.resolve()) == 1


def test_cwd_cluster_profiles_overrides_builtin() -> None:
    write_profile(Path.cwd() / "cluster_profiles", "local", "from cwd")
    name, path, profile = load_profile("local")
    assert profile.description == "from cwd"
    assert path.resolve() == (Path.cwd() / "cluster_profiles" / "local.yaml").resolve()
    assert name == "local"


def test_env_overrides_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_profile(Path.cwd() / "cluster_profiles", "local", "from cwd")
    write_profile(tmp_path / "env_dir", "local", "from env")
    monkeypatch.setenv("ORCHESTRATOR_PROFILES", str(tmp_path / "env_dir"))
    assert load_profile("local")[2].description == "from env"


def test_profiles_dir_overrides_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_profile(Path.cwd() / "cluster_profiles", "local", "from cwd")
    write_profile(tmp_path / "env_dir", "local", "from env")
    write_profile(tmp_path / "mine", "local", "from --profiles-dir")
    monkeypatch.setenv("ORCHESTRATOR_PROFILES", str(tmp_path / "env_dir"))
    assert load_profile("local", tmp_path / "mine")[2].description == "from --profiles-dir"


def test_user_folders_add_new_names_and_keep_builtins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_profile(tmp_path / "mine", "mycluster", "mine", scheduler="slurm")
    write_profile(tmp_path / "env_dir", "envcluster", "env")
    monkeypatch.setenv("ORCHESTRATOR_PROFILES", str(tmp_path / "env_dir"))
    found = available_profiles(tmp_path / "mine")
    assert {"mycluster", "envcluster", *BUILTINS} <= set(found)
    assert found["slurm_a100"].resolve() == (REPO / "cluster_profiles" / "slurm_a100.yaml").resolve()
    assert load_profile("mycluster", tmp_path / "mine")[2].scheduler == "slurm"


def test_missing_folders_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATOR_PROFILES", str(tmp_path / "does_not_exist"))
    assert set(BUILTINS) <= set(available_profiles(tmp_path / "nor_this"))


def test_load_by_path(tmp_path: Path) -> None:
    path = write_profile(tmp_path / "anywhere", "odd_name", "by path")
    name, found, profile = load_profile(str(path))
    assert (name, found, profile.description) == ("odd_name", path, "by path")


def test_unknown_profile_did_you_mean() -> None:
    with pytest.raises(UserError, match=r"unknown profile 'slurm_h10' \(did you mean 'slurm_h100'\?\)"):
        load_profile("slurm_h10")


def test_bad_override_is_reported_not_skipped() -> None:
    """A broken user profile must not silently fall back to the built-in of that name."""
    folder = Path.cwd() / "cluster_profiles"
    folder.mkdir()
    (folder / "local.yaml").write_text("scheduler: local\nnodes: {max: two}\n")
    with pytest.raises(UserError, match=r"^cluster_profiles/local\.yaml: nodes\.max: expected an integer"):
        load_profile("local")


# ---------------------------------------------------------------------------- through the CLI


def _cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_list_and_show_follow_search_order(tmp_path: Path) -> None:
    cwd = Path.cwd()
    write_profile(cwd / "cluster_profiles", "local", "from cwd")
    write_profile(tmp_path / "env_dir", "slurm_test", "from env", scheduler="slurm")
    write_profile(tmp_path / "mine", "local", "from --profiles-dir")
    (cwd / "cluster_profiles" / "broken.yaml").write_text("scheduler: [\n")

    listed = _cli(["profiles", "--profiles-dir", str(tmp_path / "mine"), "list", "--json"], cwd,
                  ORCHESTRATOR_PROFILES=str(tmp_path / "env_dir"))  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["local"]["description"] == "from --profiles-dir"
    assert rows["slurm_test"]["description"] == "from env"
    assert rows["broken"]["scheduler"] == "INVALID"
    assert "malformed YAML" in rows["broken"]["description"]
    assert rows["slurm_a100"]["scheduler"] == "slurm"

    shown = _cli(["profiles", "show", "local", "--json"], cwd)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["profile"]["description"] == "from cwd"


def test_cli_validate_builtins_ok() -> None:
    result = _cli(["profiles", "validate", *BUILTINS], Path.cwd())
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stdout.splitlines() if line.startswith("ok  ")]) == len(BUILTINS)
