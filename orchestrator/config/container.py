"""A profile's ``container:`` block as words of the training step's launch line (pure functions).

The boundary is the node task: every node's whole task of the step (the profile's set-up lines for pyxis and
OCI, then the node entry, its launcher and every rank) runs inside the image, and the batch step
(supervisor, hang watchdog, preflight driver) stays on the host. Why there: pyxis and Slurm's OCI
support are flags of the step's launch command, so they can only ever contain a whole task; one boundary for all four
runtimes keeps the node entry, the ranks and py-spy in one pid and mount namespace (signals relayed,
stacks read, heartbeats written exactly as without a container).

A user's image has Python, torch and accelerate, not orchestrator or submitit. The node entry
reaches them without any install into the image: orchestrator's package and the few pure-Python
(or abi3) packages its node side imports are mounted read-only under :data:`NODE_SITE`, which is put
first on ``PYTHONPATH``; the image's own torch and accelerate stay the ones used
(:mod:`orchestrator.node.container_entry` says which versions it found). The run directory (with
the code snapshot) and the script's folder are mounted at their own paths, so every path in the
plan means the same inside.

Two wrapping styles: pyxis and OCI are flags of the step's launch command (:func:`step_flags`); apptainer and
podman wrap the node command (:func:`wrap_command`). Every value reaching the shell is quoted here;
a path that a runtime's mount syntax cannot carry (``:`` or ``,``) is refused with the path named, and
no value reaches a runtime's argument list where it could be read as an option: each is an absolute
path or passes :func:`runtime_argument` (``--container-image=--privileged`` is refused, never a flag),
and podman's image by name also follows its end of options (``--``).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config.profile.container_keys import (
    check_container,
    check_not_option,
    check_path,
    check_single_line,
    parse_mount,
)
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.profile.records import ClusterProfile, Container

#: Where orchestrator's node-side packages are mounted inside the container (first on PYTHONPATH).
NODE_SITE = "/opt/orchestrator/site"
#: The module every containerised node task runs instead of ``submitit.core._submit`` (it checks the
#: image, then runs that): named, not imported (it belongs to the scheduler's package).
CONTAINER_ENTRY = "orchestrator.schedulers.slurm.container_task"
#: What orchestrator's workarounds (``orchestrator/rank/workarounds.py``) target: accelerate exactly
#: (pyproject's pin), torch by major.minor. The node checks the image's versions against them.
TARGET_VERSIONS = {"accelerate": "1.15.0", "torch": "2.13"}
#: What the node side imports besides the standard library: orchestrator itself, submitit (which
#: unpickles the node task) and their pure-Python or abi3 dependencies, nothing that pins the image's
#: Python version. pydantic is not among them: a plan read back from JSON passes the fast check.
NODE_PACKAGES = (
    "orchestrator",
    "submitit",
    "cloudpickle",
    "typing_extensions",
    "jinja2",
    "markupsafe",
    "yaml",
    "psutil",
)
#: Host variables podman passes into the container (``--env NAME*``); pyxis, apptainer and Slurm's
#: OCI support pass the task's whole environment themselves.
PODMAN_ENV_PATTERNS = ("SLURM_*", "SUBMITIT_*", "ORCHESTRATOR_*", "CUDA_VISIBLE_DEVICES", "NVIDIA_*")
#: Set inside the container for the node task (its value: the runtime): node 0 then leaves Slurm's
#: commands (the requeue), which a user's image does not have, to the batch step on the host.
IN_CONTAINER_ENV = "ORCHESTRATOR_IN_CONTAINER"
#: The per-run OCI bundle Slurm's ``--container`` is given (made by :func:`oci_bundle_files`).
OCI_BUNDLE_DIR = "container_bundle"


@dataclass(frozen=True)
class Mount:
    source: str
    destination: str
    read_only: bool = False


def version_report(found: dict[str, str | None], python: str) -> tuple[list[str], list[str]]:
    """(warnings, errors) for the versions the image's ``python`` has (None: not installed): other
    versions are a warning (what the workarounds correct may differ), a missing one an error."""
    warnings: list[str] = []
    errors: list[str] = []
    for name, target in TARGET_VERSIONS.items():
        version = found.get(name)
        if version is None:
            errors.append(f"{name} is not installed in the image (interpreter {python})")
        elif not (version == target or version.startswith((target + ".", target + "+"))):
            warnings.append(
                f"the image has {name} {version}; orchestrator's workarounds target {name} {target} "
                "(orchestrator/rank/workarounds.py): behaviour they correct may differ"
            )
    return warnings, errors


def with_container_image(profile: ClusterProfile, image: str, source: str) -> ClusterProfile:
    """``--container-image``: the profile with this job's image (its runtime, mounts and env kept)."""
    from orchestrator.config.profile.records import ClusterProfile

    if profile.container.runtime == "none":
        raise UserError(
            f"--container-image {image!r}: profile {source} runs no container (container.runtime: none); "
            "set container.runtime there first"
        )
    try:
        check_single_line(image)
        check_container(profile.container.runtime, image, profile.container.workdir)
    except ValueError as exc:
        raise UserError(f"--container-image {image!r}: expected {exc}") from None
    data = profile.model_dump()
    data["container"]["image"] = image
    return ClusterProfile.model_validate(data)


