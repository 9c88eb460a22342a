"""The high-precision (BF16, FP16 or FP32) linear, `y = x @ w^T`, with its weight gradient added into the weight's
FP32 `main_grad` by the GEMM itself.

Micro-batches accumulate weight gradients in FP32 (`megafp8.parallel.grad_buckets`). Left to autograd, a BF16
layer's backward writes dw in BF16 and a hook then adds it into `main_grad`: one more pass over every weight
gradient (9.1 ms of the 8B-layer BF16 step on one H200; `docs/benchmarks.md`), and dw rounded to BF16 before it
is summed. Here, where the weight has an FP32 `main_grad`, backward computes
`main_grad += dy^T @ x` as one cuBLAS GEMM with beta = 1 (`torch.addmm(..., out_dtype=torch.float32)`: BF16
operands, FP32 accumulation and FP32 C), as Megatron-LM's gradient-accumulation fusion and Transformer Engine do,
and returns no weight gradient. The FP8 layers do the same through cuBLASLt (`megafp8.precision.fp8_linear`).

On a CPU, or where torch's CUDA build lacks that mixed-precision `addmm` (said once, as a warning), the product is
computed and then added: the same bits as autograd's BF16 dw plus the hook's add. Either way the weight's `.grad`
stays None, so a hook registered on such a weight sees no gradient (use `main_grad`).

Under `torch.compile` a layer adds into a fresh alias of `main_grad` (`MainGradSlot`, refreshed eagerly before each
compiled block runs, as the FP8 weight cache does), through a custom op that mutates it; a weight-gradient queue
(zero-bubble pipeline schedules) defers the accumulation as it does for FP8 layers.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from megafp8.precision.eager import eager_custom_op, run_eagerly
from megafp8.precision.wgrad import WeightGradQueue, main_grad_alias, weight_grad_or_defer

_REDUCED = (torch.bfloat16, torch.float16)


@functools.cache
def _mixed_addmm_reason(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Why `torch.addmm(c_fp32, a, b, out_dtype=torch.float32, out=c_fp32)` with `dtype` operands cannot run on this
    device type (None: it can). Asked once per device type and dtype by an op on tiny tensors; torch checks the
    dtypes before it launches anything, so a refusal costs no device work and needs no sync. A refusal is remembered
    and said once (the run then adds rounded products); running out of memory is not a refusal and is raised."""
    if device_type != "cuda":
        return f"no mixed-precision addmm on {device_type}"
    a = torch.zeros(16, 16, dtype=dtype, device=device_type)
    c = torch.zeros(16, 16, dtype=torch.float32, device=device_type)
    try:
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
    except torch.OutOfMemoryError:  # not an answer: raised, and (as any exception) not cached
        raise
    except (RuntimeError, TypeError) as error:
        reason = f"torch {torch.__version__}: {error}".splitlines()[0]
        warnings.warn(f"{dtype} weight gradients are rounded to {dtype} and then added into FP32 main_grad, not "
                      f"added by the GEMM: {reason}")
        return reason
    return None


def fused_accumulation_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why a weight gradient of `dtype` operands cannot be added into an FP32 `main_grad` on `device` by the GEMM
    itself (None: it can). FP32 operands always can (`addmm_`)."""
    if dtype == torch.float32:
        return None if device.type == "cuda" else "on the CPU the product is added after (autograd's bits)"
    if dtype not in _REDUCED:
        return f"no fused accumulation for {dtype} operands"
    return _mixed_addmm_reason(device.type, dtype)


def accumulate_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (FP32) += a @ b: on CUDA one GEMM adding in its epilogue, FP32 accumulation throughout; elsewhere the
    product in a's dtype, then the add (what autograd's dw and a separate `main_grad.add_` give)."""
    if fused_accumulation_reason(out.device, a.dtype) is not None:
        out.add_(a @ b)
    elif a.dtype == torch.float32:
        out.addmm_(a, b)
    else:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)


@eager_custom_op("megafp8::wgrad_accumulate_", mutates_args=("out",))
def wgrad_accumulate_(out: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """out (N, K) FP32 += dy (M, N)^T @ x (M, K): a weight gradient added into `main_grad` inside a compiled graph
    (an op Inductor keeps whole: its decomposition of `addmm` with `out_dtype` would add in a separate pass)."""
    accumulate_product_(out, dy.t(), x)


@wgrad_accumulate_.register_fake
def _(out, dy, x) -> None:
    return None


class MainGradSlot:
    """What a compiled high-precision layer adds its weight gradient into: a fresh alias of the weight's FP32
    `main_grad`, made eagerly before each call of the compiled block (`refresh`), or None (no `main_grad`: the
    layer returns dw to autograd). A fresh alias per forward, for the reasons `megafp8.precision.wgrad.fresh_alias`
    gives."""

    def __init__(self) -> None:
        self.alias: Optional[torch.Tensor] = None

    @run_eagerly
    def refresh(self, weight: torch.Tensor) -> None:
        self.alias = main_grad_alias(weight)


class _LinearFn(torch.autograd.Function):
    """`x @ weight^T` whose weight gradient is added into an FP32 `main_grad` (or deferred to a queue)."""

    @staticmethod
    def forward(ctx, x, weight, main_grad, queue: Optional[WeightGradQueue], traced: bool):
        ctx.save_for_backward(x, weight, main_grad)
        ctx.queue, ctx.traced = queue, traced
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight, main_grad = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dy2d, x2d = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            if ctx.traced:
                wgrad_accumulate_(main_grad, dy2d, x2d)
            else:
                dw = weight_grad_or_defer(weight, lambda: dy2d.t() @ x2d, ctx.queue,
                                          lambda out: accumulate_product_(out, dy2d.t(), x2d))
        return dx, dw, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, wgrad_queue: Optional[WeightGradQueue] = None,
           main_grad_slot: Optional[MainGradSlot] = None) -> torch.Tensor:
    """`F.linear(x, weight)` whose weight gradient goes into the weight's FP32 `main_grad` (added by the GEMM) or
    to `wgrad_queue`. Traced by `torch.compile`, it adds into `main_grad_slot`'s alias where the slot was
    refreshed (else autograd gets dw); a queue's Python state cannot be traced, so such a layer runs eagerly."""
    if torch.compiler.is_compiling():
        if wgrad_queue is not None:
            return _eager_linear(x, weight, wgrad_queue)
        alias = main_grad_slot.alias if main_grad_slot is not None else None
        if alias is None or not torch.is_grad_enabled():
            return F.linear(x, weight)
        return _LinearFn.apply(x, weight, alias, None, True)
    if wgrad_queue is None and (getattr(weight, "main_grad", None) is None or not torch.is_grad_enabled()):
        return F.linear(x, weight)
    return _LinearFn.apply(x, weight, None, wgrad_queue, False)


@run_eagerly
def _eager_linear(x: torch.Tensor, weight: torch.Tensor, wgrad_queue: WeightGradQueue) -> torch.Tensor:
    return linear(x, weight, wgrad_queue)
