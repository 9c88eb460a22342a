"""The row + column quantizer (`quantize.quantize_rows_cols`: x (M, K) in 1x128 tiles along K for fprop/dgrad and
along M for wgrad, from one read of x) and RMSNorm's producer tile kernel in Gluon, for SM90; the Triton kernel
(`quantize._quantize_rows_cols_kernel`, `producers._rmsnorm_quantize_kernel`) stays for other GPUs and as the
reference this one must match byte for byte (`tests/test_fp8_gpu.py`, `benchmarks/rows_cols_variants.py`).

Why: the Triton kernel moves its bytes at 55-66% of copy speed, held back by occupancy, not by its instructions
(232 registers a thread for a 128x128 tile at 4 warps: two programs per SM, and a program's reads all wait for its
previous tile's arithmetic and stores). Here a persistent program walks its share of the tiles with the next tile's
reads issued before the current tile's arithmetic, so they are in flight while it computes. In a tile each thread
holds 8 tokens x 8 features (`gluon_tiles.block_layouts(8, 8, 8)`: 16 lanes along the tokens, 2 along the
features, 8 warps along the features): a column's maximum is taken by 4 shuffle rounds, a row's by one shuffle and
a reduction across the warps; the FP8 rows are 8-byte stores, the transposed columns 8-byte runs of tokens.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from megafp8.precision.formats import Fp8Format
from megafp8.precision.kernels import gluon_tiles

WARPS = 8
TOKENS_PER_THREAD = 8
FEATURES_PER_THREAD = 8
PROGRAMS_PER_SM = 1  # 202 registers a thread at 8 warps: one program fits an SM


@gluon.jit
def _load_tile(x_ptr, tile, n_tiles, n_kb, M, stride_xm, LOAD: gl.constexpr):
    """Tile `tile` of x (tiles numbered along K first) in LOAD, as stored (BF16); zeros past M and past the last
    tile (the prefetch after a program's last tile reads nothing)."""
    kb = tile % n_kb
    mb = tile // n_kb
    rows = mb * gluon_tiles.TOKENS + gl.arange(0, 128, layout=gl.SliceLayout(1, LOAD))
    cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LOAD))
    mask = gl.expand_dims((rows < M) & (tile < n_tiles), 1)
    return gl.load(x_ptr + gl.expand_dims(rows, 1) * stride_xm + gl.expand_dims(cols, 0), mask=mask, other=0.0)


@gluon.jit
def _rows_cols_kernel(x_ptr, rstd_ptr, w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, n_kb, stride_xm, stride_qm,
                      stride_sm, stride_sk, stride_qt, stride_st_k, stride_st_m, FP8_MAX: gl.constexpr,
                      POW2: gl.constexpr, NORM: gl.constexpr, LOAD: gl.constexpr, STORE: gl.constexpr,
                      SPREAD: gl.constexpr):
    """Every num_programs-th 128x128 tile of x (M, K), from this program's: quantized along its rows (q, s) and
    along its columns (qt = x^T, st; rows past M as zeros). With NORM, of RMSNorm(x): (x * rstd[row]) * w[col] in
    FP32, as the Triton kernel computes it."""
    n_tiles = (M + 127) // 128 * n_kb
    step = gl.num_programs(0)
    first = gl.program_id(0)
    x_next = _load_tile(x_ptr, first, n_tiles, n_kb, M, stride_xm, LOAD)
    for tile in range(first, n_tiles, step):
        x = x_next.to(gl.float32)
        x_next = _load_tile(x_ptr, tile + step, n_tiles, n_kb, M, stride_xm, LOAD)  # in flight during this tile
        kb = tile % n_kb
        mb = tile // n_kb
        rows = mb * gluon_tiles.TOKENS + gl.arange(0, 128, layout=gl.SliceLayout(1, LOAD))
        cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LOAD))
        in_rows = rows < M
        if NORM:
            rstd = gl.load(rstd_ptr + rows, mask=in_rows, other=0.0)
            x = (x * gl.expand_dims(rstd, 1)) * gl.expand_dims(gl.load(w_ptr + cols).to(gl.float32), 0)
        # Rows (`tiles.store_rows`): one scale per token over the tile's 128 features.
        scale, inv = gluon_tiles.tile_scale(gl.reduce(gl.abs(x), 1, gluon_tiles.nan_max), FP8_MAX, POW2)
        q = (x * gl.expand_dims(inv, 1)).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # saturating
        gl.store(q_ptr + gl.expand_dims(rows, 1) * stride_qm + gl.expand_dims(cols, 0), q,
                 mask=gl.expand_dims(in_rows, 1))
        gl.store(s_ptr + rows * stride_sm + kb * stride_sk, scale, mask=in_rows)
        # Columns (`tiles.store_cols`)
        gluon_tiles.store_cols(x, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX, POW2,
                               STORE, SPREAD)


def launch(x: torch.Tensor, rstd: torch.Tensor | None, weight: torch.Tensor | None, out: tuple, fmt: Fp8Format,
           power_of_two: bool, programs: int | None = None) -> None:
    """Fill `out` (from `tiles.rows_cols_outputs`) from x (M, K), or from RMSNorm(x) given its rstd (M,) and
    weight (K,). `programs` defaults to PROGRAMS_PER_SM per SM (at most one per tile)."""
    m, k = x.shape
    q, s, qt, st = out
    _, load, store = gluon_tiles.block_layouts(TOKENS_PER_THREAD, FEATURES_PER_THREAD, WARPS)
    tiles_total = -(-m // 128) * (k // 128)
    if programs is None:
        programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(x.device).multi_processor_count
    norm = rstd is not None
    _rows_cols_kernel[(max(1, min(programs, tiles_total)),)](
        x, rstd if norm else x, weight if norm else x, q, s, qt, st, m, k // 128, x.stride(0), q.stride(0),
        s.stride(0), s.stride(1), qt.stride(0), st.stride(0), st.stride(1), FP8_MAX=fmt.max, POW2=power_of_two,
        NORM=norm, LOAD=load, STORE=store, SPREAD=gluon_tiles.spread_layout(128 // WARPS, WARPS), num_warps=WARPS)
