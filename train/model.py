"""A small GPT: byte vocabulary, pre-LN blocks, causal attention through SDPA.

Presets (vocab 256, untied output head, no dropout so runs are deterministic):

========  =======  ========  =======  =============
preset    d_model  n_layer   n_head   parameters
========  =======  ========  =======  =============
tiny      128      4         4        ~0.87 M
small     512      8         8        ~25 M
base      768      18        12       ~128 M
1b        2048     20        16       ~1.0 B
========  =======  ========  =======  =============
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    max_seq_len: int = 128
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    mlp_ratio: int = 4


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=128, n_layer=4, n_head=4),
    "small": GPTConfig(d_model=512, n_layer=8, n_head=8, max_seq_len=256),
    "base": GPTConfig(d_model=768, n_layer=18, n_head=12, max_seq_len=512),
    "1b": GPTConfig(d_model=2048, n_layer=20, n_head=16, max_seq_len=1024),
}


def config_for(preset: str, seq_len: int | None = None) -> GPTConfig:
    base = PRESETS[preset]
    if seq_len is None or seq_len <= base.max_seq_len:
        return base
    return GPTConfig(**{**base.__dict__, "max_seq_len": seq_len})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TransformerBlock(nn.Module):
    """Pre-LN block; the unit FSDP wraps (``--wrap-cls TransformerBlock``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 style scaled init of the residual projections.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(preset: str, seq_len: int | None = None, seed: int = 0) -> GPT:
    """Same seed, same weights on every rank (no sync_module_states needed, and none on CPU)."""
    torch.manual_seed(seed)
    return GPT(config_for(preset, seq_len))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
