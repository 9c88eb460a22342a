"""Our blockwise-scaled FP8 GEMMs in Triton: dense (the `triton` backend's) and grouped by expert (MoE).

Each 128-wide K step's FP32 partial product is multiplied by its operands' scales and added to an FP32
accumulator; results differ from the reference backend only in summation order.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megafp8.precision.kernels.limits import check_offsets


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
    check_offsets("gemm", a, b, c)  # this kernel's row offsets are int32 (the grouped ones index in int64)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _gemm_kernel[grid](a, b, c, a_scale, b_scale, m, n, k, a.stride(0), b.stride(0), c.stride(0),
                       a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
                       B_BLOCKWISE=b_blockwise)
    return c


# ---------------------------------------------------------------------------------- grouped (MoE) GEMMs
# Rows are grouped by expert and each expert's rows are padded to a multiple of 128, so every 128-row tile
# belongs to one expert (`tile_expert`), and every 1x128 tile along the rows of a transposed operand too. Tiles
# past the last expert's (a layout sized by an upper bound, `megafp8.precision.grouped.expert_rows`) have expert -1.


@triton.jit
def _scaled_step(acc, a, b, a_s, bs_ptr, rn, N, pid_n, kb, stride_bs_n, stride_bs_k, BLOCK_N: tl.constexpr):
    """acc + (a @ b^T) times the rows' scales a_s and the weight blocks' scales (bs_ptr: this expert's, [n block,
    k block]). A 128-wide N tile lies in one weight block: one scale, multiplied into the rows' scales first, so
    each accumulator element takes one FMA."""
    if BLOCK_N == 128:
        b_s = tl.load(bs_ptr + pid_n * stride_bs_n + kb * stride_bs_k)
        return acc + tl.dot(a, b.T) * (a_s * b_s)[:, None]
    b_s = tl.load(bs_ptr + (rn // 128) * stride_bs_n + kb * stride_bs_k, mask=rn < N, other=0.0)
    return acc + tl.dot(a, b.T) * a_s[:, None] * b_s[None, :]


def _fprop_configs(pre_hook=None) -> list:
    """Tile shapes for the grouped fprop/dgrad: 64-row tiles (one warpgroup, several programs per SM hiding each
    other's waits on the tensor cores) and 128-row ones (two warpgroups)."""
    shapes = [(64, 128, 4), (64, 256, 4), (128, 128, 8), (128, 256, 8)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w, num_stages=st, pre_hook=pre_hook)
            for bm, bn, w in shapes for st in (3, 4, 5)]


@triton.autotune(configs=_fprop_configs(), key=["N", "K"])
@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, tile_expert_ptr, N, K,
                         stride_am, stride_be, stride_bn, stride_cm, stride_as_m, stride_as_k,
                         stride_bs_e, stride_bs_n, stride_bs_k,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """C (Mp, N) = A (Mp, K) @ B[e] (N, K)^T for each 128-row tile of expert e; A in 1x128 tiles, B in blocks.
    A tile of expert -1 (past the last expert's rows) gets zeros."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m * BLOCK_M // 128).to(tl.int64)
    k_steps = tl.where(e >= 0, K // 128, 0)
    e = tl.maximum(e, 0)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + e * stride_be + rn[:, None] * stride_bn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, k_steps):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs, mask=rn[:, None] < N, other=0.0)
        a_s = tl.load(as_ptr + rm * stride_as_m + kb * stride_as_k)
        acc = _scaled_step(acc, a, b, a_s, bs_ptr + e * stride_bs_e, rn, N, pid_n, kb, stride_bs_n, stride_bs_k,
                           BLOCK_N)
        a_ptrs += 128
        b_ptrs += 128
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=rn[None, :] < N)


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 256}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=4),
    ],
    key=["N", "K"],
    restore_value=["c_ptr"],  # with ACCUMULATE, the autotuner's trial runs must not add into C
)
@triton.jit
def _grouped_wgrad_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, tile_start_ptr, tile_count_ptr, N, K,
                          stride_an, stride_bk, stride_ce, stride_cn, stride_as_n, stride_as_m, stride_bs_k,
                          stride_bs_m, ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[e] (N, K) = A (N, rows of e) @ B (K, rows of e)^T: both operands in 1x128 tiles along the rows. With
    ACCUMULATE, C[e] += that instead (C in FP32: a weight's `main_grad`)."""
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    first = tl.load(tile_start_ptr + e)
    count = tl.load(tile_count_ptr + e)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rm = tl.arange(0, 128)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in range(0, count):
        mb = (first + i).to(tl.int64)
        a = tl.load(a_ptr + rn[:, None] * stride_an + (mb * 128 + rm)[None, :], mask=rn[:, None] < N, other=0.0)
        b = tl.load(b_ptr + rk[:, None] * stride_bk + (mb * 128 + rm)[None, :], mask=rk[:, None] < K, other=0.0)
        a_s = tl.load(as_ptr + rn * stride_as_n + mb * stride_as_m, mask=rn < N, other=0.0)
        b_s = tl.load(bs_ptr + rk * stride_bs_k + mb * stride_bs_m, mask=rk < K, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rn[:, None] * stride_cn + rk[None, :]
    c_mask = (rn[:, None] < N) & (rk[None, :] < K)
    if ACCUMULATE:
        acc = tl.load(c_ptrs, mask=c_mask, other=0.0) + acc
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# The same two grouped GEMMs for GPUs with the Tensor Memory Accelerator (Hopper and newer): operands loaded by TMA
# into shared memory (no address arithmetic in the loop, deeper pipelines), and persistent programs, one per SM,
# walking the output tiles grouped along M so that an expert's weight blocks stay in L2 while its row tiles pass.
def _fprop_blocks(nargs: dict) -> None:
    """Autotuner pre-hook: the descriptors' block shapes for this configuration."""
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], 128]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], 128]
    nargs["c_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"]]


