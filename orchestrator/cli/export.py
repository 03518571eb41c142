"""``orchestrator export RUN|JOB --out DIR``: a run's checkpoint as files inference tools read.

The newest complete checkpoint by default (a torn newer one is skipped, with a line saying so);
``--step N`` or ``--checkpoint PATH`` for another (refused when not complete). Runs on a login host:
one CPU process, no GPU; torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse

from orchestrator import api


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a step number >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN|JOB", nargs="?", help="a job id or a run directory (optional with --checkpoint)"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--step", type=_step, help="the checkpoint of this step (default: the newest complete)"
    )
    which.add_argument("--checkpoint", metavar="PATH", help="this checkpoint folder (must be complete)")
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=("safetensors", "hf", "torch"),
        default="safetensors",
        help="safetensors: model.safetensors; hf: a folder from_pretrained loads (a transformers model); "
        "torch: pytorch_model.bin (default: safetensors)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder to write")
    parser.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="floating tensors as (default fp32)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="read the export back and compare it with the checkpoint's model, exactly (exit 1 if not)",
    )
    parser.add_argument(
        "--config",
        metavar="DIR",
        help="a folder with the transformers config.json, when the checkpoint has none",
    )


def run(args: argparse.Namespace) -> int:
    api.export(
        args.run,
        args.out,
        fmt=args.fmt,
        step=args.step,
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        verify=args.verify,
        config=args.config,
    )
    return 0