def image_to_check(container: Container) -> tuple[str, str] | None:
    """What the preflight checks on every node: ``("path", P)`` (a root filesystem, bundle, ``.sif``
    or ``.sqsh`` given by path) or ``("podman", NAME)`` (``podman image exists``); None for a registry
    reference pyxis or apptainer pulls at start."""
    image = container.image
    if container.runtime == "none" or not image:
        return None
    if image.startswith("/"):
        return "path", image
    if container.runtime == "podman":
        return "podman", image
    return None


def enabled(plan: LaunchPlan) -> bool:
    return plan.profile.container.runtime != "none"


def _package_source(name: str) -> str | None:
    spec = find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return str(next(iter(spec.submodule_search_locations)))
    return spec.origin


def node_package_mounts() -> list[Mount]:
    """orchestrator's node side, read-only under :data:`NODE_SITE` (an editable install keeps the job
    templates beside the package: they go where ``render.templates_dir`` then looks)."""
    mounts: list[Mount] = []
    for name in NODE_PACKAGES:
        source = _package_source(name)
        if source is None:
            raise UserError(f"container: the node side needs the {name} package, which is not installed here")
        mounts.append(Mount(source, f"{NODE_SITE}/{Path(source).name}", True))
    templates = _package_source("orchestrator.job_templates")
    package = _package_source("orchestrator")
    if templates and package and not Path(templates).is_relative_to(package):
        mounts.append(Mount(templates, f"{NODE_SITE}/job_templates", True))
    return mounts


def all_mounts(plan: LaunchPlan, run_dir: str) -> list[Mount]:
    """The run directory, the script's folder, orchestrator's node side and the profile's own mounts,
    each checked for what the runtimes' mount syntax can carry (the key named when it cannot)."""
    container = plan.profile.container
    script_dir = str(Path(plan.script).resolve().parent)
    mounts = [Mount(run_dir.rstrip("/") or "/", run_dir.rstrip("/") or "/")]
    if not Path(script_dir).is_relative_to(run_dir):
        mounts.append(Mount(script_dir, script_dir))
    mounts += node_package_mounts()
    for spec in container.mounts:
        source, destination, read_only = parse_mount(spec)
        mounts.append(Mount(source, destination, read_only))
    for m in mounts:
        _checked(m.source, "a container mount source")
        _checked(m.destination, "a container mount destination")
    return mounts


def _checked(path: str, what: str) -> str:
    try:
        return check_path(path, what)
    except ValueError as exc:
        raise UserError(f"container: {exc}") from None


def runtime_argument(value: str, key: str) -> str:
    """``value`` of the profile's ``key`` as a word of a runtime's argument list: refused where the
    runtime could read it as an option (the profile's check says so first; this one holds for a plan
    however it was made)."""
    try:
        return check_not_option(value)
    except ValueError as exc:
        raise UserError(f"{key}: expected {exc}, got {value!r}") from None


def _image(container: Container) -> str:
    assert container.image is not None
    return runtime_argument(container.image, "container.image")


