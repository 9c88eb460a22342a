"""The FP8 linear: `y = x @ w^T` whose fprop, dgrad and wgrad GEMMs run in per-tile scaled FP8.

    forward   x  -> x_fp8 (1x128 along K) and x^T_fp8 (1x128 along M), one read of x
              y  = x_fp8 @ w_fp8^T                                          (BF16 out)
    dgrad     dy -> dy_fp8 (1x128 along N) and dy^T_fp8 (1x128 along M), one read of dy
              dx = dy_fp8 @ w_fp8                                           (BF16 out)
    wgrad     dw = dy^T_fp8 @ x^T_fp8^T                                     (BF16 out, FP32 accumulation)

Every operand is quantized once from its high-precision original (`../shared/DESIGN.md`, section 3): forward
saves only x^T in FP8 for wgrad (1 + 1/32 bytes per element instead of BF16's 2). The weight is quantized in
128x128 blocks once per weight version (`Fp8WeightCache`); dgrad's w^T is made from it in backward, or kept with it
(`precision.fp8_keep_weight_transpose`).

A `LinearComm` adds a tensor-parallel layer's collectives around the GEMMs (the identity here): the input is
quantized before an all-gather where its tiles allow, so the gather moves FP8 bytes, and the input-gradient
reduction is started before the wgrad GEMM and awaited after it, so the two overlap. Each GEMM of the recipe may
instead stay BF16 (`precision.fp8_fprop/dgrad/wgrad`, for experiments).

Every FP8 GEMM accumulates in FP32 inside (scales applied per 128-wide K block) and writes BF16, except the
weight gradient's when the parameter has an FP32 `main_grad` (micro-batches accumulate there): that GEMM adds its
FP32 product into `main_grad` itself (cuBLASLt's epilogue on the cublas backend; no BF16 dw, no separate add),
eagerly or deferred to a `WeightGradQueue`, and in a compiled graph into the alias of `main_grad` that the weight
cache hands it (`Fp8WeightCache.main_grad_alias`). Without a `main_grad`, dw is returned in BF16.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from megafp8.precision.backends import Fp8Backend, QuantizedWeight
from megafp8.precision.eager import run_eagerly
from megafp8.precision.fp8_ops import backend_arg, kernels, quantized_weight_in_graph
from megafp8.precision.linear_comm import LinearComm, quantized_input
from megafp8.precision.producers import rmsnorm_backward
from megafp8.precision.recipe import Fp8Recipe
from megafp8.precision.weight_cache import Fp8WeightCache
from megafp8.precision.wgrad import WeightGradQueue, weight_grad_or_defer


class InputNorm(Protocol):
    """An RMSNorm an FP8 layer may fuse into the quantization of its input (`megafp8.model.norm.RMSNorm`)."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def weight_gradient(weight: torch.Tensor, compute, queue: Optional[WeightGradQueue], traced: bool):
    """What backward returns for `weight`: the GEMM's result in a traced graph; eagerly, `weight_grad_or_defer`."""
    return compute() if traced else weight_grad_or_defer(weight, compute, queue)


def fp8_weight_gradient(k, weight: torch.Tensor, main_grad: Optional[torch.Tensor], a: torch.Tensor,
                        a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
                        queue: Optional[WeightGradQueue], traced: bool) -> Optional[torch.Tensor]:
    """The FP8 weight gradient a @ b^T (a = dy^T, b = x^T, 1x128 tiles along the tokens), where it goes: in a
    traced graph, added by the GEMM into `main_grad` (the cache's alias of the weight's FP32 main_grad) and None
    returned, or without one returned; eagerly through `weight_grad_or_defer` (added by the GEMM into
    `weight.main_grad`, or deferred to `queue`)."""
    def compute() -> torch.Tensor:
        return k.gemm_1x128_1x128(a, a_scale, b, b_scale, out_dtype)

    def compute_into(out: torch.Tensor) -> None:
        k.gemm_1x128_1x128_accumulate_(out, a, a_scale, b, b_scale)

    return route_weight_gradient(weight, main_grad, compute, compute_into, queue, traced)


