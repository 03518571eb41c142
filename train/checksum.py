"""Parameter and optimizer-state checksums, comparable across strategies and world sizes.

Every tensor is gathered to its full (unsharded) value on every rank
(``torch.distributed.checkpoint.state_dict`` with ``full_state_dict=True``), so
the fully qualified names and values are the same whatever the wrapping (DDP,
FSDP1, FSDP2, HSDP) and however many ranks there are. The checksum is a
position-weighted sum in float64 over the names in sorted order: deterministic,
and sensitive to swapped elements, not just to the total.

Usage by hand: ``python -m train.checksum <checkpoint dir>`` prints the checksums
stored in its ``COMPLETE.json``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import cast

import torch

from orchestrator.rundir.export.verify import weights_checksum

#: Above this many parameters, gathering full state on every rank costs too much memory: skip.
MAX_PARAMS_FOR_CHECKSUM = 200_000_000


def tensor_checksum(named: Mapping[str, torch.Tensor]) -> float:
    """The position-weighted float64 sum over ``named`` in sorted-name order: one definition, shared
    with ``orchestrator export --verify``, which compares an export with the value recorded here."""
    return weights_checksum(named, named.__getitem__)


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, optimizer state) as full tensors keyed by clean names; a collective: all ranks call it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    # cpu_offload=False on purpose: FSDP1's FULL_STATE_DICT with offload_to_cpu crashes on CPU.
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    inner = getattr(optimizer, "optimizer", optimizer)
    # With full_state_dict=True the values are plain full tensors (the stub allows any ValueType).
    params = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
    optim = get_optimizer_state_dict(model, inner, options=options)
    state = optim.get("state", {})
    assert isinstance(state, dict)  # {fqn: {key: value}}; the stub also allows a list of dicts
    return params, _flat_optimizer_state(state)


def checksums(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, num_params: int
) -> dict[str, float | None]:
    """{"param_checksum", "optim_checksum"} (None for models too big to gather); a collective.

    ``num_params`` is the unsharded parameter count (sharded modules report local sizes)."""
    if num_params > MAX_PARAMS_FOR_CHECKSUM:
        return {"param_checksum": None, "optim_checksum": None}
    params, optim = full_state(model, optimizer)
    return {"param_checksum": tensor_checksum(params), "optim_checksum": tensor_checksum(optim)}


def _flat_optimizer_state(state: Mapping) -> dict[str, torch.Tensor]:
    """``{"<fqn>/<key>": tensor}`` over an optimizer state keyed by parameter name (as in ``full_state``)."""
    flat: dict[str, torch.Tensor] = {}
    for fqn, per_param in state.items():
        for key, value in per_param.items():
            if isinstance(value, (torch.Tensor, int, float)):
                flat[f"{fqn}/{key}"] = (
                    value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                )
    return flat


def checksums_of_full_state(
    params: Mapping[str, torch.Tensor], optim_state_dict: Mapping, fqns: list[str]
) -> dict[str, float | None]:
    """:func:`checksums` over full tensors already at hand (a DDP rank's staged copies), no communication.

    ``optim_state_dict`` is ``optimizer.state_dict()`` (state keyed by position); ``fqns`` names those
    positions. Same names and tensors as ``full_state`` gives, so the same floats bit for bit."""
    named = {fqns[int(index)]: per_param for index, per_param in optim_state_dict.get("state", {}).items()}
    return {
        "param_checksum": tensor_checksum(params),
        "optim_checksum": tensor_checksum(_flat_optimizer_state(named)),
    }


def checksums_of_dcp_checkpoint(
    model_dir: str | os.PathLike[str], optim_dir: str | os.PathLike[str]
) -> dict[str, float | None]:
    """:func:`checksums` of a DCP checkpoint read back from disk by one process (no collectives).

    Used by the async save on rank 0, off the training thread: the saved files hold the same full
    tensors the training-time gather would produce (``{"model": {fqn: ...}}`` and
    ``{"optimizer": {"state": {fqn: {...}}}}``), so the checksums are identical. The caller applies
    ``MAX_PARAMS_FOR_CHECKSUM`` (the read-back holds the full state in memory, like the gather)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    def read(folder: str | os.PathLike[str]) -> dict:
        loaded: dict = {}
        _load_state_dict(
            loaded,
            storage_reader=FileSystemReader(str(folder)),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
        return loaded

    params = read(model_dir).get("model", {})
    optim = read(optim_dir).get("optimizer", {})
    return {
        "param_checksum": tensor_checksum(params),
        "optim_checksum": tensor_checksum(_flat_optimizer_state(optim.get("state", {}))),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m train.checksum <checkpoint dir>", file=sys.stderr)
        return 2
    marker = json.loads((__import__("pathlib").Path(args[0]) / "COMPLETE.json").read_text())
    print(json.dumps({k: marker.get(k) for k in ("step", "param_checksum", "optim_checksum")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def local_shard_checksum(model: torch.nn.Module) -> float:
    """Checksum of the parameter values this rank holds (its shard), no communication.

    Ranks holding the same shard in different replicas (DDP: every rank; HSDP: the same position in
    each node) must agree bit for bit after training, or gradients were not synchronised."""
    named = {}
    for name, p in model.named_parameters():
        value = p.to_local() if hasattr(p, "to_local") else p
        named[name] = value.detach()
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for i, module in enumerate(FSDP.fsdp_modules(model)):
            if module._handle is not None:
                named[f"__flat_param_{i}"] = module._handle.flat_param.detach()
    except ImportError:
        pass
    return tensor_checksum(named)
