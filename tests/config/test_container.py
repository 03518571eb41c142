"""The ``container:`` profile block, rendered: what each runtime's srun line must say, read back with
``shlex`` (so quoting is checked too), for every key, with hostile paths and values; what cannot be
expressed is refused with the key named; the node's version check of the image.

pyxis/enroot and Apptainer are not packaged for Debian: these semantic tests are all they get here.
podman and Slurm's OCI support run for real in tests/cluster/test_containers.py.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from orchestrator.config.container import (
    CONTAINER_ENTRY,
    IMAGE_CHECK_CODE,
    IN_CONTAINER_ENV,
    NODE_PACKAGES,
    NODE_SITE,
    OCI_BUNDLE_DIR,
    TARGET_VERSIONS,
    check_submittable,
    image_start_argv,
    image_to_check,
    node_package_mounts,
    oci_bundle_files,
    version_report,
)
from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
from orchestrator.config.profile.load import parse_profile
from orchestrator.config.render import render_sbatch
from orchestrator.contract.errors import RunFailure, UserError
from tests.helpers.cli import REPO, run_cli

RUN_DIR = "/RUN dir/it's $(x)"
SUBMITIT = f"{RUN_DIR}/submitit"
SCRIPT = str(REPO / "train" / "train.py")
#: Hostile but expressible: spaces, quotes, command substitution, globs, a backslash.
HOSTILE = '/data/my set\'s "$(rm -rf ~)" `id` *.bin \\ x'
BASE = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())


def _profile_text(container: dict, **extra: object) -> str:
    return yaml.safe_dump({**BASE, **extra, "container": container})


def _plan(container: dict, **extra: object) -> LaunchPlan:
    profile = parse_profile(_profile_text(container, **extra), "test.yaml")
    options = merge_options(profile, strategy="full_shard")
    return build_plan("test", profile, options, SCRIPT, nodes=2, procs_per_node=1)


def _srun_words(plan: LaunchPlan) -> list[str]:
    """The words after ``srun`` on the batch step's line, as the shell reads them."""
    script = render_sbatch(plan, RUN_DIR, SUBMITIT, "python3")
    line = next(x for x in script.splitlines() if "orchestrator.schedulers.slurm.batch_step" in x)
    words = shlex.split(line)
    return words[words.index("srun") + 1 :]


