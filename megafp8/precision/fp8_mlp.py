"""The SwiGLU MLP as one FP8 autograd function, so every producer quantizes its own output:

    forward   x (or RMSNorm(h)) -> FP8 both ways         (`quantize_layer_input`: the norm's kernel quantizes)
              gu = x_fp8 @ w_gate_up^T                    (M, 2F) BF16, kept for backward
              a  = silu(gate) * up -> FP8 along F         (the SwiGLU kernel quantizes; `a` is never written)
              y  = a_fp8 @ w_down^T
    backward  dy -> FP8 both ways;  da = dy_fp8 @ w_down   (M, F) BF16
              d(gu) -> FP8 both ways, a^T -> FP8 again    (SwiGLU's backward kernel, which reads gu anyway; in
                                                          128x128 blocks under `wgrad_input_blocks`, from the
                                                          forward's tile maxima of a)
              dw_down = dy^T_fp8 @ a^T_fp8^T
              dx = d(gu)_fp8 @ w_gate_up;  dw_gate_up = d(gu)^T_fp8 @ x^T_fp8^T;  then the norm's backward

Numerically this is the two FP8 linears around SwiGLU, except that SwiGLU's output and its input gradient are
quantized from FP32 instead of from BF16 (`megafp8.precision.producers`). Backward keeps gu (BF16, as a BF16
MLP does) and x^T in FP8, not SwiGLU's output: its transpose is recomputed by the kernel that reads gu anyway. It needs all three GEMMs of both
projections in FP8; the gate/up projection's collectives are those of a column-parallel layer, the down
projection's those of a row-parallel one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megafp8.precision.backends import Fp8Backend
from megafp8.precision.eager import run_eagerly
from megafp8.precision.fp8_linear import (
    InputNorm, current_weight, dgrad_weight, for_dgrad, fp8_weight_gradient, layer_input_grad, quantize_layer_input,
    traced_main_grad,
)
from megafp8.precision.fp8_ops import backend_arg, kernels
from megafp8.precision.linear_comm import LinearComm
from megafp8.precision.recipe import Fp8Recipe
from megafp8.precision.weight_cache import Fp8WeightCache
from megafp8.precision.wgrad import WeightGradQueue


@dataclass
class Fp8Projection:
    """What one projection of the fused MLP brings: its weight shard, weight cache, collectives and wgrad queue."""

    weight: torch.Tensor
    cache: Fp8WeightCache
    comm: LinearComm
    queue: Optional[WeightGradQueue] = None


@dataclass
class MlpObserver:
    """Hands the fused MLP's inner tensors to an observer (the FP8 health monitor) as they are made, so that it
    need not recompute them: `forward(gu)` with the gate/up projection's output (M, 2F), `backward(dy, gu, da)` with
    the output gradient (M, N), gu again and SwiGLU's output gradient da (M, F). Both run during the call (nothing
    is kept for them), `forward` again where the forward is recomputed; neither may change what it is given."""

    forward: Callable[[torch.Tensor], None]
    backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class _Fp8SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, w_gate_up, w_down, gu_fp8, gu_scale, gut_fp8, gut_scale, down_fp8, down_scale,
                downt_fp8, downt_scale, main_grad_gate_up, main_grad_down, eps: float, recipe: Fp8Recipe, backend,
                traced: bool, comms: tuple, queues: tuple, grad_enabled: bool,
                observer: Optional[MlpObserver]):
        k = kernels(backend, traced)
        comm_in, comm_out = comms
        fmt, pow2 = recipe.fmt, recipe.power_of_two_scales
        x2d = x.reshape(-1, x.shape[-1])
        x_fp8, x_scale, xt_fp8, xt_scale, rstd = quantize_layer_input(k, x2d, norm_weight, eps, recipe, comm_in,
                                                                      for_wgrad=w_gate_up.requires_grad and grad_enabled)
        gu = k.gemm_1x128_128x128(x_fp8, x_scale, gu_fp8, gu_scale, x.dtype)  # (M, 2F) [gate | up], this rank's F
        if observer is not None:
            observer.forward(gu)
        # Its transpose for wgrad is made again in backward; in 128x128 blocks (`recipe.wgrad_input_blocks`) from
        # the tile maxima kept here.
        a_blocks = recipe.wgrad_input_blocks and w_down.requires_grad and grad_enabled
        a_fp8, a_scale, *a_amax = k.swiglu_quantize(gu, fmt, pow2, row_amax=a_blocks)
        y = comm_out.reduce_output(k.gemm_1x128_128x128(a_fp8, a_scale, down_fp8, down_scale, x.dtype))
        fused_norm = norm_weight is not None
        ctx.save_for_backward(xt_fp8, xt_scale, gu, w_gate_up, *for_dgrad(gu_fp8, gu_scale, gut_fp8, gut_scale),
                              w_down, *for_dgrad(down_fp8, down_scale, downt_fp8, downt_scale),
                              x2d if fused_norm else None, norm_weight, rstd, main_grad_gate_up, main_grad_down,
                              a_amax[0] if a_blocks else None)
        ctx.recipe, ctx.backend, ctx.traced, ctx.comms, ctx.queues = recipe, backend, traced, comms, queues
        ctx.observer = observer
        ctx.kept_transposes = (gut_fp8 is not None, downt_fp8 is not None)
        ctx.in_shape = x.shape
        if y.shape[0] != x2d.shape[0]:  # sequence parallelism: this rank's share of the tokens
            return y
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        recipe, (comm_in, comm_out), (queue_gate_up, queue_down) = ctx.recipe, ctx.comms, ctx.queues
        k = kernels(ctx.backend, ctx.traced)
        (xt_fp8, xt_scale, gu, w_gate_up, gut_fp8, gut_scale, w_down, downt_fp8, downt_scale, x2d, norm_weight,
         rstd, main_grad_gate_up, main_grad_down, a_amax) = ctx.saved_tensors
        pow2 = recipe.power_of_two_scales
        dy2d = comm_out.gather_grad_output(dy.reshape(-1, dy.shape[-1]).contiguous())
        dy_fp8, dy_scale, dyt_fp8, dyt_scale = k.quantize_rows_cols(dy2d, recipe.grad_fmt, pow2)
        kept_gate_up, kept_down = ctx.kept_transposes
        da = k.gemm_1x128_128x128(dy_fp8, dy_scale, *dgrad_weight(k, downt_fp8, downt_scale, kept_down),
                                  dy.dtype)  # (M, F)
        if ctx.observer is not None:
            ctx.observer.backward(dy2d, gu, da)
        # d(gu) both ways, and SwiGLU's output again (its transpose, for the down projection's wgrad).
        dgu_fp8, dgu_scale, dgut_fp8, dgut_scale, at_fp8, at_scale = k.swiglu_backward_quantize(
            gu, da, recipe.fmt, recipe.grad_fmt, pow2, a_amax)
        dw_down = fp8_weight_gradient(k, w_down, main_grad_down, dyt_fp8, dyt_scale, at_fp8, at_scale, dy.dtype,
                                      queue_down, ctx.traced)
        finish_dx = comm_in.start_reduce_grad_input(
            k.gemm_1x128_128x128(dgu_fp8, dgu_scale, *dgrad_weight(k, gut_fp8, gut_scale, kept_gate_up), dy.dtype))
        dw_gate_up = fp8_weight_gradient(k, w_gate_up, main_grad_gate_up, dgut_fp8, dgut_scale, xt_fp8, xt_scale,
                                         dy.dtype, queue_gate_up, ctx.traced)
        dx, dnorm = layer_input_grad(finish_dx(), x2d, norm_weight, rstd, ctx.in_shape)
        return (dx, dnorm, dw_gate_up, dw_down) + (None,) * 18


def fp8_swiglu_mlp(x: torch.Tensor, gate_up: Fp8Projection, down: Fp8Projection, recipe: Fp8Recipe,
                   backend: Fp8Backend, norm: Optional[InputNorm] = None,
                   observer: Optional[MlpObserver] = None) -> torch.Tensor:
    """down(silu(gate) * up) with gate/up = gate_up(x) (or of `norm(x)`, fused), all six GEMMs in FP8 and every
    producer quantizing its own FP32 output. x (..., K); gate_up.weight (2F, K) holds [gate; up]; down.weight
    (N, F). Traced into a compiled graph, collectives included, where neither projection has a wgrad queue.
    `observer` (eager calls only) sees the inner tensors as they are made."""
    compiling = torch.compiler.is_compiling()
    if compiling and (gate_up.queue is not None or down.queue is not None):
        return _eager_fp8_swiglu_mlp(x, gate_up, down, recipe, backend, norm, observer)
    entries = [current_weight(p.cache, p.weight, recipe, backend, compiling) for p in (gate_up, down)]
    norm_weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
    return _Fp8SwiGLUFn.apply(x, norm_weight, gate_up.weight, down.weight, *entries[0].tensors(),
                              *entries[1].tensors(), traced_main_grad(gate_up.cache, compiling),
                              traced_main_grad(down.cache, compiling), eps, recipe, backend_arg(backend, compiling),
                              compiling, (gate_up.comm, down.comm), (gate_up.queue, down.queue),
                              torch.is_grad_enabled(), observer)


@run_eagerly  # deferred weight gradients run eagerly inside compiled code
def _eager_fp8_swiglu_mlp(x, gate_up, down, recipe, backend, norm, observer=None):
    return fp8_swiglu_mlp(x, gate_up, down, recipe, backend, norm, observer)
