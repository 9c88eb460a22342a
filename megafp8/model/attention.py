"""Causal grouped-query self-attention; projections through the parallel linears, core via SDPA."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megafp8.config import ModelConfig
from megafp8.model.norm import RMSNorm
from megafp8.model.rope import RotaryEmbedding
from megafp8.model.sdpa import attention_kernels, sdpa_backends_for
from megafp8.parallel import (ColumnParallelLinear, ContextParallel, RowParallelLinear, TensorParallel, TpShard,
                              context_attention, mark_tp_partial)
from megafp8.parallel.sharding import mark_sharded  # (a layer's own helper, not re-exported by megafp8.parallel)
from megafp8.precision import PrecisionRecipe, Rotary


class Attention(nn.Module):
    """Grouped-query attention (`model.attention.kind: gqa`). Heads are split across tensor-parallel ranks: each rank
    projects, attends and outputs its own heads."""

    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, tp: TensorParallel, device=None,
                 cp: Optional[ContextParallel] = None) -> None:
        super().__init__()
        self.cp = cp or ContextParallel.single()
        gqa = cfg.attention
        for what, heads in gqa.split_heads(cfg.num_heads):
            if heads % tp.size != 0:
                raise ValueError(f"{what}={heads} is not divisible by the tensor-parallel size {tp.size}")
        self.head_dim = gqa.head_dim_for(cfg.hidden_size, cfg.num_heads)
        kv_heads = gqa.kv_heads_for(cfg.num_heads)
        self.n_heads = cfg.num_heads // tp.size  # this rank's heads
        self.n_kv_heads = kv_heads // tp.size
        q_features, kv_features = cfg.num_heads * self.head_dim, kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, q_features + 2 * kv_features, recipe, tp,
                                             parts=(q_features, kv_features, kv_features), device=device)
        self.out_proj = RowParallelLinear(q_features, cfg.hidden_size, recipe, tp, device=device)
        self.sdpa_backends = sdpa_backends_for(cfg.attention_backend, device)
        self.q_norm = self.k_norm = self.qkv_bias = None
        if gqa.qkv_bias:  # Qwen2's: split over TP as the projection's rows are, every rank's own heads
            local = (q_features + 2 * kv_features) // tp.size
            self.qkv_bias = nn.Parameter(torch.zeros(local, dtype=recipe.param_dtype, device=device))
            if tp.enabled:
                mark_sharded(self.qkv_bias, TpShard(0, (q_features, kv_features, kv_features)))
        # Qwen3's query/key norms: one weight per head width that every head shares, so each TP rank's gradient of
        # it comes from its own heads only (summed over the TP group, `mark_tp_partial`).
        if gqa.qk_norm:
            dtype = recipe.param_dtype
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype, device)
            for norm in (self.q_norm, self.k_norm):
                mark_tp_partial(norm.weight)
        self.widths = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)
        # Set while FP8 health is sampled: the projection then runs as a layer of its own, whose hooks see its input
        # and its output's gradient (fused with RoPE, the BF16 output gradient is never made).
        self.observed = False

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: int, seq_len: int,
                norm: Optional[RMSNorm] = None) -> torch.Tensor:
        """x: (tokens, hidden) token-major, all B*T tokens or this rank's share under sequence parallelism. `norm`
        is applied to x first (under FP8, fused into the QKV projection's quantizer)."""
        rotary = Rotary(self.widths, self.head_dim, batch, seq_len)
        # The query/key norms or the bias lie between the projection and RoPE: RoPE's backward is not fusable then.
        fused = self.q_norm is None and self.qkv_bias is None and not self.observed
        if norm is not None and fused and self.qkv_proj.fuses_rope(x.numel() // x.shape[-1], rotary):
            # FP8: RoPE's backward quantizes the projection's output gradient itself (`megafp8.precision.fp8_qkv`)
            q, k, v = self.qkv_proj.rotated(x, norm, rotary, *rope.tables(seq_len))
        else:
            qkv = self.qkv_proj(x, norm)  # (B*T, (n_heads + 2 * n_kv_heads) * head_dim), this rank's heads
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            q, k, v = (t.view(batch, seq_len, -1, self.head_dim) for t in qkv.split(self.widths, dim=-1))
            if self.q_norm is not None:  # per head, before RoPE (Qwen3)
                q, k = self.q_norm(q), self.k_norm(k)
            # RoPE makes q and k anew, and v gets its own storage too: kept for backward as a view, it would keep
            # the whole projection output alive (its q and k parts dead weight: 2/3 of it with MHA). The copy is a
            # kernel of its own, compiled too (it reads nothing RoPE's kernel reads, so Inductor does not fuse them).
            q, k = rope(q, k)
            if torch.is_grad_enabled():  # nothing keeps v without a backward to follow
                v = v.contiguous()
        if self.cp.enabled:  # this rank's chunks of each sequence against the group's keys and values
            out = context_attention(q, k, v, self.cp)
        else:  # SDPA wants (B, heads, T, head_dim); it computes softmax in FP32 internally.
            with attention_kernels(self.sdpa_backends):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads,
                ).transpose(1, 2)
        out = out.reshape(batch * seq_len, self.n_heads * self.head_dim)
        return self.out_proj(out)
