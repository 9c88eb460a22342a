"""Triton kernel of `megafp8.parallel.router_gemm` (imported only on CUDA: CPU-only installs never need Triton).

One FP32 GEMM, C = A @ B, with the products and sums in IEEE FP32 on the CUDA cores (`tl.dot(...,
input_precision="ieee")`: FMAs, no TF32), A and B of any strides (the router's transposes are views), A read in its
own dtype and widened in registers (the router's BF16 input is never copied to FP32), C rounded once to its dtype.
With a split over K, each split writes its partial C and one reduction sums them (no atomics), so a shape always
gives the same bits. Why not cuBLAS: its FP32 kernels for these shapes (one dimension the experts, 64) ran at 4-6
TFLOP/s on an H100, 2.45 ms of a 3.2B MoE step (`docs/benchmarks.md`, job IH).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megafp8.precision.kernels.launch import FastLaunch

BLOCK_M, BLOCK_N, BLOCK_K, WARPS = 64, 64, 32, 4
SPLIT_BELOW_TILES = 256  # fewer output tiles than this: split K over more programs
SPLIT_TARGET_PROGRAMS = 512
SPLIT_MIN_K = 1024  # K a split takes at least


@triton.jit
def _fp32_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cs, stride_cm,
                      stride_cn, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """C[split] (BLOCK_M x BLOCK_N tile) = A[:, ks] @ B[ks, :] over this split's K range, in FP32 FMAs. The split's
    length is a constant (a loop bound Triton's CPU interpreter takes under NumPy 2.4; one compile per length)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    rows = rm[:, None].to(tl.int64)
    cols = rn[None, :].to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # the last split's blocks past K load zeros
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows * stride_am + rk[None, :].to(tl.int64) * stride_ak,
                    mask=(rm[:, None] < M) & (rk[None, :] < k_hi), other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rk[:, None].to(tl.int64) * stride_bk + cols * stride_bn,
                    mask=(rk[:, None] < k_hi) & (rn[None, :] < N), other=0.0).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(c_ptr + split * stride_cs + rows * stride_cm + cols * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_GEMM = FastLaunch(_fp32_gemm_kernel)  # Triton's JIT once per static signature, then the compiled kernel


def splits(m: int, n: int, k: int) -> int:
    """How many parts K is split into for an (m, n) output: one where the tiles alone fill the GPU, else enough for
    ~`SPLIT_TARGET_PROGRAMS` programs, each taking at least `SPLIT_MIN_K` of K. A function of the shape only (not of
    the device), so a shape's sums are always added in the same order."""
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    if tiles >= SPLIT_BELOW_TILES:
        return 1
    return max(1, min(triton.cdiv(k, SPLIT_MIN_K), triton.cdiv(SPLIT_TARGET_PROGRAMS, tiles)))


def fp32_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b (K, N) in FP32 (a and b of 32 bits or fewer, any strides) -> (M, N) in `out_dtype`; split over
    K as `splits` says, the partial sums then added by one reduction."""
    m, k = a.shape
    n = b.shape[1]
    if k == 0 or m == 0 or n == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.device)
    parts = splits(m, n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, parts), BLOCK_K) * BLOCK_K
    parts = max(1, triton.cdiv(k, k_per_split))
    c = torch.empty(parts, m, n, dtype=torch.float32 if parts > 1 else out_dtype, device=a.device)
    _GEMM.launch((triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), parts),
                 (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                  c.stride(2)),
                 dict(K_PER_SPLIT=k_per_split, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WARPS))
    if parts == 1:
        return c[0]
    return c.sum(0).to(out_dtype)  # torch's reduction: one launch, the same order for a shape every time
