"""The FP8 linear as `torch.library` custom ops, so `torch.compile` traces a block through it without a graph break.

Eagerly, `megafp8.precision.fp8_linear` runs an autograd Function that Dynamo cannot trace: its weight cache is
Python state keyed on the weight's version. Inside a compiled block that costs a graph break per linear, so the
block's compiled graph splits into pieces, each with its own guards and runtime wrappers. Here the same
computation is three opaque ops that Dynamo and AOTAutograd keep inside one graph:

    megafp8::fp8_weight           w -> w_fp8 (N, K), block scales (N/128, K/128), w^T fp8 (K, N), scales^T
    megafp8::fp8_fprop            x, w_fp8, scales -> y, x_fp8, x's 1x128 scales (stored transposed, (K/128, M))
    megafp8::fp8_backward         dy, saved x, w^T -> dx, dw

Their bodies call the same backend methods as the eager path (the same kernels, the same bits). Two differences,
both deliberate:
- The weight cache is filled outside the graph. A cache keyed on Python state (the weight's version) cannot live
  in a graph, so a compiled block first runs `Fp8WeightCache.prepare` eagerly (once per weight version, like the
  eager path) and the graph takes the cached tensors as inputs. Without a prepared cache (a bare compiled layer),
  the graph quantizes the weight itself (`fp8_weight`) at every call.
- The weight gradient is returned as the weight's gradient (the gradient buffer's hook adds it into the FP32
  `main_grad`), instead of being added into `main_grad` inside backward: a compiled graph must not mutate state
  it does not own.

Used only where it is equivalent: every GEMM in FP8, no tensor-parallel collectives, no deferred weight gradients
(zero-bubble pipelines). Everything else keeps the eager path.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from megafp8.precision.backends import Fp8Backend, backend_by_name
from megafp8.precision.formats import FORMATS, TILE


@functools.cache
def _backend(name: str) -> Fp8Backend:
    """The backend class `name`, made once (backends hold no state; the choice was checked when the layer ran)."""
    return backend_by_name(name)


@torch.library.custom_op("megafp8::fp8_weight", mutates_args=())
def fp8_weight(weight: torch.Tensor, fmt: str, pow2: bool, backend: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, s, qt, st = _backend(backend).quantize_blocks_with_transpose(weight, FORMATS[fmt], pow2)
    s, st = s.contiguous(), st.contiguous()
    if st.untyped_storage().data_ptr() == s.untyped_storage().data_ptr():  # one block: s^T is s (outputs may not alias)
        st = st.clone()
    return q, s, qt, st


@fp8_weight.register_fake
def _(weight, fmt, pow2, backend):
    n, k = weight.shape
    dtype = FORMATS[fmt].dtype
    return (weight.new_empty(n, k, dtype=dtype), weight.new_empty(n // TILE, k // TILE, dtype=torch.float32),
            weight.new_empty(k, n, dtype=dtype), weight.new_empty(k // TILE, n // TILE, dtype=torch.float32))


@torch.library.custom_op("megafp8::fp8_fprop", mutates_args=())
def fp8_fprop(x2d: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, fmt: str, pow2: bool, backend: str,
              scale_in_gemm_layout: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = _backend(backend)
    x_fp8, x_scale = b.quantize_tiles(x2d, FORMATS[fmt], pow2)
    w_scale = w_scale if scale_in_gemm_layout else b.block_scales_for_gemm(w_scale)
    y = b.gemm(x_fp8, x_scale, w_fp8, w_scale, True, x2d.dtype)
    # The scales leave transposed and contiguous, (K/128, M): the fast backends make them column-major already.
    return y, x_fp8, x_scale.t().contiguous()


@fp8_fprop.register_fake
def _(x2d, w_fp8, w_scale, fmt, pow2, backend, scale_in_gemm_layout):
    m, k = x2d.shape
    return (x2d.new_empty(m, w_fp8.shape[0]), x2d.new_empty(m, k, dtype=FORMATS[fmt].dtype),
            x2d.new_empty(k // TILE, m, dtype=torch.float32))


@torch.library.custom_op("megafp8::fp8_backward", mutates_args=())
def fp8_backward(dy2d: torch.Tensor, x_fp8: torch.Tensor, x_scale_t: torch.Tensor, wt_fp8: torch.Tensor,
                 wt_scale: torch.Tensor, fmt: str, grad_fmt: str, pow2: bool, backend: str,
                 scale_in_gemm_layout: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from megafp8.precision.fp8_linear import Fp8GemmConfig, wgrad

    b = _backend(backend)
    dy_fp8, dy_scale, *dyt = b.quantize_tiles_both(dy2d, FORMATS[grad_fmt], pow2)
    wt_scale = wt_scale if scale_in_gemm_layout else b.block_scales_for_gemm(wt_scale)
    dx = b.gemm(dy_fp8, dy_scale, wt_fp8, wt_scale, True, dy2d.dtype)
    cfg = Fp8GemmConfig.from_names(fmt, grad_fmt, pow2, True, True, True)
    dw = wgrad(None, (x_fp8, x_scale_t.t()), cfg, b, tuple(dyt), dy2d.dtype)
    return dx, dw


@fp8_backward.register_fake
def _(dy2d, x_fp8, x_scale_t, wt_fp8, wt_scale, fmt, grad_fmt, pow2, backend, scale_in_gemm_layout):
    return dy2d.new_empty(dy2d.shape[0], x_fp8.shape[1]), dy2d.new_empty(dy2d.shape[1], x_fp8.shape[1])


class _TracedFp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, fmt: str, grad_fmt: str, pow2: bool, backend: str, *cached):
        # `cached`: the layer's current quantized weight (w, scales, w^T, scales^T, scales in the GEMM's layout),
        # or nothing, and the weight is quantized here.
        in_gemm_layout = bool(cached)
        w_fp8, w_scale, wt_fp8, wt_scale = cached or fp8_weight(weight.detach(), fmt, pow2, backend)
        y, x_fp8, x_scale_t = fp8_fprop(x2d, w_fp8, w_scale, fmt, pow2, backend, in_gemm_layout)
        ctx.save_for_backward(x_fp8, x_scale_t, wt_fp8, wt_scale)
        ctx.names = (fmt, grad_fmt, pow2, backend, in_gemm_layout)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw = fp8_backward(dy.contiguous(), *ctx.saved_tensors, *ctx.names)
        return (dx, dw, None, None, None, None) + (None,) * (len(ctx.needs_input_grad) - 6)


def traced_fp8_linear(x: torch.Tensor, weight: torch.Tensor, fmt: str, grad_fmt: str, pow2: bool, backend: str,
                      cached: Optional[tuple[torch.Tensor, ...]] = None) -> torch.Tensor:
    """`x @ weight^T` in FP8 (fprop, dgrad and wgrad), traceable by `torch.compile`; x (..., K), weight (N, K).
    `cached`: the weight already quantized for its current version (`Fp8WeightCache`), else quantized here."""
    x2d = x.reshape(-1, x.shape[-1])
    y = _TracedFp8LinearFn.apply(x2d, weight, fmt, grad_fmt, pow2, backend, *(cached or ()))
    return y.reshape(*x.shape[:-1], y.shape[-1])
