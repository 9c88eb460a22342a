"""Triton kernels for the FP8 path: tile quantization (plain, transposed, re-tiling) and a blockwise GEMM.

Imported lazily (only when a CUDA backend is selected), so CPU-only installs never need Triton.
Each kernel reproduces `megafp8.precision.quantize` bit for bit: correctly rounded divisions
(`div_rn`), the same power-of-two rounding on the scale's bits, and nan propagation that
`tl.max` alone would drop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megafp8.precision.formats import TILE, Fp8Format


@triton.jit
def _tile_scale(amax, has_nan, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    scale = tl.math.div_rn(amax, FP8_MAX)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        up = (bits & 0x7F800000) + tl.where((bits & 0x7FFFFF) != 0, 0x800000, 0)
        finite_pos = (scale > 0) & (scale < float("inf"))
        scale = tl.where(finite_pos, up.to(tl.float32, bitcast=True), scale)
    scale = tl.where(amax == 0, 1.0, scale)
    return tl.where(has_nan, float("nan"), scale)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, in_s_ptr,
    R, C,
    stride_xr, stride_xc, stride_qr, stride_qc, stride_sr, stride_sc, stride_in_r, stride_in_c,
    FP8_MAX: tl.constexpr, POW2: tl.constexpr, HAS_IN_SCALE: tl.constexpr,
    IN_R_GROUP: tl.constexpr, IN_C_GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Quantize logical X (R, C) in 1x128 tiles along C. X may be a strided (e.g. transposed) view, and may
    itself be FP8 with input scales (re-tiling): then X[r, c] = x[r, c] * in_s[r // IN_R_GROUP, c // IN_C_GROUP]."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if HAS_IN_SCALE:
        in_s = tl.load(in_s_ptr + (rows[:, None] // IN_R_GROUP) * stride_in_r + (cols[None, :] // IN_C_GROUP) * stride_in_c,
                       mask=mask, other=1.0)
        x = x * in_s
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = _tile_scale(amax, has_nan, FP8_MAX, POW2)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :] * stride_qc, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_sr + pid_c * stride_sc, scale, mask=rows < R)


@triton.jit
def _quantize_blocks_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_wk, stride_sn, stride_sk,
                            FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * 128 + tl.arange(0, 128)
    cols = pid_k * 128 + tl.arange(0, 128)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    has_nan = tl.max(tl.max((w != w).to(tl.int32), axis=1), axis=0) > 0
    scale = _tile_scale(amax, has_nan, FP8_MAX, POW2)
    q = tl.math.div_rn(w, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + pid_n * stride_sn + pid_k * stride_sk, scale)


def _empty_scales(rows: int, cols: int, device, rows_major: bool) -> torch.Tensor:
    """A (rows, cols) FP32 scale tensor; rows_major=True stores it column-major (stride (1, rows)), as cuBLAS wants."""
    if rows_major:
        return torch.empty(cols, rows, dtype=torch.float32, device=device).t()
    return torch.empty(rows, cols, dtype=torch.float32, device=device)


def quantize_rows(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool, in_scale: torch.Tensor | None = None,
                  in_groups: tuple[int, int] = (1, 1), scales_mn_major: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the logical (R, C) view `x` in 1x128 tiles along C; returns contiguous q (R, C) and scales (R, C/128)."""
    r, c = x.shape
    q = torch.empty(r, c, dtype=fmt.dtype, device=x.device)
    s = _empty_scales(r, c // TILE, x.device, scales_mn_major)
    block_r = 32
    grid = (triton.cdiv(r, block_r), c // TILE)
    in_s = in_scale if in_scale is not None else s
    _quantize_rows_kernel[grid](
        x, q, s, in_s, r, c,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1), in_s.stride(0), in_s.stride(1),
        FP8_MAX=fmt.max, POW2=power_of_two, HAS_IN_SCALE=in_scale is not None,
        IN_R_GROUP=in_groups[0], IN_C_GROUP=in_groups[1], BLOCK_R=block_r,
    )
    return q, s


def quantize_blocks(w: torch.Tensor, fmt: Fp8Format, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    q = torch.empty(n, k, dtype=fmt.dtype, device=w.device)
    s = torch.empty(n // TILE, k // TILE, dtype=torch.float32, device=w.device)
    _quantize_blocks_kernel[(n // TILE, k // TILE)](w, q, s, n, k, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
                                                    FP8_MAX=fmt.max, POW2=power_of_two)
    return q, s


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
    ],
    key=["M", "N", "K", "B_BLOCKWISE"],
)
@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
                 stride_am, stride_bn, stride_cm, stride_as_m, stride_as_k, stride_bs_n, stride_bs_k,
                 B_BLOCKWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """C (M, N) = A (M, K) @ B (N, K)^T with A in 1x128 tiles and B in 128x128 blocks or 1x128 tiles.
    Each 128-wide K step's FP32 partial product is scaled and added to an FP32 accumulator."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % (GROUP_M * num_n)) % size_m)
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn[:, None] * stride_bn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // 128):
        a = tl.load(a_ptrs, mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptrs, mask=rn[:, None] < N, other=0.0)
        a_s = tl.load(as_ptr + rm * stride_as_m + kb * stride_as_k, mask=rm < M, other=0.0)
        if B_BLOCKWISE:
            b_s = tl.load(bs_ptr + (rn // 128) * stride_bs_n + kb * stride_bs_k, mask=rn < N, other=0.0)
        else:
            b_s = tl.load(bs_ptr + rn * stride_bs_n + kb * stride_bs_k, mask=rn < N, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        a_ptrs += 128
        b_ptrs += 128
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], c, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, b_blockwise: bool,
         out_dtype: torch.dtype) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _gemm_kernel[grid](a, b, c, a_scale, b_scale, m, n, k, a.stride(0), b.stride(0), c.stride(0),
                       a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), B_BLOCKWISE=b_blockwise)
    return c
