"""Triton kernel of `megafp8.parallel.routing` (imported only on CUDA: CPU-only installs never need Triton).

One program takes a block of tokens and all their experts' scores, and does the whole group-limited choice in
registers: each group's two best scores summed, the `topk_group` best groups kept, then the `top_k` best experts
among theirs, each "best" an exact maximum. A score becomes an integer whose order is the float's (nan above
+inf, as `torch.topk` ranks it) with its column in the low 32 bits, so one integer maximum gives the best score and
its column at once, the lower column winning a tie, and a chosen expert is struck out by setting its integer to
the minimum, below any score (so no expert is chosen twice, even among -inf). `torch.topk` would launch three
sorts and the masking between them as separate kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megafp8.precision.kernels.launch import FastLaunch

ELEMENTS_PER_PROGRAM = 2048  # scores a program holds (tokens x experts): 32 tokens of 64 experts, 8 of 256
WARPS = 4
_STRUCK = tl.constexpr(-(2 ** 63))  # a chosen expert's or group's integer: below every score's
# A dropped group's experts: below every score's integer (-inf's is -2**31 + 2**23 - 1 before the shift), above
# _STRUCK whatever the column, so a real -inf in a kept group still ranks above them and none is struck twice.
_DROPPED = tl.constexpr((-(2 ** 31) + 1) * 2 ** 32)


@triton.jit
def _ordered(x):
    """FP32 -> int64 with the float's order: the bits as they are for a positive sign, the magnitude bits
    flipped for a negative one (-0.0 just below +0.0); every nan as the largest."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, key).to(tl.int64)


@triton.jit
def _float_of(packed):
    """The FP32 score of a packed integer (`_ordered` undone; nan comes back as a nan)."""
    key = (packed >> 32).to(tl.int32)
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _group_limited_topk_kernel(s_ptr, out_ptr, N, stride_s, E: tl.constexpr, GROUPS: tl.constexpr,
                               KEEP_GROUPS: tl.constexpr, BEST: tl.constexpr, TOP_K: tl.constexpr,
                               BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_rows = rows < N
    cols = tl.arange(0, E)
    x = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_s + cols[None, :], mask=in_rows[:, None], other=0.0)
    low = (E - 1 - cols).to(tl.int64)[None, :]  # the lower column the larger: it wins a tie
    packed = (_ordered(x) << 32) | low
    if GROUPS > 1:
        PER_GROUP: tl.constexpr = E // GROUPS
        grouped = tl.reshape(packed, (BLOCK_T, GROUPS, PER_GROUP))
        first = tl.max(grouped, axis=2)
        group_score = _float_of(first)
        if BEST == 2:
            second = tl.max(tl.where(grouped == first[:, :, None], _STRUCK, grouped), axis=2)
            group_score = group_score + _float_of(second)
        group_ids = tl.arange(0, GROUPS)
        group_key = (_ordered(group_score) << 32) | (GROUPS - 1 - group_ids).to(tl.int64)[None, :]
        kept = tl.zeros((BLOCK_T, GROUPS), dtype=tl.int1)
        for _ in tl.static_range(KEEP_GROUPS):
            best_group = tl.max(group_key, axis=1)
            hit = group_key == best_group[:, None]
            kept = kept | hit
            group_key = tl.where(hit, _STRUCK, group_key)
        kept = tl.reshape(tl.broadcast_to(kept[:, :, None], (BLOCK_T, GROUPS, PER_GROUP)), (BLOCK_T, E))
        packed = tl.where(kept, packed, _DROPPED | low)  # the other groups' experts below every score
    out = out_ptr + rows.to(tl.int64) * TOP_K
    for k in tl.static_range(TOP_K):
        best = tl.max(packed, axis=1)
        tl.store(out + k, E - 1 - best.to(tl.int32).to(tl.int64), mask=in_rows)  # (the low 32 bits)
        packed = tl.where(packed == best[:, None], _STRUCK, packed)


_LAUNCH = FastLaunch(_group_limited_topk_kernel)  # Triton's JIT once per static signature, then the compiled kernel


def group_limited_topk(choice: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """`routing.group_limited_topk_reference` for CUDA scores (N, E) FP32 with unit column stride, E a power of
    two and E / n_group too (`routing.kernel_fits` checks): (N, top_k) int64, best first."""
    n, e = choice.shape
    out = torch.empty(n, top_k, dtype=torch.int64, device=choice.device)
    if n == 0:
        return out
    block_t = max(1, ELEMENTS_PER_PROGRAM // e)
    _LAUNCH.launch((triton.cdiv(n, block_t),), (choice, out, n, choice.stride(0)),
                   dict(E=e, GROUPS=n_group, KEEP_GROUPS=topk_group, BEST=min(2, e // n_group), TOP_K=top_k,
                        BLOCK_T=block_t, num_warps=WARPS))
    return out
