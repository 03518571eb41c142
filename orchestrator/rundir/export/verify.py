"""``export --verify``: the written files are the model at the checkpoint, exactly, on CPU.

Three checks, each one that a wrong export fails:

1. **Every tensor, read back** by the format's own library (safetensors' ``safe_open``,
   ``torch.load``), equals the checkpoint's tensor as its writer's library reads it, bit for bit
   (after ``--dtype``): same names, shapes, dtypes, bytes. One tensor at a time.
2. **The fingerprint training recorded.** ``train/`` writes ``param_checksum`` into each marker from
   the live model at save time (:func:`weights_checksum`, over the full gathered parameters); a
   float32 export's checksum must equal it exactly. This ties the export to the model that trained,
   not only to the files.
3. **A forward pass**, when the model is a transformers model (a ``config.json``): the export loaded
   as a user loads it (``from_pretrained`` for ``hf``), and the same class loaded with the
   checkpoint's tensors, run one fixed batch; the logits must be equal.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.contract.errors import OrchestratorError

if TYPE_CHECKING:
    import torch

    from orchestrator.rundir.export.read import Source


class VerifyFailed(OrchestratorError):
    """The export is not the checkpoint's model: exit 1 (the run's output, not the user's input)."""

    exit_code = 1


_WEIGHTS: list[Any] = []


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own warnings and load reports (its logging, which ``redirect_stderr`` does not
    reach) held back: a config's special tokens outside a tiny vocabulary, a table per load. The export's
    lines say what was checked; a failure is one line of its own."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(before)


def _position_weights(n: int) -> torch.Tensor:
    """1, 8/7, 9/7, ... 13/7, 1, ...: position weights (cached, sliced)."""
    import torch

    if not _WEIGHTS or _WEIGHTS[0].numel() < n:
        _WEIGHTS[:] = [1.0 + (torch.arange(max(n, 1 << 16), dtype=torch.float64) % 7) / 7.0]
    return _WEIGHTS[0][:n]


def weights_checksum(names: Iterable[str], read: Callable[[str], Any]) -> float:
    """The checksum ``train/`` records as ``param_checksum``: a position-weighted float64 sum over
    the tensors in sorted-name order (deterministic, and sensitive to swapped elements). One tensor is
    read at a time; ``train.checksum.tensor_checksum`` is this function over a dict."""
    import torch

    total = torch.zeros((), dtype=torch.float64)
    for name in sorted(names):
        value = read(name)
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value))
        if hasattr(value, "full_tensor"):  # a DTensor that escaped gathering
            value = value.full_tensor()
        flat = value.detach().to("cpu", torch.float64).reshape(-1)
        total += torch.dot(flat, _position_weights(flat.numel()))
    return float(total)


def _reader(fmt: str, weights: Path) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """The written file's tensor names, and a reader of one tensor, by the format's own library.

    safetensors maps the file: every tensor read through one open handle leaves its pages mapped, and
    a verify's resident memory grew to the whole file (measured: 1.2 GB for a 1.1 GB export). A handle
    per tensor unmaps each one's pages as soon as it is copied out."""
    if fmt == "torch":
        import torch

        state = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
        return list(state), state.__getitem__
    from safetensors import safe_open

    def read(name: str) -> torch.Tensor:
        with safe_open(str(weights), framework="pt") as handle:
            return handle.get_tensor(name)

    with safe_open(str(weights), framework="pt") as handle:
        names = list(handle.keys())  # noqa: SIM118 (not a mapping)
    return names, read


def verify(fmt: str, out: Path, weights: Path, source: Source, wanted: str, marker: dict[str, Any],
           config: Path | None, say: Callable[[str], None]) -> None:  # fmt: skip
    """Raise :class:`VerifyFailed` naming the first difference; say what each check compared."""
    from orchestrator.rundir.export.write import converted

    names, read = _reader(fmt, weights)
    if sorted(names) != sorted(source.entries):
        missing = sorted(set(source.entries) - set(names))[:3]
        extra = sorted(set(names) - set(source.entries))[:3]
        raise VerifyFailed(
            f"verify: {weights} tensor names differ from the checkpoint's (missing {missing}, extra {extra})"
        )
    for name in source.entries:
        got, want = read(name), converted(source, name, wanted)
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) or not _bitwise_equal(got, want):
            raise VerifyFailed(
                f"verify: tensor {name} of {weights} differs from the checkpoint's "
                f"({got.dtype} {tuple(got.shape)}, the checkpoint's {want.dtype} {tuple(want.shape)})"
            )
    say(f"verify: {len(names)} tensors read back from {weights.name} equal the checkpoint's, bit for bit")
    recorded = marker.get("param_checksum")
    if isinstance(recorded, float) and wanted == "fp32":
        _check_recorded_checksum(names, read, recorded, marker.get("step"), say)
    if config is not None:
        _forward(fmt, out, weights, config, source, wanted, say)


