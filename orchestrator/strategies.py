"""Parallelism strategies and what each one means to Accelerate.

Each strategy is a small record. The mapping to Accelerate's config lives here
and nowhere else, so the FSDP1/FSDP2 differences (sharding-strategy names vs.
``reshard_after_forward`` plus a replicate x shard mesh) are decided once, and
:data:`STRATEGIES` is the only list of strategy names: the CLI's choices, the
profile schema and the training self-check (``train/selfcheck.py``) read it.
Standard library only, so the training side can import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """A named way to split training state across ranks."""

    name: str
    """Name used on the command line and in profiles."""
    summary: str
    """What is sharded, in one line (shown by ``orchestrator strategies``)."""
    zero_stage: str
    """The DeepSpeed ZeRO stage it corresponds to, for readers who think in those terms."""
    uses_fsdp: bool
    """False only for ddp (Accelerate's MULTI_GPU path)."""
    fsdp1_sharding: str | None
    """``fsdp_sharding_strategy`` for FSDP1."""
    fsdp2_reshard_after_forward: bool | None
    """``fsdp_reshard_after_forward`` for FSDP2; None where FSDP2 has no equivalent."""
    hybrid: bool
    """Replicates across nodes and shards within a node: needs >= 2 nodes and a 2-D mesh."""


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("ddp", "nothing sharded; gradients all-reduced", "ZeRO-0", False, None, None, False),
        Strategy(
            "full_shard",
            "parameters, gradients and optimizer state sharded",
            "ZeRO-3",
            True,
            "FULL_SHARD",
            True,
            False,
        ),
        Strategy(
            "shard_grad_op",
            "gradients and optimizer state sharded; parameters kept after forward",
            "ZeRO-2",
            True,
            "SHARD_GRAD_OP",
            False,
            False,
        ),
        Strategy(
            "no_shard",
            "FSDP wrapper without sharding (DDP-like); FSDP1 only",
            "ZeRO-0",
            True,
            "NO_SHARD",
            None,
            False,
        ),
        Strategy(
            "hybrid_shard",
            "full_shard within a node, replicated across nodes",
            "ZeRO-3 x DP",
            True,
            "HYBRID_SHARD",
            True,
            True,
        ),
        Strategy(
            "hybrid_shard_zero2",
            "shard_grad_op within a node, replicated across nodes",
            "ZeRO-2 x DP",
            True,
            "_HYBRID_SHARD_ZERO2",
            False,
            True,
        ),
    )
}


#: The names, in table order (the order every "one of ..." message lists them in).
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)


def strategy_table() -> list[dict[str, str]]:
    """Rows for ``orchestrator strategies`` and the README."""
    rows = []
    for s in STRATEGIES.values():
        rows.append(
            {
                "strategy": s.name,
                "shards": s.summary,
                "zero": s.zero_stage,
                "fsdp1": s.fsdp1_sharding or "- (MULTI_GPU/DDP)",
                "fsdp2": (
                    "- (MULTI_GPU/DDP)"
                    if not s.uses_fsdp
                    else "not available"
                    if s.fsdp2_reshard_after_forward is None
                    else f"reshard_after_forward={str(s.fsdp2_reshard_after_forward).lower()}"
                    + (", dp_replicate=nodes x dp_shard=procs/node" if s.hybrid else "")
                ),
                "min_nodes": "2" if s.hybrid else "1",
            }
        )
    return rows
