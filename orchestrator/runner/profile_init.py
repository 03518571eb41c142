"""``orchestrator profiles init NAME``: ask the cluster, draft the profile
(:mod:`orchestrator.schedulers.slurm.profile_draft`), check it as ``profiles validate`` does and write
it, never over an existing file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

from orchestrator.contract.errors import UserError
from orchestrator.schedulers.slurm.discover import ask_cluster
from orchestrator.schedulers.slurm.profile_draft import Answers, draft, gpu_note


def target_folder(profiles_dir: str | None) -> Path:
    """Where a new profile goes: ``--profiles-dir``, else ``$ORCHESTRATOR_PROFILES``, else ./cluster_profiles."""
    if profiles_dir:
        return Path(profiles_dir)
    env = os.environ.get("ORCHESTRATOR_PROFILES")
    return Path(env) if env else Path.cwd() / "cluster_profiles"


def write(name: str, text: str, folder: Path, force: bool = False) -> Path:
    """Check ``text`` as ``profiles validate`` does, then write ``folder/NAME.yaml`` (never over an
    existing file without ``force``)."""
    from orchestrator.config.profile.load import parse_profile
    from orchestrator.runner.planning import check_profile_defaults

    if not name or "/" in name or name.startswith("."):
        raise UserError(f"profiles init: {name!r} is not a profile name (a file name without a folder)")
    path = folder / f"{name}.yaml"
    if path.exists() and not force:
        raise UserError(f"{path}: exists; choose another name or pass --force to replace it")
    profile = parse_profile(text, str(path))
    check_profile_defaults(name, path, profile)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def init_profile(
    name: str,
    given: dict[str, str | None],
    setup: list[str],
    profiles_dir: str | None = None,
    probe_node: bool = True,
    print_only: bool = False,
    force: bool = False,
    out: TextIO | None = None,
) -> tuple[str, Path | None]:
    """The drafted profile's text, and where it was written (None with ``print_only``). ``given``:
    the user's ``partition``, ``account``, ``qos``, ``python`` and ``gpu_type`` (None: ask the
    cluster). ``out`` gets one line when the partition's GPUs left a choice (several types)."""
    answers = Answers(
        given.get("partition"),
        given.get("account"),
        given.get("qos"),
        setup,
        given.get("python"),
        given.get("gpu_type"),
    )
    facts = ask_cluster(partition=answers.partition, probe_node=probe_node)
    text = draft(name, facts, answers)  # a --gpu-type the partition lacks: refused, nothing written
    note = gpu_note(facts, answers)
    if note and out is not None:
        print(f"profiles init: {note}", file=out, flush=True)
    if print_only:
        return text, None
    return text, write(name, text, target_folder(profiles_dir), force=force)
