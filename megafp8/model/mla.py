"""Multi-head latent attention (DeepSeek-V2/V3): low-rank query and joint key/value compression, decoupled RoPE.

    q       = q_b(norm(q_a(x)))  (or q_proj(x) without `q_lora_rank`), per head [q_nope; q_rope]
    c_kv, k_rope = kv_a(x)       the compressed key/value (kv_lora_rank) and one rotary key shared by all heads
    k_nope, v   = kv_b(norm(c_kv)), per head
    attention over q = [q_nope; RoPE(q_rope)], k = [k_nope; RoPE(k_rope)], values v, scale 1/sqrt(nope + rope)
                                 (times YaRN's mscale^2 under `model.rope_scaling.mscale_all_dim`)

Under tensor parallelism heads are split: q_b (or q_proj) and kv_b are column-parallel, the output
projection row-parallel. The down projections q_a and kv_a are small and replicated; under sequence
parallelism they run on this rank's tokens and the up projections gather them (their gradients are
summed over TP like the norms'). The shared rotary key is gathered (SP) or replicated, and its
gradient summed over TP, since every rank's heads use it. The attention core runs through SDPA
(FP32 softmax) and RoPE in FP32; the projections follow the precision recipe (FP8 where a weight's
dims are multiples of 128: kv_a's kv_lora_rank + qk_rope_head_dim usually is not, so it stays BF16).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megafp8.config import ModelConfig
from megafp8.model.norm import RMSNorm
from megafp8.model.rope import RotaryEmbedding, softmax_mscale
from megafp8.model.sdpa import attention_kernels, sdpa_backends_for
from megafp8.parallel import (ColumnParallelLinear, ContextParallel, RowParallelLinear, TensorParallel,
                              context_attention, to_tp_region)
from megafp8.precision import PrecisionRecipe


class MultiHeadLatentAttention(nn.Module):
    """`model.attention.kind: mla`."""

    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, tp: TensorParallel, device=None,
                 cp: Optional[ContextParallel] = None) -> None:
        super().__init__()
        self.cp = cp or ContextParallel.single()
        if cfg.num_heads % tp.size != 0:
            raise ValueError(f"model.num_heads={cfg.num_heads} is not divisible by the tensor-parallel size {tp.size}")
        mla = cfg.attention
        self.tp = tp
        self.n_heads = cfg.num_heads // tp.size  # this rank's heads
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank = mla.kv_lora_rank
        dtype, q_width = recipe.param_dtype, cfg.num_heads * (self.nope + self.rope_dim)
        if mla.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(cfg.hidden_size, mla.q_lora_rank, recipe, device=device)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, cfg.norm_eps, dtype, device)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_width, recipe, tp, device=device)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, q_width, recipe, tp, device=device)
        kv_a_width = self.kv_rank + self.rope_dim
        kv_a_recipe = recipe.for_weight(kv_a_width, cfg.hidden_size)  # e.g. 512 + 64 rows: not FP8 tiles, BF16
        self.kv_a_proj = ColumnParallelLinear(cfg.hidden_size, kv_a_width, kv_a_recipe, device=device)
        self.kv_a_norm = RMSNorm(self.kv_rank, cfg.norm_eps, dtype, device)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, cfg.num_heads * (self.nope + self.v_dim), recipe, tp,
                                              device=device)
        self.out_proj = RowParallelLinear(cfg.num_heads * self.v_dim, cfg.hidden_size, recipe, tp, device=device)
        mscale = softmax_mscale(cfg.rope_scaling)  # YaRN's correction of DeepSeek's attention (1 without)
        self.scale = (self.nope + self.rope_dim) ** -0.5 * mscale * mscale
        self.sdpa_backends = sdpa_backends_for(cfg.attention_backend, device)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: int, seq_len: int,
                norm: Optional[nn.Module] = None) -> torch.Tensor:
        """x: (tokens, hidden) token-major, all B*T tokens or this rank's share under sequence parallelism; `norm`
        is applied to it first."""
        if norm is not None:
            x = norm(x)
        h = self.n_heads
        q = self._queries(x).view(batch, seq_len, h, self.nope + self.rope_dim)  # this rank's heads, all tokens
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (tokens, rank), (tokens, rope)
        kv = self.kv_b_proj(self.kv_a_norm(c_kv)).view(batch, seq_len, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        if torch.is_grad_enabled():  # kept for backward as a view, v would keep kv's k_nope half alive too
            v = v.contiguous()
        # Every rank's heads use the one rotary key: all tokens of it, its gradient summed over TP.
        k_rope = to_tp_region(k_rope, self.tp)
        q_rope, k_rope = rope(q_rope, k_rope.reshape(batch, seq_len, 1, self.rope_dim))
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, h, -1)], dim=-1)
        if self.cp.enabled:  # this rank's chunks of each sequence against the group's keys and values
            out = context_attention(q, k, v, self.cp, scale=self.scale)  # (B, T / cp, heads, v_head_dim)
        else:
            with attention_kernels(self.sdpa_backends):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=True, scale=self.scale).transpose(1, 2)
        return self.out_proj(out.reshape(batch * seq_len, h * self.v_dim))
