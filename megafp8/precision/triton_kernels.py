"""Triton kernels for the FP8 path: tile quantization (plain, transposed, re-tiling) and a blockwise GEMM.

Imported lazily (only when a CUDA backend is selected), so CPU-only installs never need Triton.
Each kernel reproduces `megafp8.precision.quantize` bit for bit: correctly rounded per-tile
divisions (`div_rn`), the same power-of-two rounding on the scale's bits, round-to-nearest-even
onto the FP8 grid (by default done explicitly in FP32, so the final cast is exact; see
EXPLICIT_ROUND_DEFAULT), and nan propagation that `tl.max` alone would drop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megafp8.precision.formats import MIN_AMAX, TILE, Fp8Format


MIN_AMAX_CONST = tl.constexpr(MIN_AMAX)


@triton.jit
def _tile_scale(amax, has_nan, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """(dequantization scale, quantization multiplier) per tile, as `quantize.scales_from_amax`."""
    zero = amax == 0
    amax = tl.where(has_nan, float("nan"), tl.where(zero, amax, tl.maximum(amax, MIN_AMAX_CONST)))
    scale = tl.math.div_rn(amax, FP8_MAX)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        up = (bits & 0x7F800000) + tl.where((bits & 0x7FFFFF) != 0, 0x800000, 0)
        finite_pos = (scale > 0) & (scale < float("inf"))
        scale = tl.where(finite_pos, up.to(tl.float32, bitcast=True), scale)
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    else:
        inv = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    return tl.where(zero, 1.0, scale), tl.where(zero, 1.0, inv)


@triton.jit
def _round_to_grid(v, MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """Round FP32 v (already within the format's range) to the nearest FP8 value, ties to even, in FP32.

    The result is exactly representable, so the final cast cannot round again: the bits do not depend
    on how this Triton version lowers the FP32 -> FP8 conversion."""
    drop: tl.constexpr = 23 - MANT_BITS
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> drop) & 1
    normal = ((bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)).to(tl.float32, bitcast=True)
    subnormal = tl.extra.cuda.libdevice.rint(v / SUBNORMAL_STEP) * SUBNORMAL_STEP  # exact: the step is 2^-k
    out = tl.where(tl.abs(v) < MIN_NORMAL, subnormal, normal)
    return tl.where(v != v, v, out)


# The FP32 -> FP8 rounding (every quantizer takes `explicit_round`). Explicit: round onto the FP8 grid in FP32 first,
# so the cast that follows is exact and the bits do not depend on how Triton lowers it. Otherwise the cast itself
# rounds (round-to-nearest-even, asked for explicitly; it compiles to cvt.rn.satfinite.e4m3x2.f32 on SM90, the same
# instruction the explicit path ends with): less arithmetic, which matters because the fused row+column quantizer is
# arithmetic-bound (~1 TB/s on the H200). The cast-only path has not yet run on a GPU, so explicit rounding stays
# the default until `tests/test_fp8_gpu.py` (every tie and subnormal tie included) passes both ways.
EXPLICIT_ROUND_DEFAULT = True


@triton.jit
def _to_fp8_values(x, inv, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                   SUBNORMAL_STEP: tl.constexpr, EXPLICIT_ROUND: tl.constexpr, out_dtype: tl.constexpr):
    """clamp(x * inv, -FP8_MAX, FP8_MAX) rounded to FP8 (`out_dtype`), ties to even; nan stays nan."""
    q = x * inv
    q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if EXPLICIT_ROUND:
        q = _round_to_grid(q, MANT_BITS, MIN_NORMAL, SUBNORMAL_STEP)
    return q.to(out_dtype, fp_downcast_rounding="rtne")


# Tile counts per program are tuned once per (K, format) on first use (the profile of a ~1B model's step put these
# quantizers at ~11% of its GPU time); every configuration computes the same bits.
@triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm}, num_warps=w) for bm in (8, 16, 32) for w in (4, 8)],
    key=["K", "FP8_MAX", "POW2", "EXPLICIT_ROUND"],
)
@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
    FP8_MAX: tl.constexpr, POW2: tl.constexpr, BLOCK_M: tl.constexpr,
    MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
):
    """x (M, K) row-major -> q (M, K) in 1x128 tiles along K, scales (M, K/128)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(1)
    cols = pid_k * 128 + tl.arange(0, 128)
    mask = rows[:, None] < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale, inv = _tile_scale(amax, tl.max((x != x).to(tl.int32), axis=1) > 0, FP8_MAX, POW2)
    q = _to_fp8_values(x, inv[:, None], FP8_MAX, MANT_BITS, MIN_NORMAL, SUBNORMAL_STEP, EXPLICIT_ROUND,
                       q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + pid_k * stride_sk, scale, mask=rows < M)


@triton.autotune(
    configs=[triton.Config({"BLOCK_K": bk}, num_warps=w) for bk in (32, 64, 128) for w in (4, 8)],
    key=["K", "FP8_MAX", "POW2", "HAS_IN_SCALE", "EXPLICIT_ROUND"],
)
@triton.jit
def _quantize_cols_kernel(
    x_ptr, in_s_ptr, qt_ptr, st_ptr, M, K, stride_xm, stride_in_m, stride_in_k, stride_qt, stride_st_k, stride_st_m,
    FP8_MAX: tl.constexpr, POW2: tl.constexpr, HAS_IN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
    MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
):
    """x (M, K) row-major -> x^T (K, M) in 1x128 tiles along M, scales (K, M/128). Reads x coalesced along K.
    With HAS_IN_SCALE, x is FP8 in 1x128 tiles along K with scales in_s (M, K/128): re-tiling for wgrad."""
    pid_m = tl.program_id(0)
    rows = pid_m * 128 + tl.arange(0, 128)  # M: every tile is whole (M is padded to 128 by the caller)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = cols[None, :] < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_IN_SCALE:
        in_s = tl.load(in_s_ptr + rows[:, None] * stride_in_m + (cols[None, :] // 128) * stride_in_k, mask=mask, other=1.0)
        x = x * in_s
    amax = tl.max(tl.abs(x), axis=0)
    scale, inv = _tile_scale(amax, tl.max((x != x).to(tl.int32), axis=0) > 0, FP8_MAX, POW2)
    q = _to_fp8_values(x, inv[None, :], FP8_MAX, MANT_BITS, MIN_NORMAL, SUBNORMAL_STEP, EXPLICIT_ROUND,
                       qt_ptr.dtype.element_ty)
    # Store the transposed tile row-major (contiguous along M) so the writes coalesce.
    tl.store(qt_ptr + cols[:, None] * stride_qt + rows[None, :], tl.trans(q),
             mask=cols[:, None] < K)
    tl.store(st_ptr + cols * stride_st_k + pid_m * stride_st_m, scale, mask=cols < K)


# The output gradient's two quantizations were 15% of a compiled ~1B FP8 step's GPU time (25 ms of 174, at ~0.9 TB/s)
# when one program held a whole 128x128 tile and both of its quantized copies in registers. Each program now walks
# its tile in CHUNK-row slices twice (the second pass re-reads from L2); every configuration gives the same bits.
# Measured on the H200 (benchmarks/fused_quantize.py): ~1.0 TB/s at best (CHUNK=128, 4 warps), 8 warps slower at
# every chunk, so the kernel is arithmetic-bound, not memory-bound; the step's share fell only from 25.3 to 23.5 ms.
BOTH_CONFIGS = [triton.Config({"CHUNK": c}, num_warps=w) for c in (32, 64, 128) for w in (2, 4, 8)]


@triton.autotune(configs=BOTH_CONFIGS, key=["K", "FP8_MAX", "POW2", "EXPLICIT_ROUND"])
@triton.jit
def _quantize_both_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk, stride_qt, stride_st_k,
    stride_st_m, FP8_MAX: tl.constexpr, POW2: tl.constexpr, CHUNK: tl.constexpr,
    MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
):
    """One read of x (M, K) row-major (plus an L2 re-read) gives both quantizations the backward pass needs:
    q (M, K) in 1x128 tiles along K with scales (M, K/128), and x^T (K, M_pad) in 1x128 tiles along M with scales
    (K, M_pad/128), M padded to a multiple of 128 with zero rows. One 128x128 tile per program."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_k * 128 + tl.arange(0, 128)
    col_amax = tl.zeros((128,), dtype=tl.float32)
    col_nan = tl.zeros((128,), dtype=tl.int32)
    # Pass 1: the row tiles (quantized and stored), and each column's max-abs over the tile's 128 rows.
    for r0 in range(0, 128, CHUNK):
        rows = pid_m * 128 + r0 + tl.arange(0, CHUNK)
        in_rows = rows < M
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=in_rows[:, None], other=0.0)
        x = x.to(tl.float32)
        nan = (x != x).to(tl.int32)
        ax = tl.abs(x)
        scale, inv = _tile_scale(tl.max(ax, axis=1), tl.max(nan, axis=1) > 0, FP8_MAX, POW2)
        q = _to_fp8_values(x, inv[:, None], FP8_MAX, MANT_BITS, MIN_NORMAL, SUBNORMAL_STEP, EXPLICIT_ROUND,
                           q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=in_rows[:, None])
        tl.store(s_ptr + rows * stride_sm + pid_k * stride_sk, scale, mask=in_rows)
        col_amax = tl.maximum(col_amax, tl.max(ax, axis=0))  # a nan's amax is overridden by col_nan below
        col_nan = tl.maximum(col_nan, tl.max(nan, axis=0))
    scale_t, inv_t = _tile_scale(col_amax, col_nan > 0, FP8_MAX, POW2)
    # Pass 2: the column tiles, stored transposed (contiguous along M, so the writes coalesce).
    for r0 in range(0, 128, CHUNK):
        rows = pid_m * 128 + r0 + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None], other=0.0)
        qt = _to_fp8_values(x.to(tl.float32), inv_t[None, :], FP8_MAX, MANT_BITS, MIN_NORMAL, SUBNORMAL_STEP,
                            EXPLICIT_ROUND, qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + cols[:, None] * stride_qt + rows[None, :], tl.trans(qt))
    tl.store(st_ptr + cols * stride_st_k + pid_m * stride_st_m, scale_t)


@triton.jit
def _quantize_blocks_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn,
                            FP8_MAX: tl.constexpr, POW2: tl.constexpr, CHUNK: tl.constexpr,
                            MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr,
                            EXPLICIT_ROUND: tl.constexpr):
    """w (N, K) -> q (N, K) in 128x128 blocks, scales (N/128, K/128). The block is walked in CHUNK-row
    slices (a max-abs pass, then a quantize pass that re-reads from L2) to keep registers low."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_k * 128 + tl.arange(0, 128)
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    nan_count = tl.zeros((CHUNK,), dtype=tl.int32)
    for r0 in range(0, 128, CHUNK):
        rows = pid_n * 128 + r0 + tl.arange(0, CHUNK)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :]).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1))
        nan_count += tl.sum((w != w).to(tl.int32), axis=1)
    scale, inv = _tile_scale(tl.max(amax, axis=0), tl.sum(nan_count, axis=0) > 0, FP8_MAX, POW2)
    for r0 in range(0, 128, CHUNK):
        rows = pid_n * 128 + r0 + tl.arange(0, CHUNK)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :]).to(tl.float32)
        q = _to_fp8_values(w, inv, FP8_MAX, MANT_BITS, MIN_NORMAL, SUBNORMAL_STEP, EXPLICIT_ROUND,
                           q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q)
    tl.store(s_ptr + pid_n * (K // 128) + pid_k, scale)


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, R, C, BLOCK: tl.constexpr):
    """y (C, R) = x (R, C)^T for 1-byte elements; R and C are multiples of BLOCK."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r[:, None] * C + c[None, :])
    tl.store(y_ptr + c[:, None] * R + r[None, :], tl.trans(x))


def _grid_constants(fmt: Fp8Format, explicit_round: bool) -> dict:
    """Mantissa bits, smallest normal and subnormal spacing of the format (E4M3: 3, 2^-6, 2^-9), and the rounding."""
    finfo = torch.finfo(fmt.dtype)
    mant_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fmt.dtype]
    return dict(FP8_MAX=fmt.max, MANT_BITS=mant_bits, MIN_NORMAL=float(finfo.smallest_normal),
                SUBNORMAL_STEP=float(finfo.smallest_normal) * 2.0**-mant_bits, EXPLICIT_ROUND=explicit_round)


def _mn_major_scales(rows: int, cols: int, device) -> torch.Tensor:
    """An empty (rows, cols) FP32 scale tensor stored column-major (stride (1, rows)): the layout cuBLAS reads."""
    return torch.empty(cols, rows, dtype=torch.float32, device=device).t()


def quantize_rows(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool,
                  explicit_round: bool = EXPLICIT_ROUND_DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K), scales (M, K/128) along K."""
    assert x.stride(1) == 1, "quantize_rows needs a row-major input"
    m, k = x.shape
    q = torch.empty(m, k, dtype=fmt.dtype, device=x.device)
    s = _mn_major_scales(m, k // TILE, x.device)
    _quantize_rows_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), k // TILE)](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        POW2=power_of_two, **_grid_constants(fmt, explicit_round),
    )
    return q, s


