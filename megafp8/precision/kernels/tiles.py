"""Building blocks of the quantizing Triton kernels, each reproducing `megafp8.precision.quantize` bit for bit.

- Max-abs reductions propagate nan (a tile holding a nan gets a nan scale, as torch's `amax` gives).
- Scales are correctly rounded divisions (`div_rn`), with the same power-of-two rounding on the scale's bits.
- Values are multiplied by the tile's reciprocal, then clamped and rounded to FP8 by the FP32 -> FP8 conversion
  itself, asked for as round-to-nearest-even (on SM89+ `cvt.rn.satfinite.e4m3x2.f32`, saturating): the
  reference's clamp and cast.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional

import torch
import triton
import triton.language as tl

from megafp8.precision.formats import MIN_AMAX, Fp8Format

MIN_AMAX_CONST = tl.constexpr(MIN_AMAX)
TILE_CONST = tl.constexpr(128)


@triton.jit
def max_propagating_nan(a, b):
    """Elementwise max, nan if either is nan."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax(abs_x, axis: tl.constexpr):
    """Max of `abs_x` along `axis`, nan if any element is nan."""
    return tl.reduce(abs_x, axis, max_propagating_nan)


@triton.jit
def tile_scale(tile_amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """(dequantization scale, quantization multiplier) per tile, as `quantize.scales_from_amax`."""
    zero = tile_amax == 0
    tile_amax = tl.where(zero, tile_amax, tl.maximum(tile_amax, MIN_AMAX_CONST, propagate_nan=tl.PropagateNan.ALL))
    scale = tl.math.div_rn(tile_amax, FP8_MAX)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        up = (bits & 0x7F800000) + tl.where((bits & 0x7FFFFF) != 0, 0x800000, 0)
        finite_pos = (scale > 0) & (scale < float("inf"))
        scale = tl.where(finite_pos, up.to(tl.float32, bitcast=True), scale)
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    else:
        inv = tl.math.div_rn(tl.full(tile_amax.shape, FP8_MAX, tl.float32), tile_amax)
    return tl.where(zero, 1.0, scale), tl.where(zero, 1.0, inv)


@triton.jit
def to_fp8(x, inv, FP8_MAX: tl.constexpr, out_dtype: tl.constexpr):
    """clamp(x * inv, -FP8_MAX, FP8_MAX) rounded to FP8 (`out_dtype`), ties to even; nan stays nan.

    The clamp is the conversion's own: on the GPUs these kernels run on (SM89+) Triton converts FP32 to FP8 with
    `cvt.rn.satfinite`, which gives +-FP8_MAX for finite values past it and for infinities, and keeps nan. An
    explicit clamp before it would change no bit and cost two instructions per element (`FP8_MAX` stays in the
    signature: the format's range is the conversion's)."""
    return (x * inv).to(out_dtype, fp_downcast_rounding="rtne")


@triton.jit
def store_rows(x, rows, cols, M, kb, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk,
               FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Quantize the FP32 tile x (rows, 128 cols) in 1x128 tiles along its rows and store the rows below M:
    values at q[rows, cols], scales at s[rows, kb]."""
    scale, inv = tile_scale(amax(tl.abs(x), 1), FP8_MAX, POW2)
    q = to_fp8(x, inv[:, None], FP8_MAX, q_ptr.dtype.element_ty)
    in_rows = rows < M
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=in_rows[:, None])
    tl.store(s_ptr + rows * stride_sm + kb * stride_sk, scale, mask=in_rows)


@triton.jit
def store_cols(x, rows, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m,
               FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Quantize the FP32 tile x (128 rows, cols) in 1x128 tiles along its columns (x^T's rows) and store x^T:
    values at qt[cols, rows], scales at st[cols, mb]. Rows past the input's end must hold zeros."""
    scale, inv = tile_scale(amax(tl.abs(x), 0), FP8_MAX, POW2)
    store_transposed(x, inv, rows, cols, qt_ptr, stride_qt, FP8_MAX)
    tl.store(st_ptr + cols * stride_st_k + mb * stride_st_m, scale)


@triton.jit
def store_transposed(x, col_inv, rows, cols, qt_ptr, stride_qt, FP8_MAX: tl.constexpr):
    """x (rows, cols) FP32 times its columns' quantization multipliers, in FP8, stored as x^T: qt[cols, rows]
    (contiguous along the rows, so the writes coalesce)."""
    qt = to_fp8(x, col_inv[None, :], FP8_MAX, qt_ptr.dtype.element_ty)
    tl.store(qt_ptr + cols[:, None] * stride_qt + rows[None, :], tl.trans(qt))


def format_constants(fmt: Fp8Format) -> dict:
    """The kernels' format argument."""
    return dict(FP8_MAX=fmt.max)


def mn_major_scales(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """An empty (rows, cols) FP32 scale tensor stored column-major (stride (1, rows)): the layout cuBLAS reads."""
    return torch.empty(cols, rows, dtype=torch.float32, device=device).t()


def rows_cols_outputs(m: int, k: int, fmt: Fp8Format, device: torch.device,
                      cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
    """Empty (x_fp8 (M, K), scales (M, K/128), xt_fp8 (K, M_pad), scales_t (K, M_pad/128)), scales column-major;
    with `cols_in_blocks` x^T's scales are one per 128x128 block, (K/128, M_pad/128) (`quantize.quantize_rows_cols`)."""
    m_pad = -(-m // 128) * 128
    return (torch.empty(m, k, dtype=fmt.dtype, device=device), mn_major_scales(m, k // 128, device),
            torch.empty(k, m_pad, dtype=fmt.dtype, device=device),
            mn_major_scales(k // 128 if cols_in_blocks else k, m_pad // 128, device))


def rows_cols_strides(q: torch.Tensor, s: torch.Tensor, qt: torch.Tensor, st: torch.Tensor) -> tuple[int, ...]:
    """The stride arguments of `store_rows` and `store_cols` for outputs from `rows_cols_outputs`."""
    return q.stride(0), s.stride(0), s.stride(1), qt.stride(0), st.stride(0), st.stride(1)


@functools.cache  # asked at every quantizer launch: the device's capability and the import cost host time
def hopper_gluon(device: torch.device, module: str) -> Optional[ModuleType]:
    """`megafp8.precision.kernels.<module>`, a Gluon kernel that writes its Triton twin's bytes faster on SM90, where
    it runs (compute capability 9.0 and Triton's Gluon language), else None: the Triton kernel runs."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        return None
    try:
        return importlib.import_module(f"megafp8.precision.kernels.{module}")
    except ImportError:  # no Gluon, or one without what the module imports
        return None