def check_mount_sources(plan: LaunchPlan) -> None:
    """Refuse, before anything is created, a profile mount whose source is missing (the nodes share
    this host's filesystem: a path missing here is missing there)."""
    for spec in plan.profile.container.mounts:
        source = parse_mount(spec)[0]
        if not Path(source).exists():
            raise UserError(f"container.mounts: {spec!r}: the source {source} does not exist")


def check_submittable(plan: LaunchPlan) -> None:
    """What can be known before anything is created: the profile's mount sources exist, and an OCI
    image is a root filesystem or a bundle."""
    if not enabled(plan):
        return
    check_mount_sources(plan)
    if plan.profile.container.runtime == "oci":
        oci_bundle_files(plan, "/")


def _env_words(container: Container) -> list[str]:
    """``NAME=VALUE`` for the ``env`` command inside: the node-side PYTHONPATH, then the block's env."""
    words = [f"PYTHONPATH={NODE_SITE}", f"{IN_CONTAINER_ENV}={container.runtime}"]
    for name, value in sorted(container.env.items()):
        if isinstance(value, bool):
            value = "1" if value else "0"
        words.append(f"{name}={value}")
    return words


def inner_command(plan: LaunchPlan, submitit_folder_word: str) -> str:
    """The node command as the image runs it: ``env PYTHONPATH=... PY -u -m container_entry FOLDER``.
    ``submitit_folder_word`` is already a shell word."""
    container = plan.profile.container
    python = runtime_argument(container.python, "container.python")
    words = ["env", *map(shlex.quote, _env_words(container)), shlex.quote(python)]
    return " ".join([*words, "-u", "-m", CONTAINER_ENTRY, submitit_folder_word])


def workdir(plan: LaunchPlan, run_dir: str) -> str:
    return _checked(plan.profile.container.workdir or run_dir, "container.workdir")


def step_flags(plan: LaunchPlan, run_dir: str) -> list[str]:
    """pyxis and OCI: shell words for the step's launch command (empty for the other runtimes)."""
    container = plan.profile.container
    if container.runtime == "pyxis":
        mounts = ",".join(
            f"{m.source}:{m.destination}" + (":ro" if m.read_only else "") for m in all_mounts(plan, run_dir)
        )
        words = [
            f"--container-image={_image(container)}",
            f"--container-mounts={mounts}",
            f"--container-workdir={workdir(plan, run_dir)}",
            "--no-container-mount-home",
        ]
        names = sorted(plan.profile.env)
        if names:
            words.append(f"--container-env={','.join(names)}")
        return [shlex.quote(w) for w in words]
    if container.runtime == "oci":
        return [shlex.quote(f"--container={oci_bundle_path(run_dir)}")]
    return []


#: podman's flags on every node task: the node's namespaces but the mount one: its hostname (UTS)
#: and pids, so the stacks collector finds the ranks as on the node itself, and its network for the
#: rendezvous.
PODMAN_RUN = ("podman", "run", "--rm", "--network=host", "--ipc=host", "--pid=host", "--uts=host")
#: What ``orchestrator doctor`` runs in the image with its ``python``: what a job's node task needs
#: from the image itself (orchestrator and submitit are mounted, not the image's).
IMAGE_CHECK_CODE = (
    "import torch, accelerate; print('torch', torch.__version__, 'accelerate', accelerate.__version__)"
)


def _podman_image_words(container: Container) -> list[str]:
    image = container.image
    if image is not None and image.startswith("/"):
        # A root filesystem folder: under an overlay (``:O``), so the mount points podman makes
        # land in the overlay, never in the image every job shares. No ``--`` here: podman (4.3)
        # runs it as the command after ``--rootfs``; the path is the flag's value and starts with /.
        return ["--read-only", "--rootfs", f"{_checked(image, 'container.image')}:O"]
    # The end of podman's options: the image is read as an image whatever it holds.
    return ["--", _image(container)]


