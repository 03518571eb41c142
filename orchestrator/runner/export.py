"""``export``: a run's checkpoint as files that inference and evaluation tools read.

Which checkpoint: :mod:`orchestrator.rundir.export.find` (the run's one checkpoint vocabulary: newest
complete by default, a torn one never). How its weights are read, whatever strategy wrote them:
:mod:`orchestrator.rundir.export.read`. How they are written: :mod:`orchestrator.rundir.export.write`
(safetensors streamed one tensor at a time). ``--verify``: :mod:`orchestrator.rundir.export.verify`.

It runs on a login host: one CPU process, no process group, no GPU; torch is imported only here,
inside :func:`export`. Nothing is written into the run or its checkpoints; the export appears at
``--out`` only when complete (written into a temporary sibling folder, then renamed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract.errors import UserError
from orchestrator.rundir.export.find import choose_checkpoint

FORMATS = ("safetensors", "hf", "torch")
DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Exported:
    """What an export wrote, and from where."""

    out: Path
    weights: Path
    checkpoint: Path
    step: int
    kind: str
    tensors: int
    seconds: float
    lines: list[str] = field(default_factory=list)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder; name a new one")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: its parent folder {out.parent} does not exist")


def _protected(run_dir: Path | None, checkpoint: Path | None) -> list[tuple[Path, str]]:
    """``[(folder, what it is)]`` an export never writes into, the most specific first: the run's
    checkpoint folders (a Trainer's ``checkpoint-N`` outside the run too) and the run directory, or the
    ``--checkpoint`` folder and the run that wrote it. Folder listings and the marker only: no weights
    are read."""
    from orchestrator.contract.jsonfiles import read_json
    from orchestrator.contract.run_dir import COMPLETE_MARKER, all_checkpoint_folders

    found: list[tuple[Path, str]] = []
    if run_dir is not None:
        found += [
            (path, f"the checkpoint {path} of run {run_dir}")
            for _, path, _ in all_checkpoint_folders(run_dir)
        ]
        found.append((run_dir, f"the run directory {run_dir}"))
    if checkpoint is not None and (checkpoint / COMPLETE_MARKER).is_file():
        # (A folder with no marker is refused as --checkpoint before anything is written.)
        found.append((checkpoint, f"the checkpoint {checkpoint}"))
        writer = (read_json(checkpoint / COMPLETE_MARKER) or {}).get("run")
        if isinstance(writer, str) and writer:
            found.append((Path(writer), f"the run directory {writer} that wrote {checkpoint}"))
        if checkpoint.parent.name == "checkpoints":  # a run's own checkpoints/step_N
            found.append((checkpoint.parent.parent, f"the run directory {checkpoint.parent.parent}"))
    return found


def _refuse_out_in_run(out: Path, run_dir: Path | None, checkpoint: Path | None) -> None:
    """Nothing is written into the run: ``--out`` (and so its temporary sibling) is not the run directory
    or a checkpoint, nor inside one, nor holding one, with every symbolic link on either side resolved;
    nor a ``checkpoint-N`` beside the Trainer's own, which a resume would take for another run's."""
    from orchestrator.contract.hook_checkpoints import HOOK_CHECKPOINT_RE, hook_checkpoint_dirs

    where = out.resolve()
    protected = [(folder.resolve(), what) for folder, what in _protected(run_dir, checkpoint)]
    clash = [
        ("is" if where == real else "inside", what) for real, what in protected if where.is_relative_to(real)
    ]
    clash += [("holds", what) for real, what in protected if real.is_relative_to(where)]
    if clash:
        how, what = clash[0]
        raise UserError(
            f"--out {out}: {how} {what}; an export never writes into the run, name a folder outside it"
        )
    if run_dir is not None and HOOK_CHECKPOINT_RE.match(where.name):
        for folder in hook_checkpoint_dirs(run_dir):
            if where.parent == folder.resolve():
                raise UserError(
                    f"--out {out}: a checkpoint folder name in {folder}, where run {run_dir} saves its "
                    "checkpoints; name a folder outside it"
                )


def _valid_config(config_json: Path, flag: str) -> None:
    """A ``config.json`` an export ships or loads is a transformers config: JSON naming a
    ``model_type`` that transformers (when installed here) builds into its config class."""
    try:
        data = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{flag}: {config_json} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise UserError(f'{flag}: {config_json} is not a transformers config (no "model_type")')
    try:
        import transformers
    except ImportError:
        return
    from orchestrator.rundir.export.verify import quiet_transformers

    try:
        with warnings.catch_warnings(), quiet_transformers():
            warnings.simplefilter("ignore")
            transformers.AutoConfig.from_pretrained(str(config_json.parent))
    except Exception as exc:  # ValueError, KeyError, TypeError, OSError: whatever the config trips
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise UserError(f"{flag}: {config_json} is not a config transformers can load ({why})") from None


def _config_folder(fmt: str, checkpoint: Path, config: Path | None, verify: bool) -> Path | None:
    """The folder of the transformers ``config.json`` the export ships (``hf``) or loads (``--verify``),
    checked before any weight is read."""
    from orchestrator.rundir.export.write import hf_config_folder

    if config is not None:
        folder = config.parent if config.name == "config.json" else config
        if not (folder / "config.json").is_file():
            raise UserError(f"--config {config}: no config.json there")
        _valid_config(folder / "config.json", f"--config {config}")
        return folder
    found = hf_config_folder(checkpoint)
    if fmt == "hf" and found is None:
        raise UserError(
            f"--format hf: no transformers config.json in {checkpoint} or {checkpoint.parent} "
            "(a Trainer run without the orchestrator's hook saves none under FSDP); pass --config DIR (a "
            "folder holding the model's config.json, e.g. the Trainer's save_model folder), or use --format "
            "safetensors"
        )
    if found is not None and (fmt == "hf" or verify):
        _valid_config(found / "config.json", f"config of {checkpoint}")
    return found


def export_run(run: str | None, out: Path, *, home: Path | None = None, **options: Any) -> Exported:
    """:func:`export` of ``run``: a run directory, or a job id looked up in the registry under ``home``."""
    run_dir: Path | None = None
    if run is not None:
        if Path(run).is_dir():
            run_dir = Path(run)
        else:
            from orchestrator.registry.store import Registry

            with Registry.open(home) as registry:
                run_dir = Path(registry.get(run).run_dir)
            if not run_dir.is_dir():
                raise UserError(f"run directory {run_dir} of job {run} does not exist")
    return export(run_dir, out, **options)


def export(
    run_dir: Path | None,
    out: Path,
    *,
    fmt: str = "safetensors",
    step: int | None = None,
    checkpoint: str | Path | None = None,
    dtype: str = "fp32",
    verify: bool = False,
    config: str | Path | None = None,
    say: Callable[[str], None] = print,
) -> Exported:
    """Export the chosen checkpoint's model to ``out``; :class:`UserError` before anything is written
    when the input is wrong, ``VerifyFailed`` (exit 1) when ``verify`` finds a difference."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if step is not None and checkpoint is not None:
        raise UserError("--step and --checkpoint: give one of them")
    out = Path(out).absolute()
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    config = Path(config) if config is not None else None
    if out.is_symlink():
        # Written beside --out and renamed onto it: a link would fail only at the end, after the read.
        raise UserError(
            f"--out {out}: is a symbolic link (to {os.readlink(out)}); name a real folder, "
            f"e.g. --out {out.resolve()}"
        )
    _refuse_out_in_run(out, run_dir, checkpoint)
    _check_out(out)
    started = time.monotonic()
    chosen = choose_checkpoint(run_dir, step, checkpoint, say)
    config_folder = _config_folder(fmt, chosen.path, config, verify)
    from orchestrator.rundir.export.read import open_source
    from orchestrator.rundir.export.verify import verify as verify_export
    from orchestrator.rundir.export.write import write

    lines: list[str] = list(chosen.skipped)

    def note(line: str) -> None:
        lines.append(line)
        say(line)

    with warnings.catch_warnings(), contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115
        # DCP warns that no process group exists (none is meant to); DeepSpeed prints progress bars.
        warnings.simplefilter("ignore")
        source = open_source(chosen.path)
    note(f"exporting step {chosen.step} from {chosen.path} ({source.kind}, {len(source.entries)} tensors)")
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        metadata = {
            "format": "pt",
            "orchestrator_step": str(chosen.step),
            "orchestrator_checkpoint": str(chosen.path),
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            weights = write(fmt, tmp, source, dtype, metadata, config_folder if fmt == "hf" else None, note)
            if verify:
                config_json = config_folder / "config.json" if config_folder is not None else None
                verify_export(fmt, tmp, weights, source, dtype, chosen.marker, config_json, note)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    weights = out / weights.name
    note(f"wrote {weights} ({dtype})")
    return Exported(out, weights, chosen.path, chosen.step, source.kind, len(source.entries),
                    time.monotonic() - started, lines)  # fmt: skip
