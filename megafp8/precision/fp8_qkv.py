"""The QKV projection and the rotary embedding of its queries and keys as one FP8 autograd function, so RoPE's
backward quantizes its own output:

    forward   x (or RMSNorm(h)) -> FP8 both ways        (`quantize_layer_input`, as the FP8 linear)
              y = x_fp8 @ w^T                           (M, Nq + Nk + Nv) BF16
              q, k = RoPE(y's query and key features)   in FP32, returned in BF16 (`producers.rotate`); v: a copy of y's values
    backward  dq, dk, dv (the attention core's gradients)
              -> [RoPE^T(dq) | RoPE^T(dk) | dv] in FP32, quantized both ways by one kernel
                                                        (`rope_backward_quantize`: the BF16 gradient of y is never
                                                        written, and dq, dk, dv are read once)
              dx = dy_fp8 @ w;  dw = dy^T_fp8 @ x^T_fp8^T  (as the FP8 linear, into `main_grad` where there is one)

Numerically this is the FP8 linear followed by RoPE, except that the projection's output gradient is quantized from
FP32 instead of from its BF16 rounding (`../shared/DESIGN.md`, section 3: a gradient's producer may quantize its
FP32 result). The rotation is RoPE's own arithmetic, so forward gives the unfused path's bits. The attention of
`megafp8.model.attention` uses it for FP8 QKV projections whose query, key and value widths are whole 128-wide
tiles with heads that tile them (`producers.rope_backward_fusable`); under `torch.compile` it is traced like the
FP8 linear (its kernels are custom ops).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megafp8.precision.backends import Fp8Backend
from megafp8.precision.eager import run_eagerly
from megafp8.precision.fp8_linear import (
    InputNorm, current_weight, for_dgrad, input_and_weight_grads, quantize_layer_input, traced_main_grad,
)
from megafp8.precision.fp8_ops import backend_arg, kernels
from megafp8.precision.linear_comm import LinearComm
from megafp8.precision.producers import rotate
from megafp8.precision.recipe import Fp8Recipe
from megafp8.precision.weight_cache import Fp8WeightCache
from megafp8.precision.wgrad import WeightGradQueue


@dataclass(frozen=True)
class Rotary:
    """Where RoPE applies on the projection's output (this rank's features): the first `widths[0]` features are
    queries and the next `widths[1]` keys, rotated per head of `head_dim`; the last `widths[2]` are values. Rows
    are `batch` sequences of `seq_len` tokens, token-major."""

    widths: tuple[int, int, int]
    head_dim: int
    batch: int
    seq_len: int


class _Fp8QkvRopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, weight, w_fp8, w_scale, wt_fp8, wt_scale, main_grad, cos, sin, eps: float,
                recipe: Fp8Recipe, backend, traced: bool, comm: LinearComm, queue: Optional[WeightGradQueue],
                grad_enabled: bool, rotary: Rotary):
        assert recipe.all_gemms, "the fused QKV projection + RoPE runs all three GEMMs in FP8 (`fuses_rope`)"
        k = kernels(backend, traced)
        x2d = x.reshape(-1, x.shape[-1])  # (M, K) this rank's rows
        x_fp8, x_scale, *x_cols, rstd = quantize_layer_input(k, x2d, norm_weight, eps, recipe, comm,
                                                             for_wgrad=weight.requires_grad and grad_enabled)
        y = k.gemm_1x128_128x128(x_fp8, x_scale, w_fp8, w_scale, x.dtype)  # (M, Nq + Nk + Nv), all tokens
        fused_norm = norm_weight is not None
        ctx.save_for_backward(cos, sin, *x_cols, weight, *for_dgrad(w_fp8, w_scale, wt_fp8, wt_scale),
                              x2d if fused_norm else None, norm_weight, rstd, main_grad)
        ctx.recipe, ctx.backend, ctx.traced, ctx.comm, ctx.queue = recipe, backend, traced, comm, queue
        ctx.kept_transpose, ctx.in_shape, ctx.rotary, ctx.dtype = wt_fp8 is not None, x.shape, rotary, x.dtype
        return _split_and_rotate(y, cos, sin, rotary, own_v=grad_enabled)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        recipe, rotary = ctx.recipe, ctx.rotary
        k = kernels(ctx.backend, ctx.traced)
        cos, sin, *saved = ctx.saved_tensors
        rows = rotary.batch * rotary.seq_len
        # autograd hands each output's gradient in the output's dtype, zeros for an unused one
        grads = [g.reshape(rows, w) for g, w in zip((dq, dk, dv), rotary.widths)]
        dy_fp8, dy_scale, *dy_cols = k.rope_backward_quantize(*grads, cos, sin, rotary.seq_len, rotary.head_dim,
                                                              recipe.grad_fmt, recipe.power_of_two_scales)
        dx, dnorm, dw = input_and_weight_grads(ctx, k, tuple(saved), dy_fp8, dy_scale, dy_cols, None, ctx.dtype)
        return (dx, dnorm, dw) + (None,) * 15


def _split_and_rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Rotary,
                      own_v: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y (M, Nq + Nk + Nv) -> (q, k, v), each (batch, seq_len, heads, head_dim): q and k rotated (new tensors); v
    copied where `own_v` (a backward will follow), so that what the attention core keeps for it does not keep y
    alive (a view of y would keep all of it), else a view of y."""
    nq, nk, nv = rotary.widths
    b, t, d = rotary.batch, rotary.seq_len, rotary.head_dim
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, head_dim)
    q = rotate(y[:, :nq].view(b, t, nq // d, d), cos, sin)
    k = rotate(y[:, nq:nq + nk].view(b, t, nk // d, d), cos, sin)
    v = y[:, nq + nk:].view(b, t, nv // d, d)
    return q, k, v.contiguous() if own_v else v


def fp8_qkv_rope(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache, recipe: Fp8Recipe,
                 backend: Fp8Backend, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor,
                 comm: Optional[LinearComm] = None, wgrad_queue: Optional[WeightGradQueue] = None,
                 norm: Optional[InputNorm] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 QKV projection of x (or of `norm(x)`, fused into its quantizer) with RoPE applied to its queries and
    keys: (q, k, v), each (batch, seq_len, heads, head_dim) in x's dtype; cos and sin are RoPE's (seq_len,
    head_dim) FP32 tables. Needs all three GEMMs in FP8 (`recipe.all_gemms`) and, for a norm, an input quantized
    before any gather (`fp8_linear.fuses_norm`); `comm` must be a column-parallel layer's (no output reduction).
    Traced by `torch.compile` unless it defers its weight gradient (then it runs eagerly inside the graph)."""
    if torch.compiler.is_compiling() and wgrad_queue is not None:
        return _eager_fp8_qkv_rope(x, weight, cache, recipe, backend, rotary, cos, sin, comm, wgrad_queue, norm)
    traced = torch.compiler.is_compiling()
    entry = current_weight(cache, weight, recipe, backend, traced)
    norm_weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
    return _Fp8QkvRopeFn.apply(x, norm_weight, weight, *entry.tensors(), traced_main_grad(cache, traced), cos, sin,
                               eps, recipe, backend_arg(backend, traced), traced, comm or LinearComm(), wgrad_queue,
                               torch.is_grad_enabled(), rotary)


@run_eagerly  # a deferred weight gradient is Python state a traced backward cannot reach
def _eager_fp8_qkv_rope(x, weight, cache, recipe, backend, rotary, cos, sin, comm, wgrad_queue, norm):
    return fp8_qkv_rope(x, weight, cache, recipe, backend, rotary, cos, sin, comm, wgrad_queue, norm)
