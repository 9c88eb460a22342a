"""Causal grouped-query self-attention; projections through the parallel linears, core via SDPA."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megafp8.config import ModelConfig
from megafp8.model.rope import RotaryEmbedding
from megafp8.parallel import ColumnParallelLinear, RowParallelLinear
from megafp8.precision import PrecisionRecipe


def head_dim_of(cfg: ModelConfig) -> int:
    return cfg.head_dim if cfg.head_dim is not None else cfg.hidden_size // cfg.num_heads


def kv_heads_of(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads if cfg.num_kv_heads is not None else cfg.num_heads


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, device=None) -> None:
        super().__init__()
        self.n_heads = cfg.num_heads
        self.n_kv_heads = kv_heads_of(cfg)
        self.head_dim = head_dim_of(cfg)
        qkv_features = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, qkv_features, recipe, device=device)
        self.out_proj = RowParallelLinear(self.n_heads * self.head_dim, cfg.hidden_size, recipe, device=device)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        qkv = self.qkv_proj(x)  # (B, T, (n_heads + 2 * n_kv_heads) * head_dim)
        q, k, v = qkv.split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1
        )
        q = q.view(batch, seq_len, self.n_heads, self.head_dim)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = v.view(batch, seq_len, self.n_kv_heads, self.head_dim)
        q, k = rope(q, k)
        # SDPA wants (B, heads, T, head_dim); it computes softmax in FP32 internally.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads,
        )
        out = out.transpose(1, 2).reshape(batch, seq_len, self.n_heads * self.head_dim)
        return self.out_proj(out)
