"""Triton kernels of `megafp8.parallel.cross_entropy` (imported only on CUDA: CPU-only installs never need Triton).

`row_stats` reads each row of logits once: an online max and sum of exponentials over chunks of the row (the sum
rescaled whenever the max grows), and the target's logit by one load. `logits_grad` reads each logit once more and
writes (exp(x - lse) - one_hot) * dloss in the logits' dtype. Both compute in FP32, as their pure-torch twins in
`cross_entropy` do; sums run in the kernels' own order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megafp8.precision.kernels.launch import FastLaunch

STATS_BLOCK, STATS_WARPS = 4096, 8  # columns per chunk of the row pass (one program per row), its warps
GRAD_BLOCK, GRAD_WARPS = 4096, 8  # columns per program of the gradient pass, its warps


@triton.jit
def _row_stats_kernel(x_ptr, t_ptr, max_ptr, sum_ptr, picked_ptr, V, stride_x, BLOCK: tl.constexpr,
                      CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    row_max = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    for chunk in range(CHUNKS):  # a constexpr count (Triton's interpreter cannot loop to a runtime bound)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, 0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: terms of exp(-inf) = 0
        total = total * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), 0)
        row_max = new_max
    target = tl.load(t_ptr + row)
    inside = (target >= 0) & (target < V)
    picked = tl.load(base + target, mask=inside, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, row_max)
    tl.store(sum_ptr + row, total)
    tl.store(picked_ptr + row, picked)


@triton.jit
def _logits_grad_kernel(x_ptr, lse_ptr, t_ptr, d_ptr, g_ptr, V, stride_x, stride_g, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=0.0).to(tl.float32)
    p = tl.exp(x - tl.load(lse_ptr + row))
    p = tl.where(cols == tl.load(t_ptr + row), p - 1.0, p)
    tl.store(g_ptr + row * stride_g + cols, (p * tl.load(d_ptr + row)).to(g_ptr.dtype.element_ty), mask=in_row)


# Triton's JIT once per static signature, then the compiled kernel (`launch.FastLaunch`): the head launches both
# every micro-batch, eagerly.
_ROW_STATS = FastLaunch(_row_stats_kernel)
_LOGITS_GRAD = FastLaunch(_logits_grad_kernel)


def row_stats(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cross_entropy.row_stats_reference` for CUDA logits (N, V) with unit column stride."""
    assert logits.stride(-1) == 1 and target.is_contiguous(), "row_stats: row-major logits, contiguous targets"
    n, v = logits.shape
    row_max, sum_exp, picked = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    if n:
        _ROW_STATS.launch((n,), (logits, target, row_max, sum_exp, picked, v, logits.stride(0)),
                          dict(BLOCK=STATS_BLOCK, CHUNKS=triton.cdiv(v, STATS_BLOCK), num_warps=STATS_WARPS))
    return row_max, sum_exp, picked


def logits_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    """`cross_entropy.logits_grad_reference` for CUDA logits (N, V) with unit column stride."""
    assert logits.stride(-1) == 1, "logits_grad: row-major logits"
    lse, target, dloss = lse.contiguous(), target.contiguous(), dloss.contiguous()
    n, v = logits.shape
    grad = torch.empty(n, v, dtype=logits.dtype, device=logits.device)
    if n and v:
        _LOGITS_GRAD.launch((n, triton.cdiv(v, GRAD_BLOCK)),
                            (logits, lse, target, dloss, grad, v, logits.stride(0), grad.stride(0)),
                            dict(BLOCK=GRAD_BLOCK, num_warps=GRAD_WARPS))
    return grad
