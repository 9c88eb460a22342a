"""Reference per-tile FP8 quantizers (pure torch; CPU or GPU), the bit-exact definition every fast path matches.

Layouts. `x` (M, K) quantized in 1x128 tiles along its last dim gives `x_fp8` (M, K) and
`x_scale` (M, K/128); weights (N, K) in 128x128 blocks give `w_fp8` (N, K) and `w_scale`
(N/128, K/128). A scale is the FP32 *dequantization* multiplier: x ~= x_fp8 * scale.

Arithmetic (fixed, so kernels can reproduce it bit for bit):
    amax  = max |x| over the tile (FP32), raised to MIN_AMAX = 2^-100 if smaller but nonzero
    scale = amax / FP8_MAX        dequantization multiplier (correctly rounded division),
    inv   = FP8_MAX / amax        quantization multiplier (correctly rounded; one division per tile)
            with power-of-two scales: scale = the next power of two >= amax / FP8_MAX, inv = 1 / scale
    scale = inv = 1 where amax == 0   (a zero tile quantizes to zeros, not nan)
    q     = clamp(x * inv, -FP8_MAX, FP8_MAX) cast to FP8 (round to nearest even)
Multiplying by a per-tile reciprocal instead of dividing every element keeps kernels cheap and
is still exactly reproducible (IEEE multiplication is correctly rounded everywhere). The clamp
only absorbs the last-ulp overshoot at the tile's max; it cannot hide an inf or nan: an inf
makes amax and the scale inf and the quantized inf nan (inf * 0), and a nan makes the tile's
scale nan, so non-finite inputs always surface downstream.
"""
from __future__ import annotations

import torch

from megafp8.precision.formats import MIN_AMAX, TILE, Fp8Format


def _check_divisible(size: int, what: str) -> None:
    if size % TILE != 0:
        raise ValueError(f"{what} = {size} is not a multiple of the FP8 tile size {TILE}")


def power_of_two_ceil(r: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= r for positive normal FP32 r (bit exact: clear the mantissa, bump the exponent)."""
    bits = r.view(torch.int32)
    mantissa = bits & 0x7FFFFF
    rounded = (bits & 0x7F800000) + torch.where(mantissa != 0, 0x800000, 0)
    return torch.where(torch.isfinite(r) & (r > 0), rounded.to(torch.int32).view(torch.float32), r)


def scales_from_amax(amax: torch.Tensor, fmt: Fp8Format, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantization scale, quantization multiplier) per tile."""
    # Divide by tensors, not Python numbers: CUDA torch turns `tensor / scalar` into a multiplication by
    # the reciprocal, which is not correctly rounded (3.0625 / 448 came out one ulp high).
    fp8_max = torch.full_like(amax, fmt.max)
    zero = amax == 0
    amax = torch.where(zero, amax, amax.clamp(min=MIN_AMAX))  # clamp keeps nan
    scale = amax / fp8_max
    if power_of_two:
        scale = power_of_two_ceil(scale)
        inv = torch.ones_like(scale) / scale
    else:
        inv = fp8_max / amax
    return torch.where(zero, 1.0, scale), torch.where(zero, 1.0, inv)


def _cast(x_times_inv: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    return x_times_inv.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def quantize_1x128(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (x_fp8 (M, K), scale (M, K/128)), one scale per 1x128 tile along K."""
    m, k = x.shape
    _check_divisible(k, "the quantized (contraction) dim")
    tiles = x.float().reshape(m, k // TILE, TILE)
    amax = tiles.abs().amax(dim=-1)  # (M, K/128); nan propagates
    scale, inv = scales_from_amax(amax, fmt, power_of_two)
    q = _cast(tiles * inv.unsqueeze(-1), fmt).reshape(m, k)
    return q, scale


def quantize_128x128(w: torch.Tensor, fmt: Fp8Format, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (w_fp8 (N, K), scale (N/128, K/128)), one scale per 128x128 block."""
    n, k = w.shape
    _check_divisible(n, "the weight's output dim")
    _check_divisible(k, "the weight's input dim")
    blocks = w.float().reshape(n // TILE, TILE, k // TILE, TILE)
    amax = blocks.abs().amax(dim=(1, 3))  # (N/128, K/128)
    scale, inv = scales_from_amax(amax, fmt, power_of_two)
    q = _cast(blocks * inv[:, None, :, None], fmt).reshape(n, k)
    return q, scale


def dequantize_1x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, k = q.shape
    return (q.float().reshape(m, k // TILE, TILE) * scale.unsqueeze(-1)).reshape(m, k)


def dequantize_128x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.float().reshape(n // TILE, TILE, k // TILE, TILE) * scale[:, None, :, None]).reshape(n, k)


def quantize_1x128_transposed(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> quantized x^T (K, M) in 1x128 tiles along M: the token-contracting operand of wgrad (row-major,
    as every backend lays it out)."""
    return quantize_1x128(x.t().contiguous(), fmt, power_of_two)


def quantize_rows_cols(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool = False,
                       cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
    """Both quantizations a GEMM operand needs when it is contracted over K (fprop, dgrad) and over its rows
    (wgrad), each from the high-precision x itself:

        x (M, K) -> x_fp8 (M, K), scales (M, K/128)           1x128 tiles along K
                    xt_fp8 (K, M_pad), scales (K, M_pad/128)  x^T in 1x128 tiles along the rows, M padded with
                                                              zero rows to a multiple of 128

    `cols_in_blocks` (`Fp8Recipe.wgrad_input_blocks`, for the weight gradient's input x only): x^T in 128x128
    blocks instead, scales (K/128, M_pad/128), one per block of 128 features x 128 tokens (`cols_in_blocks` tells
    the two layouts apart by the scales' shape).

    Scales are returned column-major (stride (1, rows)), the layout the GEMMs read, as every backend returns them."""
    q, s = quantize_1x128(x, fmt, power_of_two)
    padded = pad_rows(x, -x.shape[0] % TILE, 0.0)
    if cols_in_blocks:
        qt, st = quantize_128x128(padded.t().contiguous(), fmt, power_of_two)
    else:
        qt, st = quantize_1x128_transposed(padded, fmt, power_of_two)
    return q, mn_major(s), qt, mn_major(st)


def scales_in_blocks(values: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the scales of a token-contracting wgrad operand (values (C, M_pad)) are one per 128 x 128 block
    ((C/128, M_pad/128): `quantize_rows_cols(cols_in_blocks=True)`), not one per 1x128 tile along the tokens
    ((C, M_pad/128))."""
    return scales.shape[0] != values.shape[0]


def dequantize_along_tokens(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A wgrad operand (C, M_pad) in FP32 from either layout of `quantize_rows_cols`'s x^T."""
    if scales_in_blocks(values, scales):
        return dequantize_128x128(values, scales)
    return dequantize_1x128(values, scales)


def mn_major(scale: torch.Tensor) -> torch.Tensor:
    """The same (rows, K/128) scales stored column-major (stride (1, rows)); unchanged if they already are."""
    rows, cols = scale.shape
    if scale.stride() == (1, rows):  # checked strictly: cuBLAS reads the strides even of a dim of size one
        return scale
    return torch.empty_strided((rows, cols), (1, rows), dtype=scale.dtype, device=scale.device).copy_(scale)


def pad_rows(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """`t` with `rows` more rows filled with `value` (FP8 tensors: pass a uint8 view and 0 for zeros)."""
    return torch.cat([t, t.new_full((rows, *t.shape[1:]), value)]) if rows else t