def wrap_command(plan: LaunchPlan, run_dir: str, command: str) -> str:
    """apptainer and podman: the runtime's command line around ``command`` (shell words)."""
    container = plan.profile.container
    image = container.image
    assert image is not None or container.runtime in ("none", "pyxis", "oci")
    if container.runtime == "apptainer":
        binds = ",".join(
            f"{m.source}:{m.destination}" + (":ro" if m.read_only else "") for m in all_mounts(plan, run_dir)
        )
        words = ["apptainer", "exec"]
        if plan.profile.gpus_per_node:
            words.append("--nv")
        words += ["--bind", binds, "--pwd", workdir(plan, run_dir), _image(container)]
        return " ".join(shlex.quote(w) for w in words) + " " + command
    if container.runtime == "podman":
        words = list(PODMAN_RUN)
        for m in all_mounts(plan, run_dir):
            words += ["-v", f"{m.source}:{m.destination}" + (":ro" if m.read_only else "")]
        for pattern in (*PODMAN_ENV_PATTERNS, *sorted(plan.profile.env)):
            words += ["-e", pattern]
        if plan.profile.gpus_per_node:
            words += ["--device", "nvidia.com/gpu=all"]
        words += ["-w", workdir(plan, run_dir), *_podman_image_words(container)]
        return " ".join(shlex.quote(w) for w in words) + " " + command
    return command


def image_start_argv(profile: ClusterProfile) -> list[str] | None:
    """``orchestrator doctor``: the profile's runtime starting its image as a job's node task does
    (the same runtime, flags, GPUs and image words as :func:`wrap_command`, no mounts), running
    :data:`IMAGE_CHECK_CODE` with the image's ``python`` and the block's ``env``. None where the
    image is started by the step's own flags (pyxis, oci: the step itself starts it, not a command on the
    node) or there is no container."""
    container = profile.container
    if container.runtime not in ("podman", "apptainer") or not container.image:
        return None
    inner = [
        "env",
        *_env_words(container)[2:],
        runtime_argument(container.python, "container.python"),
        "-c",
        IMAGE_CHECK_CODE,
    ]
    if container.runtime == "apptainer":
        return ["apptainer", "exec", *(["--nv"] if profile.gpus_per_node else []), _image(container), *inner]
    words = list(PODMAN_RUN)
    for pattern in (*PODMAN_ENV_PATTERNS, *sorted(profile.env)):
        words += ["-e", pattern]
    if profile.gpus_per_node:
        words += ["--device", "nvidia.com/gpu=all"]
    return [*words, *_podman_image_words(container), *inner]


def oci_bundle_path(run_dir: str) -> str:
    return f"{run_dir.rstrip('/')}/{OCI_BUNDLE_DIR}"


def oci_bundle_files(plan: LaunchPlan, run_dir: str) -> tuple[dict[str, Any], list[tuple[str, str | None]]]:
    """The per-run OCI bundle for Slurm's ``--container``: its ``config.json`` and the entries of its
    ``rootfs/`` (``(path relative to it, symlink target)``; None: an empty folder, a mount point).

    Slurm 22.05 runs ``<bundle>/rootfs`` whatever ``root.path`` says, and runc refuses a symbolic
    link there, so the bundle's rootfs is a folder of mount points: every top-level entry of the
    image is bind-mounted read-only onto it, its top-level links are copied, and the run's own
    mounts follow. runc creates a missing mount point, but never inside a read-only mount: an image
    nobody here built has ``/opt`` (or ``/home``, ``/etc``...) where the node side or a run directory
    must be mounted. So a folder of the image on the way to a missing mount point is not mounted
    whole: the bundle has a folder of its own there and mounts the image's entries one by one into
    it (:func:`_split_folders`), and runc makes the mount point in the bundle, never in the image,
    which may be on read-only storage. The image's ``config.json`` (when it is a bundle) is the base;
    Slurm fills in the command, the environment and the terminal."""
    image = Path(str(plan.profile.container.image))
    rootfs = image / "rootfs" if (image / "config.json").is_file() else image
    if not rootfs.is_dir():
        raise UserError(f"container.image: {image} is no root filesystem folder or OCI bundle")
    base: dict[str, Any] = {}
    if (image / "config.json").is_file():
        base = json.loads((image / "config.json").read_text())
    run_mounts = [_bind(m.source, m.destination, m.read_only) for m in all_mounts(plan, run_dir)]
    # Name resolution as on the node (what podman, pyxis and apptainer give by default): the job's
    # hosts are found by name, and an image's own /etc/hosts knows none of them.
    run_mounts += [_bind(f, f, True) for f in _NAME_FILES if Path(f).exists()]
    split = _split_folders(rootfs, [m["destination"] for m in run_mounts])
    entries: list[tuple[str, str | None]] = []
    image_mounts: list[dict[str, Any]] = []
    _mount_entries(rootfs, "", split, entries, image_mounts)
    config = {
        "ociVersion": base.get("ociVersion", "1.0.2"),
        "process": {**base.get("process", {}), "terminal": False, "cwd": workdir(plan, run_dir)},
        # Read-only as the image's own folders are: nothing a job writes lands in the bundle.
        "root": {"path": "rootfs", "readonly": True},
        "mounts": [*_SYSTEM_MOUNTS, *image_mounts, *run_mounts],
        # Only a mount namespace: the node's network, pids and hostname are the job's own.
        "linux": {"namespaces": [{"type": "mount"}]},
    }
    config["process"].setdefault("user", {"uid": 0, "gid": 0})
    config["process"].setdefault("args", ["/bin/false"])
    return config, entries