def _after(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def _expected_mounts(user: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    mounts = [(RUN_DIR, RUN_DIR, False), (str(Path(SCRIPT).parent), str(Path(SCRIPT).parent), False)]
    mounts += [(m.source, m.destination, True) for m in node_package_mounts()]
    return mounts + user


def _spec(m: tuple[str, str, bool]) -> str:
    return f"{m[0]}:{m[1]}" + (":ro" if m[2] else "")


def _check_inner(words: list[str], runtime: str, python: str, env: dict[str, str]) -> None:
    """``env PYTHONPATH=... ORCHESTRATOR_IN_CONTAINER=... NAME=VALUE... PY -u -m ENTRY FOLDER``."""
    start = words.index("env")
    expected = [f"PYTHONPATH={NODE_SITE}", f"{IN_CONTAINER_ENV}={runtime}"]
    expected += [f"{k}={v}" for k, v in sorted(env.items())]
    assert words[start:] == ["env", *expected, python, "-u", "-m", CONTAINER_ENTRY, SUBMITIT]


CONTAINER = {
    "image": "nvcr.io#nvidia/pytorch:25.01-py3",
    "mounts": [f"{HOSTILE}:/data:ro", "/scratch", "/lustre/ds:/ds:rw"],
    "env": {"HF_HOME": "/data/hf $(x)", "FLAG": True},
    "python": "/usr/bin/python3",
}
USER_MOUNTS = [(HOSTILE, "/data", True), ("/scratch", "/scratch", False), ("/lustre/ds", "/ds", False)]
INNER_ENV = {"HF_HOME": "/data/hf $(x)", "FLAG": "1"}


def test_pyxis_flags_carry_every_key() -> None:
    plan = _plan({"runtime": "pyxis", **CONTAINER, "workdir": "/work dir"})
    words = _srun_words(plan)
    assert f"--container-image={CONTAINER['image']}" in words
    mounts = next(w for w in words if w.startswith("--container-mounts=")).split("=", 1)[1]
    assert mounts.split(",") == [_spec(m) for m in _expected_mounts(USER_MOUNTS)]
    assert "--container-workdir=/work dir" in words
    assert "--no-container-mount-home" in words
    assert f"--container-env={','.join(sorted(BASE['env']))}" in words
    # the flags belong to srun: they come before the command it runs
    assert words.index("--no-container-mount-home") < words.index("env")
    _check_inner(words, "pyxis", "/usr/bin/python3", INNER_ENV)


def test_pyxis_workdir_defaults_to_the_run_directory() -> None:
    words = _srun_words(_plan({"runtime": "pyxis", "image": "img.sqsh"}))
    assert f"--container-workdir={RUN_DIR}" in words
    _check_inner(words, "pyxis", "python3", {})


def test_apptainer_wraps_the_node_command() -> None:
    plan = _plan({"runtime": "apptainer", **CONTAINER, "image": "/images/torch it's.sif"}, gpus_per_node=4)
    words = _srun_words(plan)
    start = words.index("apptainer")
    assert words[start : start + 3] == ["apptainer", "exec", "--nv"]
    assert _after(words, "--bind").split(",") == [_spec(m) for m in _expected_mounts(USER_MOUNTS)]
    assert _after(words, "--pwd") == RUN_DIR
    assert words[words.index("env") - 1] == "/images/torch it's.sif"
    _check_inner(words, "apptainer", "/usr/bin/python3", INNER_ENV)


def test_apptainer_on_cpu_asks_for_no_gpus() -> None:
    words = _srun_words(_plan({"runtime": "apptainer", "image": "docker://pytorch/pytorch"}))
    assert "--nv" not in words


def test_podman_wraps_the_node_command_in_the_hosts_namespaces() -> None:
    plan = _plan({"runtime": "podman", **CONTAINER, "image": "/images/rootfs dir", "workdir": "/w"})
    words = _srun_words(plan)
    start = words.index("podman")
    assert words[start : start + 7] == [
        "podman",
        "run",
        "--rm",
        "--network=host",
        "--ipc=host",
        "--pid=host",
        "--uts=host",
    ]
    volumes = [words[i + 1] for i, w in enumerate(words) if w == "-v"]
    assert volumes == [_spec(m) for m in _expected_mounts(USER_MOUNTS)]
    passed = [words[i + 1] for i, w in enumerate(words) if w == "-e"]
    assert {"SLURM_*", "ORCHESTRATOR_*", "SUBMITIT_*", *BASE["env"]} <= set(passed)
    assert _after(words, "-w") == "/w"
    assert words[words.index("env") - 3 : words.index("env")] == [
        "--read-only",
        "--rootfs",
        "/images/rootfs dir:O",
    ]
    _check_inner(words, "podman", "/usr/bin/python3", INNER_ENV)


def test_podman_image_by_name_and_gpus() -> None:
    words = _srun_words(_plan({"runtime": "podman", "image": "docker.io/pytorch/pytorch:2"}, gpus_per_node=2))
    assert words[words.index("env") - 1] == "docker.io/pytorch/pytorch:2"
    assert _after(words, "--device") == "nvidia.com/gpu=all"
    assert "--rootfs" not in words


def test_oci_is_one_srun_flag_and_a_bundle_with_every_mount(tmp_path: Path) -> None:
    image = tmp_path / "image"
    for d in ("usr", "etc", "proc"):
        (image / d).mkdir(parents=True)
    (image / "bin").symlink_to("usr/bin")
    (image / "etc" / "hosts").touch()
    plan = _plan({"runtime": "oci", **CONTAINER, "image": str(image)})
    words = _srun_words(plan)
    assert f"--container={RUN_DIR}/{OCI_BUNDLE_DIR}" in words
    _check_inner(words, "oci", "/usr/bin/python3", INNER_ENV)
    config, entries = oci_bundle_files(plan, RUN_DIR)
    # /etc lacks resolv.conf, the node's mount point: the bundle has an /etc of its own, into which
    # the image's /etc is mounted entry by entry (runc makes the missing one there, not in the image)
    assert entries == [("bin", "usr/bin"), ("etc", None), ("proc", None), ("usr", None)]
    binds = [
        (m["source"], m["destination"], "ro" in m["options"]) for m in config["mounts"] if m["type"] == "bind"
    ]
    assert (str(image / "usr"), "/usr", True) in binds and (str(image / "etc"), "/etc", True) not in binds
    # the node's name resolution, over the image's own file (after it)
    own_hosts = binds.index((str(image / "etc" / "hosts"), "/etc/hosts", True))
    assert binds.index(("/etc/hosts", "/etc/hosts", True)) > own_hosts
    assert ("/etc/resolv.conf", "/etc/resolv.conf", True) in binds
    assert config["root"]["readonly"] is True
    for mount in _expected_mounts(USER_MOUNTS):
        assert mount in binds, mount
    assert config["root"]["path"] == "rootfs" and config["linux"]["namespaces"] == [{"type": "mount"}]
    json.dumps(config)  # plain JSON


def test_no_container_renders_as_before() -> None:
    words = _srun_words(_plan({"runtime": "none"}))
    assert "env" not in words and words[-4:-1] == ["-u", "-m", "submitit.core._submit"]


@pytest.mark.parametrize(
    "container, key, expected",
    [
        ({"runtime": "pyxsi", "image": "x"}, "container.runtime", "did you mean 'pyxis'?"),
        ({"runtime": "podmn", "image": "x"}, "container.runtime", "did you mean 'podman'?"),
        ({"runtime": "apptainer"}, "container", "container.image: required"),
        ({"runtime": "pyxis", "image": "x", "mounts": ["/a,b:/c"]}, "container.mounts", "without ','"),
        ({"runtime": "pyxis", "image": "x", "mounts": ["/a:/b:/c"]}, "container.mounts", "'SRC:DST:ro'"),
        ({"runtime": "pyxis", "image": "x", "mounts": ["data:/d"]}, "container.mounts", "absolute"),
        ({"runtime": "pyxis", "image": "x", "workdir": "w"}, "container", "absolute"),
        ({"runtime": "oci", "image": "rel/bundle"}, "container", "absolute path"),
        ({"runtime": "pyxis", "image": "x", "env": {"A-B": "1"}}, "container.env", "A-B"),
    ],
)
def test_bad_blocks_are_refused_with_the_file_and_key(container: dict, key: str, expected: str) -> None:
    with pytest.raises(UserError) as err:
        parse_profile(_profile_text(container), "/p/test.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("/p/test.yaml: ") and key in message, message
    assert expected in message, message


def test_a_run_directory_the_mount_syntax_cannot_carry_is_refused() -> None:
    plan = _plan({"runtime": "pyxis", "image": "x"})
    with pytest.raises(UserError, match=r"without ':' .*'/RUN:1'"):
        render_sbatch(plan, "/RUN:1", "/RUN:1/submitit", "python3")


def test_missing_mount_source_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    plan = _plan({"runtime": "podman", "image": "x", "mounts": [f"{tmp_path}/absent:/d"]})
    with pytest.raises(UserError, match=f"container.mounts: .*{tmp_path}/absent does not exist"):
        check_submittable(plan)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "c.yaml").write_text(
        _profile_text({"runtime": "podman", "image": "x", "mounts": [f"{tmp_path}/absent:/d"]})
    )
    runs = tmp_path / "runs"
    env = {
        "ORCHESTRATOR_HOME": str(tmp_path / "home"),
        "ORCHESTRATOR_RUNS": str(runs),
        "PATH": "/usr/bin:/bin",
    }
    res = run_cli(
        ["submit", "--profile", "c", "--profiles-dir", str(profiles), "--", SCRIPT], env, timeout=60
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and "does not exist" in res.stderr and "Traceback" not in res.stderr
    assert not runs.exists() or not any(runs.iterdir())


def test_node_packages_are_what_the_node_side_imports() -> None:
    mounts = {Path(m.destination).name: m for m in node_package_mounts()}
    for name in NODE_PACKAGES:
        assert any(k == name or k.startswith(name + ".") for k in mounts), name
    assert "torch" not in mounts and "accelerate" not in mounts and "pydantic" not in mounts
    assert all(m.read_only and m.destination.startswith(NODE_SITE + "/") for m in mounts.values())


def test_the_image_versions_are_checked_against_the_workarounds_targets() -> None:
    pins = (REPO / "pyproject.toml").read_text()
    assert f'"accelerate=={TARGET_VERSIONS["accelerate"]}"' in pins
    assert version_report({"accelerate": "1.15.0", "torch": "2.13.0+cpu"}, "py") == ([], [])
    assert version_report({"accelerate": "1.15.0", "torch": "2.13.1"}, "py") == ([], [])
    warnings, errors = version_report({"accelerate": "1.16.0", "torch": "2.9.0"}, "py")
    assert not errors and len(warnings) == 2
    assert "accelerate 1.16.0" in warnings[0] and "target accelerate 1.15.0" in warnings[0]
    assert "torch 2.9.0" in warnings[1]
    warnings, errors = version_report({"accelerate": None, "torch": "2.13.0"}, "py")
    assert errors == [errors[0]] and "accelerate is not installed in the image" in errors[0]


def test_container_image_flag_overrides_the_profiles_image(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "c.yaml").write_text(_profile_text({"runtime": "podman", "image": "/img/a"}))
    env = {"ORCHESTRATOR_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    flags = ["--profiles-dir", str(profiles), "--container-image"]
    res = run_cli(["render", "--profile", "c", *flags, "/img b", "--", SCRIPT], env, timeout=60)
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if "podman run" in x)
    assert shlex.split(line)[shlex.split(line).index("--rootfs") + 1] == "/img b:O"
    res = run_cli(["render", "--profile", "slurm_test", *flags, "/img", "--", SCRIPT], env, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "--container-image" in res.stderr and "container.runtime: none" in res.stderr


def test_a_task_in_slurms_oci_container_takes_its_hosts_place_in_the_node_list() -> None:
    """Slurm 22.05 hands every OCI container the batch script's SLURM_PROCID=0 and SLURMD_NODENAME."""
    import socket

    from orchestrator.schedulers.slurm.environment import fill_task_variables

    host = socket.gethostname()
    env = {
        "SLURM_STEP_NODELIST": f"zz0,{host}",
        "SLURM_PROCID": "0",
        "SLURM_NODEID": "0",
        "SLURMD_NODENAME": "zz0",
    }
    fill_task_variables(env)
    assert (env["SLURM_PROCID"], env["SLURM_NODEID"], env["SLURM_LOCALID"], env["SLURMD_NODENAME"]) == (
        "1",
        "1",
        "0",
        host,
    )
    with pytest.raises(RunFailure, match="not in the step's node list"):
        fill_task_variables({"SLURM_STEP_NODELIST": "zz[0-1]"})


def test_the_preflight_names_the_node_without_the_image(tmp_path: Path) -> None:
    """Each node checks the image it will run (node/preflight.image_problems); the verdict names the
    node where it is missing. A registry reference is pulled at start, not checked."""
    from orchestrator.config.profile.records import Container
    from orchestrator.config.profile.records import Preflight as Limits
    from orchestrator.node.preflight import image_problems
    from orchestrator.supervise.preflight import judge

    image = tmp_path / "rootfs"
    image.mkdir()
    assert image_to_check(Container(runtime="podman", image=str(image))) == ("path", str(image))
    assert image_to_check(Container(runtime="podman", image="pytorch:2")) == ("podman", "pytorch:2")
    assert image_to_check(Container(runtime="pyxis", image="nvcr.io#nvidia/pytorch:25.01-py3")) is None
    assert image_to_check(Container(runtime="apptainer", image="/i/t.sif")) == ("path", "/i/t.sif")
    assert image_problems(("path", str(image))) == []
    missing = image_problems(("path", str(tmp_path / "gone")))
    assert missing == [f"container image {tmp_path / 'gone'} not found on this node"]
    link = {"rtt_ms": 0.1, "in_mbps": 9000.0}
    reports = {0: {"problems": [], "peers": {"1": link}}, 1: {"problems": missing, "peers": {"0": link}}}
    verdict = judge(["n1", "n2"], reports, Limits(), timed_out=False)
    assert verdict.failed and verdict.bad_nodes == ["n2"]
    assert (
        verdict.reason
        == f"preflight failed: node n2: container image {tmp_path / 'gone'} not found on this node"
    )


def test_the_oci_bundle_is_written_into_the_run_directory(tmp_path: Path) -> None:
    from orchestrator.schedulers.slurm.scheduler import write_oci_bundle

    image = tmp_path / "image"
    (image / "usr").mkdir(parents=True)
    (image / "bin").symlink_to("usr/bin")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_oci_bundle(_plan({"runtime": "oci", "image": str(image)}), run_dir)
    bundle = run_dir / OCI_BUNDLE_DIR
    assert (bundle / "rootfs" / "usr").is_dir() and not any((bundle / "rootfs" / "usr").iterdir())
    assert (bundle / "rootfs" / "bin").readlink() == Path("usr/bin")
    config = json.loads((bundle / "config.json").read_text())
    assert {
        "destination": "/usr",
        "type": "bind",
        "source": str(image / "usr"),
        "options": ["rbind", "ro"],
    } in config["mounts"]
    assert config["process"]["cwd"] == str(run_dir)


def _shell_rootfs(root: Path) -> None:
    """A root filesystem with a shell, ``test`` and ``cat`` (this machine's, with their libraries)."""
    import os
    import re
    import shutil
    import subprocess

    for tool in ("/bin/sh", "/usr/bin/cat"):
        found = subprocess.run(["ldd", tool], capture_output=True, text=True, timeout=30).stdout
        for path in [tool, *re.findall(r"(/\S+) \(0x", found)]:
            target = root / "usr" / path.lstrip("/").removeprefix("usr/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), target)
    for name in ("bin", "lib", "lib64"):
        (root / name).symlink_to(f"usr/{name}")


def test_runc_runs_the_bundle_of_a_read_only_image_whose_folders_hold_the_mount_points(
    tmp_path: Path,
) -> None:
    """An image nobody here built has /opt (its venv), /etc without the node's name files, a folder
    on the way to the script's: runc could not make the node side's mount point in the read-only /opt
    ("mkdir .../opt/orchestrator: read-only file system", issue 41). Run for real with runc, the image
    read-only (a read-only bind mount of it): every mount point is made, the image's files are seen,
    nothing is written into the image."""
    import subprocess

    from orchestrator.schedulers.slurm.scheduler import write_oci_bundle
    from tests.helpers.preconditions import require_debian_packages

    require_debian_packages("runc")
    built = tmp_path / "built"
    _shell_rootfs(built)
    (built / "opt" / "venv").mkdir(parents=True)
    (built / "opt" / "venv" / "marker").write_text("the image's own venv\n")
    (built / "etc").mkdir()
    (built / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    first = Path(SCRIPT).parts[1]  # the script's folder's first part: a folder of the image too
    (built / first).mkdir(exist_ok=True)
    for d in ("proc", "sys", "dev", "tmp"):
        (built / d).mkdir()
    before = sorted(str(p.relative_to(built)) for p in built.rglob("*"))
    image = tmp_path / "image"
    image.mkdir()
    subprocess.run(["mount", "--bind", str(built), str(image)], check=True, timeout=30)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(image)], check=True, timeout=30)
        assert subprocess.run(["mkdir", str(image / "x")], capture_output=True, timeout=30).returncode != 0
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        write_oci_bundle(_plan({"runtime": "oci", "image": str(image)}), run_dir)
        bundle = run_dir / OCI_BUNDLE_DIR
        config = json.loads((bundle / "config.json").read_text())
        checks = [
            "cat /opt/venv/marker",
            f"test -f {NODE_SITE}/orchestrator/__init__.py",
            f"test -f {shlex.quote(SCRIPT)}",
            "cat /etc/passwd /etc/hosts",
            f"test -d {shlex.quote(str(run_dir))}",
        ]
        config["process"]["args"] = ["/bin/sh", "-c", " && ".join(checks)]
        config["process"]["env"] = ["PATH=/usr/bin:/bin"]
        (bundle / "config.json").write_text(json.dumps(config))
        state = tmp_path / "runc-state"
        ran = subprocess.run(
            ["runc", "--root", str(state), "run", "--bundle", str(bundle), f"orch-test-{tmp_path.name}"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        subprocess.run(["umount", "-l", str(image)], timeout=30, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.startswith("the image's own venv\nroot:x:0:0:"), ran.stdout
    assert Path("/etc/hosts").read_text() in ran.stdout
    assert sorted(str(p.relative_to(built)) for p in built.rglob("*")) == before


def test_the_doctor_starts_the_image_as_the_job_s_runtime_does() -> None:
    """``image_start_argv``: the job's podman words (namespaces, variables, GPUs, the image after the
    end of options or as an overlaid root filesystem), no mounts, the image's python importing what a
    job needs; apptainer likewise; pyxis and OCI (started by srun's flags) and no container: None."""
    plan = _plan({"runtime": "podman", **CONTAINER, "image": "/images/rootfs dir"})
    job = _srun_words(plan)
    argv = image_start_argv(plan.profile)
    assert argv is not None and argv[:7] == job[job.index("podman") : job.index("podman") + 7]
    assert argv[argv.index("env") - 3 : argv.index("env")] == [
        "--read-only",
        "--rootfs",
        "/images/rootfs dir:O",
    ]
    assert "-v" not in argv and {"SLURM_*", *BASE["env"]} <= {
        argv[i + 1] for i, w in enumerate(argv) if w == "-e"
    }
    assert argv[argv.index("env") :] == [
        "env", *(f"{k}={v}" for k, v in sorted(INNER_ENV.items())), "/usr/bin/python3", "-c", IMAGE_CHECK_CODE
    ]  # fmt: skip
    named = image_start_argv(
        _plan({"runtime": "podman", "image": "docker.io/pytorch/pytorch:2"}, gpus_per_node=2).profile
    )
    assert named is not None and named[named.index("env") - 2 : named.index("env")] == [
        "--",
        "docker.io/pytorch/pytorch:2",
    ]
    assert named[named.index("--device") + 1] == "nvidia.com/gpu=all"
    sif = image_start_argv(_plan({"runtime": "apptainer", "image": "/img/t.sif"}, gpus_per_node=2).profile)
    assert sif == ["apptainer", "exec", "--nv", "/img/t.sif", "env", "python3", "-c", IMAGE_CHECK_CODE]
    for runtime in ("pyxis", "oci"):
        assert image_start_argv(_plan({"runtime": runtime, "image": "/img/rootfs"}).profile) is None
    assert image_start_argv(parse_profile(yaml.safe_dump(BASE), "test.yaml")) is None