#: How far a recorded checksum may be from the export's when the ranks summed with several threads:
#: the tolerance training's own restore check allows (train/train.py), for the same reason.
SUM_ORDER_TOLERANCE = 1e-12


def _check_recorded_checksum(
    names: list[str], read: Callable[[str], Any], recorded: float, step: object, say: Callable[[str], None]
) -> None:
    """The export's :func:`weights_checksum` against the marker's. A float64 ``torch.dot`` sums in an
    order that depends on the thread count (measured: 1 and 2 threads differ in the last bit of a
    ZeRO-1 checkpoint's sum). Ranks sum with one thread (the launcher's ``OMP_NUM_THREADS=1``), so
    the export does too and compares exactly; a rank given more threads recorded a sum that may
    differ in the last bits, accepted within :data:`SUM_ORDER_TOLERANCE` and said so."""
    import math

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = weights_checksum(names, read)
    finally:
        torch.set_num_threads(before)
    if got == recorded:
        say(f"verify: param_checksum {got!r} equals the one training recorded at step {step}")
    elif math.isclose(got, recorded, rel_tol=SUM_ORDER_TOLERANCE, abs_tol=SUM_ORDER_TOLERANCE):
        say(f"verify: param_checksum {got!r} equals the {recorded!r} training recorded at step {step} to "
            f"{SUM_ORDER_TOLERANCE:g} (its ranks summed with more than one thread)")  # fmt: skip
    else:
        raise VerifyFailed(
            f"verify: the export's param_checksum is {got!r}, training recorded {recorded!r} at step {step}"
        )


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes: NaNs compare equal to themselves, and -0.0 differs from 0.0."""
    import torch

    if a.numel() == 0:
        return True
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def _forward(fmt: str, out: Path, weights: Path, config: Path, source: Source, wanted: str,
             say: Callable[[str], None]) -> None:  # fmt: skip
    """One fixed batch through the export as its user loads it, and through the checkpoint's tensors."""
    import torch
    import transformers

    from orchestrator.rundir.export.write import converted

    architectures = json.loads(config.read_text()).get("architectures") or []
    cls = getattr(transformers, str(architectures[0]), None) if architectures else None
    if cls is None:
        say(f"verify: no forward pass ({config} names no transformers class: {architectures})")
        return
    dtype = torch.bfloat16 if wanted == "bf16" else torch.float32
    try:
        with quiet_transformers():
            with torch.device("meta"):  # the config's shapes, no memory
                probe = cls(transformers.AutoConfig.from_pretrained(str(config.parent)))
            shapes = {name: tuple(t.shape) for name, t in probe.state_dict().items()}
            other = [f"{n} {shapes[n]}, the checkpoint's {s}" for n, (s, _) in source.entries.items()
                     if n in shapes and shapes[n] != s]  # fmt: skip
            if other:
                raise VerifyFailed(
                    f"verify: {cls.__name__} built from {config} does not fit the checkpoint's weights "
                    f"({len(other)} tensors of other shapes, first {other[0]})"
                )
            if fmt == "hf":
                exported = cls.from_pretrained(str(out), dtype=dtype)
            else:
                exported = cls(transformers.AutoConfig.from_pretrained(str(config.parent))).to(dtype)
                from safetensors.torch import load_file

                state = torch.load(weights, weights_only=True) if fmt == "torch" else load_file(str(weights))
                exported.load_state_dict(state, strict=False)
            reference = cls(exported.config).to(dtype)
            reference.load_state_dict({n: converted(source, n, wanted) for n in source.entries}, strict=False)
    except VerifyFailed:
        raise
    except Exception as exc:  # a config of another model: shapes that do not fit, a class that fails
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise VerifyFailed(
            f"verify: {cls.__name__} built from {config} cannot load the checkpoint's weights ({why})"
        ) from None
    reference.tie_weights()
    vocab = int(getattr(exported.config, "vocab_size", 2))
    batch = torch.arange(2 * 8).reshape(2, 8) * 7919 % vocab
    exported.eval()
    reference.eval()
    with torch.no_grad():
        got, want = exported(input_ids=batch).logits, reference(input_ids=batch).logits
    if not torch.equal(got, want):
        raise VerifyFailed(
            f"verify: {cls.__name__} logits of the export differ from the checkpoint's (max |diff| {float((got.float() - want.float()).abs().max())})"
        )
    say(
        f"verify: {cls.__name__} loaded from the export gives the checkpoint's logits on a fixed {tuple(batch.shape)} batch, exactly"
    )
