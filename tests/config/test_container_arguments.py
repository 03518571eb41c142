"""No value of a job reaches a container runtime's argument list where the runtime could read it as
an option (``--container-image=--privileged`` became a ``podman run`` flag, an apptainer image
``--bind=/:/host`` mounted the node's root); a ``container:`` block on a scheduler that runs none is
refused, not ignored; ``render`` and ``submit --dry-run`` refuse a missing mount source exactly as
``submit`` does."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest
import yaml

from orchestrator.config.container import inner_command, step_flags, wrap_command
from orchestrator.config.plan import build_plan, merge_options
from orchestrator.config.profile.load import parse_profile
from orchestrator.config.render import render_sbatch
from orchestrator.contract.errors import UserError
from tests.helpers.cli import REPO, run_cli, user_profile_dir
from tests.helpers.container_plans import BASE, GOOD_IMAGE, SCRIPT, plan_with

RUNTIMES = ("pyxis", "apptainer", "podman", "oci")
#: Values a runtime's argument parser reads as an option (``-``: standard input for many).
OPTION_LIKE = ("--privileged", "-v", "--bind=/:/host", "-")
#: Every command that takes ``--container-image``: each refuses what the others refuse.
COMMANDS = (
    ["render"],
    ["submit", "--dry-run"],
    ["submit"],
    ["sweep", "--dry-run", "--grid", "lr=1,2"],
    ["sweep", "--grid", "lr=1,2"],
)


def _block(runtime: str, position: str | None = None, value: str = "") -> dict:
    block: dict = {"runtime": runtime, "image": GOOD_IMAGE[runtime]}
    if position is None:
        pass
    elif position == "image":
        block["image"] = value
    elif position == "mount source":
        block["mounts"] = [f"{value}:/data"]
    elif position == "mount target":
        block["mounts"] = [f"/data:{value}"]
    elif position == "mount options":
        block["mounts"] = [f"/data:/data:{value}"]
    else:
        block[position] = value
    return block


@pytest.mark.parametrize("value", OPTION_LIKE)
@pytest.mark.parametrize(
    "position", ["image", "mount source", "mount target", "mount options", "python", "workdir"]
)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_option_like_value_in_any_position_is_refused_by_the_profile(
    runtime: str, position: str, value: str
) -> None:
    text = yaml.safe_dump({**BASE, "container": _block(runtime, position, value)})
    with pytest.raises(UserError) as err:
        parse_profile(text, "/p/c.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("/p/c.yaml: container"), message
    assert value in message, message


@pytest.mark.parametrize("value", OPTION_LIKE)
@pytest.mark.parametrize("runtime", ["pyxis", "apptainer", "podman"])
@pytest.mark.parametrize("key", ["image", "python"])
def test_no_option_like_value_reaches_a_runtimes_argument_list_unguarded(
    runtime: str, key: str, value: str
) -> None:
    plan = plan_with(runtime, **{key: value})
    with pytest.raises(UserError, match=f"^container.{key}: .*got {value!r}$"):
        render_sbatch(plan, "/run", "/run/submitit", "python3")
    with pytest.raises(UserError, match=f"container.{key}"):
        if key == "python":
            inner_command(plan, "F")
        elif runtime == "pyxis":
            step_flags(plan, "/run")
        else:
            wrap_command(plan, "/run", "CMD")


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer", "podman"])
def test_every_value_in_a_runtimes_argument_list_is_a_path_or_not_option_like(runtime: str) -> None:
    """The words a user's values became: each is ours (a flag the runtime knows) or starts with
    something no option does."""
    plan = plan_with(runtime)
    words = shlex.split(" ".join(step_flags(plan, "/run")) or wrap_command(plan, "/run", "CMD"))
    ours = {"apptainer", "exec", "podman", "run", "--bind", "--pwd", "-v", "-e", "-w", "--rm", "--nv"}
    ours |= {"--device", "--read-only", "--rootfs", "--no-container-mount-home", "--"}
    if runtime == "podman":  # an image by name follows podman's end of options
        assert words[words.index(GOOD_IMAGE["podman"]) - 1] == "--", words
    for word in words:
        if word.startswith("-") and word not in ours:
            name = word.split("=", 1)[0]
            assert name in {"--network", "--ipc", "--pid", "--uts"} or name.startswith("--container-"), word


@pytest.mark.parametrize("value", [*OPTION_LIKE, "-e", "A-B"])
@pytest.mark.parametrize("key", ["container.env", "env"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_option_like_environment_name_is_refused_by_the_profile(
    runtime: str, key: str, value: str
) -> None:
    """Environment names reach ``podman run -e NAME``, pyxis' ``--container-env=NAMES`` and the image's
    ``env NAME=VALUE``: names like NCCL_IB_HCA only, in the profile's ``env:`` and the block's."""
    data = {**BASE, "container": _block(runtime)}
    if key == "env":
        data["env"] = {**BASE.get("env", {}), value: "1"}
    else:
        data["container"]["env"] = {value: "1"}
    with pytest.raises(UserError) as err:
        parse_profile(yaml.safe_dump(data), "/p/c.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"/p/c.yaml: {key}"), message
    assert repr(value) in message, message


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        "ORCHESTRATOR_HOME": str(tmp_path / "home"),
        "ORCHESTRATOR_RUNS": str(tmp_path / "runs"),
        "PATH": "/usr/bin:/bin",
    }


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_container_image_flag_that_reads_as_an_option_is_refused_for_every_runtime(
    tmp_path: Path, runtime: str
) -> None:
    profiles = user_profile_dir(tmp_path, container={"runtime": runtime, "image": GOOD_IMAGE[runtime]})
    env = _env(tmp_path)
    for value in OPTION_LIKE:
        for command in COMMANDS:
            flags = ["--profile", "slurm_test", "--profiles-dir", str(profiles), f"--container-image={value}"]
            res = run_cli([*command, *flags, "--", SCRIPT, "--lr", "{lr}"], env, timeout=60)
            assert res.returncode == 2, (command, value, res.stdout + res.stderr)
            assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
            assert "--container-image" in res.stderr and repr(value) in res.stderr, res.stderr
            assert res.stdout == "", res.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_container_block_on_the_local_scheduler_is_refused(tmp_path: Path) -> None:
    local = yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())
    for runtime in RUNTIMES:
        block = {"runtime": runtime, "image": GOOD_IMAGE[runtime]}
        with pytest.raises(UserError, match="^/p/l.yaml: container: scheduler 'local' runs no container"):
            parse_profile(yaml.safe_dump({**local, "container": block}), "/p/l.yaml")
    parse_profile(yaml.safe_dump({**local, "container": {"runtime": "none"}}), "/p/l.yaml")
    profiles = user_profile_dir(tmp_path, "local", container={"runtime": "podman", "image": "img:1"})
    for command in (["render"], ["submit", "--dry-run"], ["submit"]):
        res = run_cli(
            [*command, "--profile", "local", "--profiles-dir", str(profiles), "--", SCRIPT],
            _env(tmp_path),
            timeout=60,
        )
        assert res.returncode == 2, (command, res.stdout + res.stderr)
        assert res.stderr.count("\n") == 1, res.stderr
        assert "container: scheduler 'local' runs no container" in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_render_and_dry_run_refuse_a_missing_mount_source_as_submit_does(tmp_path: Path) -> None:
    for runtime in RUNTIMES:
        image = GOOD_IMAGE[runtime]
        if runtime == "oci":
            image = str(tmp_path / "rootfs")
            (tmp_path / "rootfs" / "usr").mkdir(parents=True, exist_ok=True)
        block = {"runtime": runtime, "image": image, "mounts": [f"{tmp_path}/absent:/d"]}
        profiles = user_profile_dir(tmp_path, container=block)
        said = []
        for command in (["render"], ["submit", "--dry-run"], ["submit"]):
            res = run_cli(
                [*command, "--profile", "slurm_test", "--profiles-dir", str(profiles), "--", SCRIPT],
                _env(tmp_path),
                timeout=60,
            )
            assert res.returncode == 2 and res.stdout == "", (runtime, command, res.stdout + res.stderr)
            said.append(res.stderr.split(": error: ", 1)[1])  # after "orchestrator COMMAND: error: "
        assert said[0] == said[1] == said[2], said
        assert said[0].count("\n") == 1 and f"the source {tmp_path}/absent does not exist" in said[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_dry_run_sweep_refuses_a_missing_mount_source(tmp_path: Path) -> None:
    from orchestrator.schedulers import get_scheduler

    profile = parse_profile(
        yaml.safe_dump({**BASE, "container": {"runtime": "podman", "image": "i", "mounts": ["/absent-x"]}}),
        "c.yaml",
    )
    plan = build_plan("t", profile, merge_options(profile, strategy="ddp"), SCRIPT, nodes=1)
    with pytest.raises(UserError, match="the source /absent-x does not exist"):
        get_scheduler("slurm").dryrun_array([plan, dataclasses.replace(plan)], tmp_path / "sweep", 1)