def route_weight_gradient(weight: torch.Tensor, main_grad: Optional[torch.Tensor], compute: Callable[[], torch.Tensor],
                          compute_into: Callable[[torch.Tensor], object], queue: Optional[WeightGradQueue],
                          traced: bool) -> Optional[torch.Tensor]:
    """Where an FP8 weight gradient goes (see `fp8_weight_gradient`), for any GEMM: `compute()` returns it,
    `compute_into(out)` adds it into the FP32 `out`."""
    if not traced:
        return weight_grad_or_defer(weight, compute, queue, compute_into)
    if main_grad is None:
        return compute()
    compute_into(main_grad)
    return None


def traced_main_grad(cache: Fp8WeightCache, traced: bool) -> Optional[torch.Tensor]:
    """What a traced FP8 layer adds its weight gradient into: its cache's alias of `main_grad`, or None (eagerly,
    the layer finds `weight.main_grad` itself)."""
    return cache.main_grad_alias if traced else None


def for_dgrad(w_fp8: torch.Tensor, w_scale: torch.Tensor, wt_fp8: Optional[torch.Tensor],
              wt_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a layer saves for its dgrad GEMM: the kept w^T, or w itself where the cache keeps no transpose
    (`dgrad_weight` transposes it in backward)."""
    return (wt_fp8, wt_scale) if wt_fp8 is not None else (w_fp8, w_scale)


def dgrad_weight(k, saved_fp8: torch.Tensor, saved_scale: torch.Tensor, kept: bool) -> tuple[torch.Tensor, ...]:
    """w^T and its block scales for the dgrad GEMM, from what `for_dgrad` saved: as saved if the transpose was
    kept, else made now (for this GEMM only; 128x128 blocks are transpose-invariant, so the same bits)."""
    return (saved_fp8, saved_scale) if kept else k.transpose_weight(saved_fp8, saved_scale)


def quantize_layer_input(k, x2d: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float, recipe: Fp8Recipe,
                         comm: LinearComm, for_wgrad: bool = True) -> tuple[Optional[torch.Tensor], ...]:
    """The GEMM's input quantized both ways, `(x_fp8, x_scale, xt_fp8, xt_scale, rstd)`: x itself, or with
    `norm_weight` its RMSNorm, quantized by the norm's own kernel from FP32 (rstd: the norm's (M,) inverse RMS,
    else None). Quantized on this rank's rows and gathered in FP8 where `comm` allows it (with a norm, the caller
    checked it does). Without `for_wgrad` (no weight gradient to compute) x^T is neither made nor gathered:
    xt_fp8 and xt_scale are None. x^T comes in 128x128 blocks under `recipe.wgrad_input_blocks`."""
    fmt, pow2, blocks = recipe.fmt, recipe.power_of_two_scales, recipe.wgrad_input_blocks
    if norm_weight is not None:
        *parts, rstd = k.rmsnorm_quantize(x2d, norm_weight, eps, fmt, pow2, blocks)
        return (*comm.gather_quantized(*(parts if for_wgrad else parts[:2] + [None, None])), rstd)
    if for_wgrad:
        return (*quantized_input(x2d, lambda t: k.quantize_rows_cols(t, fmt, pow2, blocks), comm), None)
    return (*quantized_input(x2d, lambda t: (*k.quantize_rows(t, fmt, pow2), None, None), comm), None)


def layer_input_grad(dx2d: torch.Tensor, x2d: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
                     rstd: Optional[torch.Tensor], in_shape: torch.Size) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(dx, d norm_weight): the GEMM input's gradient, through the fused norm's backward if there was one."""
    if norm_weight is None:
        return dx2d.reshape(in_shape), None
    dh, dnorm = rmsnorm_backward(x2d, norm_weight, rstd, dx2d)
    return dh.reshape(in_shape), dnorm.to(norm_weight.dtype)