def _in_image(rootfs: Path, path: str) -> list[str] | None:
    """``path``'s parts inside the image with its symbolic links followed there (as runc follows
    them, inside the root); None for a loop."""
    todo, hops = path.split("/"), 0
    done: list[str] = []
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            done = done[:-1]
            continue
        here = rootfs.joinpath(*done, part)
        if here.is_symlink():
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(here)
            done = [] if target.startswith("/") else done
            todo = target.split("/") + todo
            continue
        done.append(part)
    return done


def _split_folders(rootfs: Path, destinations: list[str]) -> set[str]:
    """The image's folders (relative paths) to mount entry by entry, not whole: every folder from
    the root down to the deepest existing one on the way to a mount point the image lacks (so the
    missing part is made in the bundle's own folder). The runtime's own folders are left alone."""
    split: set[str] = set()
    for destination in destinations:
        parts = _in_image(rootfs, destination)
        if not parts or parts[0] in _RUNTIME_FOLDERS or rootfs.joinpath(*parts).exists():
            continue
        existing = 0
        while existing < len(parts) and rootfs.joinpath(*parts[: existing + 1]).is_dir():
            existing += 1
        split.update("/".join(parts[:i]) for i in range(1, existing + 1))
    return split


def _mount_entries(
    rootfs: Path,
    folder: str,
    split: set[str],
    entries: list[tuple[str, str | None]],
    mounts: list[dict[str, Any]],
) -> None:
    """The bundle's entries and read-only mounts for the image's ``folder`` (relative; "" the root)."""
    for child in sorted(rootfs.joinpath(folder).iterdir()):
        name = f"{folder}/{child.name}" if folder else child.name
        if child.is_symlink():
            entries.append((name, os.readlink(child)))
        elif child.is_dir():
            entries.append((name, None))
            if name in split:
                _mount_entries(rootfs, name, split, entries, mounts)
            elif name not in _RUNTIME_FOLDERS:
                mounts.append(_bind(str(child), f"/{name}", True))
        elif folder:  # a file in a folder mounted entry by entry (runc makes its mount point)
            mounts.append(_bind(str(child), f"/{name}", True))


def _bind(source: str, destination: str, read_only: bool) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "bind",
        "source": source,
        "options": ["rbind", "ro" if read_only else "rw"],
    }


_NAME_FILES = ("/etc/hosts", "/etc/resolv.conf")
#: The runtime's own top-level folders (:data:`_SYSTEM_MOUNTS`): never the image's.
_RUNTIME_FOLDERS = ("proc", "sys", "dev", "tmp")
_SYSTEM_MOUNTS: list[dict[str, Any]] = [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind", "rw"]},
    {"destination": "/sys", "type": "bind", "source": "/sys", "options": ["rbind", "ro"]},
    {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]},
    {"destination": "/dev/shm", "type": "bind", "source": "/dev/shm", "options": ["rbind", "rw"]},
]