def quantize_cols(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool, in_scale: torch.Tensor | None = None,
                  explicit_round: bool = EXPLICIT_ROUND_DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) (or FP8 x with 1x128 scales `in_scale`) -> x^T (K, M) in 1x128 tiles along M, scales (K, M/128)."""
    assert x.stride(1) == 1, "quantize_cols needs a row-major input"
    m, k = x.shape
    assert m % TILE == 0, "the token dim must be padded to a multiple of 128 for column tiles"
    qt = torch.empty(k, m, dtype=fmt.dtype, device=x.device)
    st = _mn_major_scales(k, m // TILE, x.device)
    in_s = in_scale if in_scale is not None else st
    _quantize_cols_kernel[lambda meta: (m // TILE, triton.cdiv(k, meta["BLOCK_K"]))](
        x, in_s, qt, st, m, k, x.stride(0), in_s.stride(0), in_s.stride(1), qt.stride(0), st.stride(0), st.stride(1),
        POW2=power_of_two, HAS_IN_SCALE=in_scale is not None, **_grid_constants(fmt, explicit_round),
    )
    return qt, st


def quantize_both(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool, config: triton.Config | None = None,
                  explicit_round: bool = EXPLICIT_ROUND_DEFAULT) -> tuple[torch.Tensor, ...]:
    """x (M, K) -> (q (M, K), scales (M, K/128), x^T (K, M_pad), scales (K, M_pad/128)) in one pass over x:
    `quantize_rows(x)` and `quantize_cols(x zero-padded to M_pad rows)`, bit for bit. `config` (one of
    BOTH_CONFIGS) bypasses the autotuner (tests check every configuration's bits)."""
    assert x.stride(1) == 1, "quantize_both needs a row-major input"
    m, k = x.shape
    m_pad = -(-m // TILE) * TILE
    q = torch.empty(m, k, dtype=fmt.dtype, device=x.device)
    s = _mn_major_scales(m, k // TILE, x.device)
    qt = torch.empty(k, m_pad, dtype=fmt.dtype, device=x.device)
    st = _mn_major_scales(k, m_pad // TILE, x.device)
    kernel, meta = _quantize_both_kernel, {}
    if config is not None:
        kernel, meta = _quantize_both_kernel.fn, dict(config.kwargs, num_warps=config.num_warps)
    kernel[(m_pad // TILE, k // TILE)](
        x, q, s, qt, st, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), qt.stride(0), st.stride(0),
        st.stride(1), POW2=power_of_two, **meta, **_grid_constants(fmt, explicit_round),
    )
    return q, s, qt, st


def quantize_blocks(w: torch.Tensor, fmt: Fp8Format, power_of_two: bool, transpose: bool = True,
                    explicit_round: bool = EXPLICIT_ROUND_DEFAULT) -> tuple[torch.Tensor, ...]:
    """w (N, K) -> (q (N, K), scales (N/128, K/128), q^T (K, N), scales^T (K/128, N/128)); only (q, scales)
    without `transpose`."""
    assert w.stride(1) == 1, "quantize_blocks needs a row-major weight"
    n, k = w.shape
    q = torch.empty(n, k, dtype=fmt.dtype, device=w.device)
    s = torch.empty(n // TILE, k // TILE, dtype=torch.float32, device=w.device)
    _quantize_blocks_kernel[(n // TILE, k // TILE)](w, q, s, n, k, w.stride(0), POW2=power_of_two, CHUNK=16,
                                                    num_warps=4, **_grid_constants(fmt, explicit_round))
    if not transpose:
        return q, s
    qt = torch.empty(k, n, dtype=fmt.dtype, device=w.device)
    _transpose_kernel[(n // TILE, k // TILE)](q, qt, n, k, BLOCK=TILE, num_warps=8)
    return q, s, qt, s.t().contiguous()


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


# ---------------------------------------------------------------------------------- grouped (MoE) GEMMs
# Rows are grouped by expert and each expert's rows are padded to a multiple of 128, so every 128-row tile
# belongs to one expert (`tile_expert`), and every 1x128 tile along the rows of a transposed operand too.


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_N": 256}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=4),
    ],
    key=["N", "K"],
)
@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, tile_expert_ptr, N, K,
                         stride_am, stride_be, stride_bn, stride_cm, stride_as_m, stride_as_k,
                         stride_bs_e, stride_bs_n, stride_bs_k, BLOCK_N: tl.constexpr):
    """C (Mp, N) = A (Mp, K) @ B[e] (N, K)^T for each 128-row tile of expert e; A in 1x128 tiles, B in blocks."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    rm = pid_m.to(tl.int64) * 128 + tl.arange(0, 128)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + e * stride_be + rn[:, None] * stride_bn + rk[None, :]
    acc = tl.zeros((128, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // 128):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs, mask=rn[:, None] < N, other=0.0)
        a_s = tl.load(as_ptr + rm * stride_as_m + kb * stride_as_k)
        b_s = tl.load(bs_ptr + e * stride_bs_e + (rn // 128) * stride_bs_n + kb * stride_bs_k, mask=rn < N, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
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
)
@triton.jit
def _grouped_wgrad_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, tile_start_ptr, tile_count_ptr, N, K,
                          stride_an, stride_bk, stride_ce, stride_cn, stride_as_n, stride_as_m, stride_bs_k,
                          stride_bs_m, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[e] (N, K) = A (N, rows of e) @ B (K, rows of e)^T: both operands in 1x128 tiles along the rows."""
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
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))


def grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 tile_expert: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a (Mp, K) FP8 rows, a_scale (Mp, K/128); b (E, N, K) FP8 blocks, b_scale (E, N/128, K/128) -> (Mp, N)."""
    mp, k = a.shape
    n = b.shape[1]
    assert mp % 128 == 0 and k % 128 == 0 and a.stride(1) == 1 and b.stride(2) == 1
    c = torch.empty(mp, n, dtype=out_dtype, device=a.device)
    _grouped_gemm_kernel[lambda meta: (mp // 128, triton.cdiv(n, meta["BLOCK_N"]))](
        a, b, c, a_scale, b_scale, tile_expert, n, k, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2))
    return c


def grouped_wgrad(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  tile_start: torch.Tensor, tile_count: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a (N, Mp), b (K, Mp) FP8 in 1x128 tiles along Mp, scales (N, Mp/128), (K, Mp/128) -> (E, N, K)."""
    n, mp = a.shape
    k = b.shape[0]
    num_experts = tile_start.shape[0]
    assert a.stride(1) == 1 and b.stride(1) == 1
    c = torch.empty(num_experts, n, k, dtype=out_dtype, device=a.device)
    def grid(meta):
        return (num_experts, triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"]))

    _grouped_wgrad_kernel[grid](
        a, b, c, a_scale, b_scale, tile_start, tile_count, n, k, a.stride(0), b.stride(0), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1))
    return c