def input_and_weight_grads(ctx, k, saved: tuple, dy_fp8: Optional[torch.Tensor], dy_scale: Optional[torch.Tensor],
                           dy_cols: Optional[list], dy2d: Optional[torch.Tensor], dtype: torch.dtype) -> tuple:
    """(dx, d norm_weight, dw): an FP8 linear's backward once its output gradient is quantized, shared by
    `_Fp8LinearFn` and the fused QKV projection + RoPE (`megafp8.precision.fp8_qkv`). The dgrad GEMM runs first and
    its reduction starts before the wgrad GEMM, which can overlap it; then the input's gradient goes through the
    fused norm's backward. `saved`: `(*x_cols, weight, wt_fp8, wt_scale, x2d, norm_weight, rstd, main_grad)`, as
    both functions save them; `ctx`: their shared attributes (recipe, comm, queue, traced, kept_transpose,
    in_shape, needs_input_grad of x, norm_weight, weight first). `dy2d`: the BF16 output gradient, read only by
    GEMMs the recipe keeps in BF16."""
    *x_cols, weight, wt_fp8, wt_scale, x2d, norm_weight, rstd, main_grad = saved
    recipe = ctx.recipe
    finish_dx = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        dx2d = (k.gemm_1x128_128x128(dy_fp8, dy_scale, *dgrad_weight(k, wt_fp8, wt_scale, ctx.kept_transpose), dtype)
                if recipe.dgrad else dy2d @ weight)
        finish_dx = ctx.comm.start_reduce_grad_input(dx2d)
    dw = None
    if ctx.needs_input_grad[2]:
        if recipe.wgrad:
            dw = fp8_weight_gradient(k, weight, main_grad, *dy_cols, *x_cols, dtype, ctx.queue, ctx.traced)
        else:
            dw = weight_gradient(weight, lambda: dy2d.t() @ x_cols[0], ctx.queue, ctx.traced)
    dx = dnorm = None
    if finish_dx is not None:
        dx, dnorm = layer_input_grad(finish_dx(), x2d, norm_weight, rstd, ctx.in_shape)
    return dx, dnorm, dw


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, weight, w_fp8, w_scale, wt_fp8, wt_scale, main_grad, eps: float,
                recipe: Fp8Recipe, backend, traced: bool, comm: LinearComm, queue: Optional[WeightGradQueue],
                grad_enabled: bool):
        k = kernels(backend, traced)
        fmt, pow2 = recipe.fmt, recipe.power_of_two_scales
        x2d = x.reshape(-1, x.shape[-1])  # (M, K) this rank's rows
        rstd = None
        if recipe.all_gemms:
            x_fp8, x_scale, *x_cols, rstd = quantize_layer_input(k, x2d, norm_weight, eps, recipe, comm,
                                                                 for_wgrad=weight.requires_grad and grad_enabled)
            y = k.gemm_1x128_128x128(x_fp8, x_scale, w_fp8, w_scale, x.dtype)
        else:  # an experiment with some GEMMs in BF16 (no fused norm): gather BF16, quantize what FP8 GEMMs need
            x_full = comm.gather_input(x2d)
            if recipe.fprop:
                y = k.gemm_1x128_128x128(*k.quantize_rows(x_full, fmt, pow2), w_fp8, w_scale, x.dtype)
            else:
                y = F.linear(x_full, weight)
            x_cols = (k.quantize_rows_cols(x_full, fmt, pow2, recipe.wgrad_input_blocks)[2:] if recipe.wgrad
                      else [x_full])
        fused_norm = norm_weight is not None
        ctx.save_for_backward(*x_cols, weight, *for_dgrad(w_fp8, w_scale, wt_fp8, wt_scale),
                              x2d if fused_norm else None, norm_weight, rstd, main_grad)
        ctx.recipe, ctx.backend, ctx.traced, ctx.comm, ctx.queue = recipe, backend, traced, comm, queue
        ctx.kept_transpose = wt_fp8 is not None
        ctx.in_shape = x.shape
        y = comm.reduce_output(y)
        if y.shape[0] != x2d.shape[0]:  # the collectives changed the token count (sequence parallelism)
            return y
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        recipe, comm = ctx.recipe, ctx.comm
        k = kernels(ctx.backend, ctx.traced)
        dy2d = comm.gather_grad_output(dy.reshape(-1, dy.shape[-1]).contiguous())  # (M, N)
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dw = ctx.needs_input_grad[2]
        fmt, pow2 = recipe.grad_fmt, recipe.power_of_two_scales
        dy_fp8 = dy_scale = dy_cols = None
        if need_dw and recipe.wgrad:  # both quantizations of dy from one read of it
            dy_fp8, dy_scale, *dy_cols = k.quantize_rows_cols(dy2d, fmt, pow2)
        elif need_dx and recipe.dgrad:
            dy_fp8, dy_scale = k.quantize_rows(dy2d, fmt, pow2)
        dx, dnorm, dw = input_and_weight_grads(ctx, k, ctx.saved_tensors, dy_fp8, dy_scale, dy_cols, dy2d, dy.dtype)
        return dx, dnorm, dw, None, None, None, None, None, None, None, None, None, None, None, None


