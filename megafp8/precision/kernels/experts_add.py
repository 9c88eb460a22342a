"""The BF16 experts' weight gradient added into FP32 `main_grad`, for the experts with rows only.

`torch._grouped_mm` has no accumulating form, so BF16 experts write their stacked weight gradient (E, N, K) and a
second pass adds it into `main_grad`. An expert without rows has a zero gradient, and adding it reads and writes 10
bytes a parameter for nothing (FP8's grouped wgrad skips those experts' tiles already). Here each program takes one
block of one expert and masks all of it where the expert has no rows (the offsets' difference), so its bytes are
never loaded. Where it adds, the sum is `main_grad + float(dw)` rounded once, as `main_grad.add_(dw)` gives: the
same bits (its pure-torch twin is that add; `megafp8.precision.grouped.add_experts_with_rows_into_`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements a program adds: 16 KiB of FP32 read and written, 8 KiB of BF16 read


@triton.jit
def _add_experts_with_rows_kernel(out_ptr, x_ptr, offs_ptr, per_expert, BLOCK: tl.constexpr):
    block, expert = tl.program_id(0), tl.program_id(1)
    end = tl.load(offs_ptr + expert)
    start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    cols = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < per_expert) & (end > start)
    at = expert.to(tl.int64) * per_expert + cols
    total = tl.load(out_ptr + at, mask=mask) + tl.load(x_ptr + at, mask=mask).to(tl.float32)
    tl.store(out_ptr + at, total, mask=mask)


def add_experts_with_rows_(out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> None:
    """out[e] += x[e] for every expert e with rows (offs: (E,) int32 cumulative row counts, as `_grouped_mm`
    takes them); the others' `out` is left as it was. out (E, N, K) FP32 and x of its shape, both contiguous."""
    experts = out.shape[0]
    if out.dtype != torch.float32 or x.shape != out.shape or offs.shape != (experts,):
        raise ValueError(f"add_experts_with_rows_ takes FP32 out (E, N, K), x of its shape and (E,) offsets; got "
                         f"{out.dtype} {tuple(out.shape)}, {tuple(x.shape)}, {tuple(offs.shape)}")
    if not (out.is_contiguous() and x.is_contiguous()):
        raise ValueError("add_experts_with_rows_ takes contiguous tensors")
    per_expert = out[0].numel() if experts else 0
    if per_expert == 0:
        return
    _add_experts_with_rows_kernel[(triton.cdiv(per_expert, BLOCK), experts)](out, x, offs, per_expert, BLOCK=BLOCK,
                                                                            num_warps=8)
