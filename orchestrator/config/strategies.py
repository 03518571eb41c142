"""Parallelism strategies and what each one means to Accelerate.

Each strategy is a small record. The mapping to Accelerate's config lives here
and nowhere else, so the FSDP1/FSDP2 differences (sharding-strategy names vs.
``reshard_after_forward`` plus a replicate x shard mesh) are decided once, and
:data:`STRATEGIES` is the only list of strategy names: the CLI's choices, the
profile schema and the training self-check (``orchestrator/rank/selfcheck.py``) read it.
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
    """True for Accelerate's FSDP path; False for ddp (MULTI_GPU) and DeepSpeed."""
    fsdp1_sharding: str | None
    """``fsdp_sharding_strategy`` for FSDP1."""
    fsdp2_reshard_after_forward: bool | None
    """``fsdp_reshard_after_forward`` for FSDP2; None where FSDP2 has no equivalent."""
    hybrid: bool
    """Replicates across nodes and shards within a node: needs >= 2 nodes and a 2-D mesh."""
    deepspeed_stage: int | None = None
    """The ZeRO stage DeepSpeed runs (Accelerate's DEEPSPEED path); None for DDP and FSDP strategies."""

    @property
    def uses_deepspeed(self) -> bool:
        return self.deepspeed_stage is not None

    @property
    def backend(self) -> str:
        """``ddp``, ``fsdp`` or ``deepspeed``: which group of options applies."""
        return "deepspeed" if self.uses_deepspeed else "fsdp" if self.uses_fsdp else "ddp"

    @property
    def distributed_type(self) -> str:
        """Accelerate's ``distributed_type`` for it."""
        return "DEEPSPEED" if self.uses_deepspeed else "FSDP" if self.uses_fsdp else "MULTI_GPU"


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
        # DeepSpeed ZeRO, launched per node as torchrun would (deepspeed_multinode_launcher: standard):
        # no pdsh, no ssh between nodes.
        Strategy(
            "deepspeed_zero1",
            "DeepSpeed: optimizer state sharded",
            "ZeRO-1",
            False,
            None,
            None,
            False,
            deepspeed_stage=1,
        ),
        Strategy(
            "deepspeed_zero2",
            "DeepSpeed: gradients and optimizer state sharded",
            "ZeRO-2",
            False,
            None,
            None,
            False,
            deepspeed_stage=2,
        ),
        Strategy(
            "deepspeed_zero3",
            "DeepSpeed: parameters, gradients and optimizer state sharded",
            "ZeRO-3",
            False,
            None,
            None,
            False,
            deepspeed_stage=3,
        ),
    )
}


#: The names, in table order (the order every "one of ..." message lists them in).
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)


def strategy_table() -> list[dict[str, str]]:
    """Rows for ``orchestrator strategies`` and docs/strategies.md."""
    rows = []
    for s in STRATEGIES.values():
        rows.append(
            {
                "strategy": s.name,
                "shards": s.summary,
                "zero": s.zero_stage,
                "fsdp1": s.fsdp1_sharding or _not_fsdp(s),
                "fsdp2": (
                    _not_fsdp(s)
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


def _not_fsdp(s: Strategy) -> str:
    return f"- (DEEPSPEED zero_stage {s.deepspeed_stage})" if s.uses_deepspeed else "- (MULTI_GPU/DDP)"