def current_weight(cache: Fp8WeightCache, weight: torch.Tensor, recipe: Fp8Recipe, backend: Fp8Backend,
                   traced: bool) -> QuantizedWeight:
    """The layer's quantized weight: from its cache eagerly; in a traced graph the prepared cache (`prepare` ran
    eagerly before the compiled code), or else quantized by the graph itself at every call."""
    if not traced:
        return cache.get(weight, backend, recipe.fmt, recipe.power_of_two_scales)
    entry = cache.traced_entry()
    if entry is not None and cache.per_expert:  # its idle experts may hold an older version's bytes
        raise RuntimeError("a per-expert weight cache is read in a graph through the experts' MLP "
                           "(megafp8.precision.grouped._experts_weight), which brings its experts with rows up to "
                           "date first; this caller would read stale experts")
    return entry if entry is not None else quantized_weight_in_graph(weight, recipe.fmt, recipe.power_of_two_scales,
                                                                     backend.name)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache, recipe: Fp8Recipe,
               backend: Fp8Backend, comm: Optional[LinearComm] = None,
               wgrad_queue: Optional[WeightGradQueue] = None, norm: Optional[InputNorm] = None) -> torch.Tensor:
    """`x @ weight^T` with FP8 GEMMs; x (..., K) BF16, weight (N, K). Token count M need not be a multiple of 128.
    `comm` adds the collectives of a tensor-parallel layer (output rows may then differ from input rows);
    `wgrad_queue` defers the weight-gradient GEMM (zero-bubble pipelines). `norm`: an RMSNorm to apply to x
    first, fused into the quantization of x (callers check `fuses_norm`).

    Under `torch.compile`, a layer without deferral is traced into the graph, its tensor-parallel collectives
    included (its kernels are custom ops, `megafp8.precision.fp8_ops`); it reads its quantized weight from `cache`
    once `cache.prepare` has run (eagerly, before the compiled code: `Block.forward` does). A layer that defers its
    weight gradient runs eagerly inside the compiled code."""
    if torch.compiler.is_compiling() and wgrad_queue is not None:
        return _eager_fp8_linear(x, weight, cache, recipe, backend, comm, wgrad_queue, norm)
    traced = torch.compiler.is_compiling()
    entry = current_weight(cache, weight, recipe, backend, traced)
    norm_weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
    return _Fp8LinearFn.apply(x, norm_weight, weight, *entry.tensors(), traced_main_grad(cache, traced), eps, recipe,
                              backend_arg(backend, traced), traced, comm or LinearComm(), wgrad_queue,
                              torch.is_grad_enabled())


def fuses_norm(recipe: Fp8Recipe, comm: Optional[LinearComm], rows: int) -> bool:
    """Whether an FP8 linear can take its input's RMSNorm into its quantizer: all three GEMMs in FP8, and an input
    quantized before any gather (the norm then runs on this rank's `rows`)."""
    return recipe.all_gemms and (comm is None or comm.gathers_quantized(rows))


# The eager FP8 linear is a graph break under torch.compile: a deferred weight gradient is Python state (the queue)
# that the backward of a traced graph cannot reach.
@run_eagerly
def _eager_fp8_linear(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache, recipe: Fp8Recipe,
                      backend: Fp8Backend, comm: Optional[LinearComm], wgrad_queue: Optional[WeightGradQueue],
                      norm: Optional[InputNorm]) -> torch.Tensor:
    return fp8_linear(x, weight, cache, recipe, backend, comm, wgrad_queue, norm)
