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


def _config_folder(fmt: str, checkpoint: Path, config: Path | None) -> Path | None:
    from orchestrator.rundir.export.write import hf_config_folder

    if config is not None:
        folder = config.parent if config.name == "config.json" else config
        if not (folder / "config.json").is_file():
            raise UserError(f"--config {config}: no config.json there")
        return folder
    found = hf_config_folder(checkpoint)
    if fmt == "hf" and found is None:
        raise UserError(
            f"--format hf: no transformers config.json in {checkpoint} or {checkpoint.parent} "
            "(an FSDP Trainer checkpoint has none); pass --config DIR (a folder holding the model's "
            "config.json, e.g. the Trainer's save_model folder), or use --format safetensors"
        )
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
    _check_out(out)
    started = time.monotonic()
    chosen = choose_checkpoint(run_dir, step, checkpoint, say)
    config_folder = _config_folder(fmt, chosen.path, config)
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