@triton.autotune(configs=_fprop_configs(_fprop_blocks), key=["N", "K"])
@triton.jit
def _grouped_gemm_tma_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, tile_expert_ptr, M, N, K,
                             stride_as_m, stride_as_k, stride_bs_e, stride_bs_n, stride_bs_k,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """`_grouped_gemm_kernel` with TMA loads, persistent over the (M, N) tiles (as many programs as the grid has).
    B is read as (E * N, K): a block past its expert's N rows reads the next expert's, whose columns of C fall
    outside C and are not stored."""
    num_m = M // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
        first_m = (tile // in_group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % size_m
        pid_n = (tile % in_group) // size_m
        e = tl.load(tile_expert_ptr + pid_m * BLOCK_M // 128)
        k_steps = tl.where(e >= 0, K // 128, 0)  # a padding tile past the last expert's: zeros
        e = tl.maximum(e, 0)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, k_steps):
            a = a_desc.load([pid_m * BLOCK_M, kb * 128])
            b = b_desc.load([e * N + pid_n * BLOCK_N, kb * 128])
            a_s = tl.load(as_ptr + (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) * stride_as_m + kb * stride_as_k)
            acc = _scaled_step(acc, a, b, a_s, bs_ptr + e * stride_bs_e, rn, N, pid_n, kb, stride_bs_n,
                               stride_bs_k, BLOCK_N)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def _wgrad_blocks(nargs: dict) -> None:
    nargs["a_desc"].block_shape = [nargs["BLOCK_N"], 128]
    nargs["b_desc"].block_shape = [nargs["BLOCK_K"], 128]


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": 128, "BLOCK_K": bk}, num_warps=8, num_stages=st, pre_hook=_wgrad_blocks)
             for bk in (128, 256) for st in (3, 4, 5)],
    key=["N", "K"],
    restore_value=["c_ptr"],
)
@triton.jit
def _grouped_wgrad_tma_kernel(a_desc, b_desc, c_ptr, as_ptr, bs_ptr, tile_start_ptr, tile_count_ptr, num_experts,
                              N, K, stride_ce, stride_cn, stride_as_n, stride_as_m, stride_bs_k, stride_bs_m,
                              ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_grouped_wgrad_kernel` with TMA loads, persistent over the (expert, N, K) output tiles (as many programs as
    the grid has)."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_expert = num_n * num_k
    for tile in range(tl.program_id(0), num_experts * per_expert, tl.num_programs(0)):
        e = tile // per_expert
        pid_n = (tile % per_expert) // num_k
        pid_k = tile % num_k
        first = tl.load(tile_start_ptr + e)
        count = tl.load(tile_count_ptr + e)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for i in range(0, count):
            mb = first + i
            a = a_desc.load([pid_n * BLOCK_N, mb * 128])
            b = b_desc.load([pid_k * BLOCK_K, mb * 128])
            a_s = tl.load(as_ptr + rn * stride_as_n + mb * stride_as_m, mask=rn < N, other=0.0)
            b_s = tl.load(bs_ptr + rk * stride_bs_k + mb * stride_bs_m, mask=rk < K, other=0.0)
            acc += tl.dot(a, b.T) * a_s[:, None] * b_s[None, :]
        c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rn[:, None].to(tl.int64) * stride_cn + rk[None, :]
        c_mask = (rn[:, None] < N) & (rk[None, :] < K)
        if ACCUMULATE:
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0) + acc
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def uses_tma(device: torch.device) -> bool:
    """Whether the grouped GEMMs take their TMA kernels on `device` (compute capability 9.0 or newer)."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


KERNELS = ("pointer", "tma", "ws")


def warp_specialized_unavailable(device: torch.device) -> Optional[str]:
    """Why the warp-specialized Gluon kernels (`megafp8.precision.kernels.ws_gemm`) cannot run on `device`, or
    None: they use Hopper's wgmma (compute capability 9.0 exactly) and Triton's Gluon language."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "the warp-specialized GEMMs need an SM90 (Hopper) GPU"
    try:
        from megafp8.precision.kernels import ws_gemm  # noqa: F401
    except ImportError as exc:
        return f"the warp-specialized GEMMs need Triton's Gluon language ({exc})"
    return None


def default_kernel(device: torch.device) -> str:
    """The grouped kernel `device` runs when a backend names none: TMA from SM90, else pointers. The `hopper` backend,
    what `auto` picks on SM90 with Gluon, names the warp-specialized kernel (`kernel="ws"`), faster than the TMA one
    on 10 of issue 19's 12 grouped GEMMs and 3.2-3.4% on the MoE step under CUDA graphs (`docs/benchmarks.md`)."""
    return "tma" if uses_tma(device) else "pointer"


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: choose one of {', '.join(KERNELS)}")


def _check_tma_store(kernel: str, tma_store: Optional[bool]) -> None:
    if tma_store is not None and kernel != "ws":
        raise ValueError(f"tma_store={tma_store} chooses the warp-specialized kernel's epilogue; this GEMM runs the "
                         f"{kernel!r} kernel")


def _descriptor(t: torch.Tensor):
    """A TMA descriptor over the 2-D tensor t; the autotuner's pre-hook sets its block shape."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1] * t.dim())


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 tile_expert: torch.Tensor, out_dtype: torch.dtype, kernel: Optional[str] = None,
                 block_n: int = 256, tma_store: Optional[bool] = None,
                 interleave_ffma: bool = False) -> torch.Tensor:
    """a (Mp, K) FP8 rows, a_scale (Mp, K/128); b (E, N, K) FP8 blocks, b_scale (E, N/128, K/128) -> (Mp, N).
    `kernel`: "ws" (warp-specialized, Hopper), "tma" or "pointer" (default: `default_kernel`); `block_n` the
    warp-specialized kernel's tile width (128 or 256), `tma_store` its epilogue, `interleave_ffma` its FFMA runs
    interleaved in the cubin (`ws_gemm.ws_gemm`)."""
    mp, k = a.shape
    n = b.shape[1]
    assert mp % 128 == 0 and k % 128 == 0 and a.stride(1) == 1 and b.stride(2) == 1
    kernel = kernel or default_kernel(a.device)
    _check_kernel(kernel)
    if kernel != "pointer" and n % 8:  # TMA needs 16-byte aligned rows of C
        kernel = "pointer"
    _check_tma_store(kernel, tma_store)
    c = torch.empty(mp, n, dtype=out_dtype, device=a.device)
    if kernel == "ws":
        from megafp8.precision.kernels.ws_gemm import ws_gemm
        return ws_gemm(a, a_scale, b.reshape(-1, k), b_scale, c, b_blockwise=True, tile_expert=tile_expert,
                       block_n=block_n, tma_store=tma_store, interleave_ffma=interleave_ffma)
    if kernel == "tma":
        sms = _sm_count(a.device)

        def persistent_grid(meta):
            return (min(sms, mp // meta["BLOCK_M"] * triton.cdiv(n, meta["BLOCK_N"])),)

        _grouped_gemm_tma_kernel[persistent_grid](
            _descriptor(a), _descriptor(b.reshape(-1, k)), _descriptor(c), a_scale, b_scale, tile_expert,
            mp, n, k, a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
            b_scale.stride(2))
        return c
    _grouped_gemm_kernel[lambda meta: (mp // meta["BLOCK_M"], triton.cdiv(n, meta["BLOCK_N"]))](
        a, b, c, a_scale, b_scale, tile_expert, n, k, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2))
    return c


def grouped_wgrad(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  tile_start: torch.Tensor, tile_count: torch.Tensor, out_dtype: torch.dtype,
                  kernel: Optional[str] = None, accumulate: Optional[torch.Tensor] = None,
                  block_n: int = 256, tma_store: Optional[bool] = None, b_blocks: bool = False) -> torch.Tensor:
    """a (N, Mp), b (K, Mp) FP8 in 1x128 tiles along Mp, scales (N, Mp/128), (K, Mp/128) -> (E, N, K).
    `accumulate` (E, N, K) FP32: add the product into it in the GEMM's epilogue (no rounding to `out_dtype`, no
    separate pass) and return it. `kernel`, `block_n` and `tma_store` as in `grouped_gemm` (the 1x128 x 1x128
    promotion has no long FFMA runs to interleave: `ws_gemm(interleave_ffma=True)` would leave its cubin as it is).
    `b_blocks`: b in 128x128 blocks, scales (K/128, Mp/128) (`Fp8Recipe.wgrad_input_blocks`; the warp-specialized
    kernel only, 256-wide tiles, promoted as fprop is, its FFMAs interleaved)."""
    n, mp = a.shape
    k = b.shape[0]
    num_experts = tile_start.shape[0]
    assert a.stride(1) == 1 and b.stride(1) == 1
    if accumulate is not None:
        assert accumulate.shape == (num_experts, n, k) and accumulate.dtype == torch.float32 \
            and accumulate.stride(2) == 1, "grouped_wgrad accumulates into an (E, N, K) FP32 tensor, rows contiguous"
    kernel = kernel or default_kernel(a.device)
    _check_kernel(kernel)
    _check_tma_store(kernel, tma_store)
    c = torch.empty(num_experts, n, k, dtype=out_dtype, device=a.device) if accumulate is None else accumulate
    if b_blocks and kernel != "ws":
        raise ValueError(f"b in 128x128 blocks needs the warp-specialized kernel, not {kernel!r}")
    if kernel == "ws":
        from megafp8.precision.kernels.ws_gemm import ws_gemm
        return ws_gemm(a, a_scale, b, b_scale, c, accumulate=accumulate is not None, k_start=tile_start,
                       k_count=tile_count, tma_store=tma_store, **_wgrad_promotion(b_blocks, block_n))
    if kernel == "tma":
        sms = _sm_count(a.device)

        def persistent_grid(meta):
            return (min(sms, num_experts * triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"])),)

        _grouped_wgrad_tma_kernel[persistent_grid](
            _descriptor(a), _descriptor(b), c, a_scale, b_scale, tile_start, tile_count, num_experts, n, k,
            c.stride(0), c.stride(1), a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
            ACCUMULATE=accumulate is not None)
        return c

    def grid(meta):
        return (num_experts, triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"]))

    _grouped_wgrad_kernel[grid](
        a, b, c, a_scale, b_scale, tile_start, tile_count, n, k, a.stride(0), b.stride(0), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), ACCUMULATE=accumulate is not None)
    return c


def wgrad(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
          accumulate: Optional[torch.Tensor] = None, block_n: int = 256,
          tma_store: Optional[bool] = None, b_blocks: bool = False) -> torch.Tensor:
    """A dense layer's weight gradient by the warp-specialized kernel: a (N, M) = dy^T, b (K, M) = x^T, FP8 in
    1x128 tiles along the tokens M, scales (N, M/128), (K, M/128) -> (N, K); with `accumulate` ((N, K) FP32, a
    weight's `main_grad`) added into it in the epilogue and returned. With x^T in 1x128 tiles the backends leave
    it to cuBLASLt (adding into main_grad is faster there on most of our linears, `docs/performance.md`; kept as the
    alternative `benchmarks/dense_gemm.py` measures). With `b_blocks` (x^T in 128x128 blocks, scales (K/128, M/128):
    `Fp8Recipe.wgrad_input_blocks`) the hopper backend runs it: promoted as fprop is, 1.19-1.46x cuBLASLt's 1x128 x
    1x128 wgrad (`docs/benchmarks.md`, thirty-fifth session)."""
    from megafp8.precision.kernels.ws_gemm import ws_gemm
    n, k = a.shape[0], b.shape[0]
    c = accumulate if accumulate is not None else torch.empty(n, k, dtype=out_dtype, device=a.device)
    return ws_gemm(a, a_scale, b, b_scale, c, accumulate=accumulate is not None, tma_store=tma_store,
                   **_wgrad_promotion(b_blocks, block_n))


def _wgrad_promotion(b_blocks: bool, block_n: int) -> dict:
    """`ws_gemm`'s promotion arguments for a wgrad: x^T in 1x128 tiles (the scale vectors' outer product, `block_n`
    as asked) or in 128x128 blocks (promoted as fprop is: 256-wide tiles, the interleaved-FFMA cubin)."""
    if b_blocks:
        return dict(b_blockwise=True, block_n=256, interleave_ffma=True)
    return dict(b_blockwise=False, block_n=block_n)
