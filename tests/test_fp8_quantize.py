"""Reference per-tile FP8 quantizers: error bounds, tile independence, zero/inf/nan, round trips, both layouts."""
from __future__ import annotations

import pytest
import torch

from megafp8.precision import E4M3, E4M3_MAX, E5M2
from megafp8.precision.quantize import (
    dequantize_128x128, dequantize_1x128, power_of_two_ceil, quantize_128x128, quantize_1x128,
    quantize_1x128_transposed, quantize_rows_cols,
)


def heavy_tailed(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, k, generator=g))  # magnitudes over decades
    return x


@pytest.mark.parametrize("fmt, mant_bits", [(E4M3, 3), (E5M2, 2)])
def test_quantization_error_within_format_bound(fmt, mant_bits):
    x = heavy_tailed(256, 512).double()
    q, scale = quantize_1x128(x.float(), fmt)
    err = (dequantize_1x128(q, scale).double() - x).abs()
    # Round to nearest: half a unit in the last place of the element's binade (relative 2^-(mant+1)),
    # and at most half the subnormal spacing for elements that land below the smallest normal.
    per_tile_scale = scale.double().repeat_interleave(128, dim=1)
    subnormal_half_step = torch.finfo(fmt.dtype).smallest_normal * 2.0 ** -(mant_bits + 1)
    bound = torch.maximum(x.abs() * 2.0 ** -(mant_bits + 1), per_tile_scale * subnormal_half_step)
    assert torch.all(err <= bound * (1 + 1e-6) + 1e-30)
    # Relative to the tile scale the error never exceeds half an ulp at the format's maximum.
    assert torch.all(err <= per_tile_scale * fmt.max * 2.0 ** -(mant_bits + 1) * (1 + 1e-6))


def test_tile_max_maps_to_format_max():
    x = heavy_tailed(64, 256)
    q, scale = quantize_1x128(x, E4M3)
    assert torch.allclose(q.float().abs().reshape(64, 2, 128).amax(-1), torch.full((64, 2), E4M3_MAX))
    assert torch.allclose(scale, x.abs().reshape(64, 2, 128).amax(-1) / E4M3_MAX)


def test_an_outlier_changes_only_its_own_tile():
    x = heavy_tailed(8, 512)
    _, before = quantize_1x128(x, E4M3)
    x[3, 300] = 1e4
    q, after = quantize_1x128(x, E4M3)
    changed = before != after
    assert changed[3, 2] and changed.sum() == 1
    wq_before = quantize_128x128(heavy_tailed(256, 256), E4M3)[1]
    w = heavy_tailed(256, 256)
    w[200, 10] = 1e4
    assert (quantize_128x128(w, E4M3)[1] != wq_before).sum() == 1


def test_zero_tile_gives_zeros_not_nan():
    x = heavy_tailed(4, 256)
    x[1, :128] = 0.0
    q, scale = quantize_1x128(x, E4M3)
    assert torch.all(q[1, :128].float() == 0) and scale[1, 0] == 1.0
    w = torch.zeros(128, 128)
    qw, sw = quantize_128x128(w, E4M3)
    assert torch.all(qw.float() == 0) and torch.isfinite(sw).all()


def test_inf_and_nan_surface_instead_of_being_clamped():
    x = heavy_tailed(4, 256)
    x[0, 5] = float("inf")
    x[2, 200] = float("nan")
    q, scale = quantize_1x128(x, E4M3)
    deq = dequantize_1x128(q, scale)
    assert not torch.isfinite(deq[0, :128]).any()  # the whole tile is poisoned, so the trainer sees it
    assert torch.isnan(deq[2, 128:]).all()
    assert torch.isfinite(deq[1]).all() and torch.isfinite(deq[0, 128:]).all()


def test_power_of_two_scales():
    assert power_of_two_ceil(torch.tensor([0.3, 0.5, 1.0, 3.0, 1e-30])).tolist() == [0.5, 0.5, 1.0, 4.0, 2.0**-99]
    x = heavy_tailed(32, 256)
    _, scale = quantize_1x128(x, E4M3, power_of_two=True)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)
    amax = x.abs().reshape(32, 2, 128).amax(-1)
    assert torch.all(scale >= amax / E4M3_MAX) and torch.all(scale < 2 * amax / E4M3_MAX)


def test_round_trip_is_exact_with_power_of_two_scales():
    """Re-quantizing dequantized values reproduces them exactly (a tile whose max lands on 224 may move to the
    next power-of-two scale, with its FP8 codes doubled: the same values)."""
    x = heavy_tailed(64, 256)
    q, scale = quantize_1x128(x, E4M3, power_of_two=True)
    values = dequantize_1x128(q, scale)
    q2, scale2 = quantize_1x128(values, E4M3, power_of_two=True)
    assert torch.equal(dequantize_1x128(q2, scale2), values)


def test_block_quantization_is_transpose_invariant():
    w = heavy_tailed(256, 384)
    q, s = quantize_128x128(w, E4M3)
    qt, st = quantize_128x128(w.t().contiguous(), E4M3)
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8)) and torch.equal(st, s.t())
    assert (dequantize_128x128(q, s) - w).abs().max() <= s.max() * E4M3_MAX * 2**-4


def test_transposed_quantization_tiles_along_tokens():
    x = heavy_tailed(256, 128)
    qt, st = quantize_1x128_transposed(x, E4M3)
    assert qt.shape == (128, 256) and st.shape == (128, 2)
    assert torch.allclose(st, x.abs().reshape(2, 128, 128).amax(1).t() / E4M3_MAX)


def test_rows_and_columns_are_each_quantized_from_the_original():
    """Both layouts come from x itself (the wgrad operand is not re-tiled from the FP8 rows): x^T's tiles along the
    tokens, with the tokens zero-padded to a multiple of 128, and scales stored column-major."""
    x = heavy_tailed(200, 256)
    q, s, qt, st = quantize_rows_cols(x, E4M3)
    q_ref, s_ref = quantize_1x128(x, E4M3)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    padded = torch.cat([x, torch.zeros(56, 256)])
    qt_ref, st_ref = quantize_1x128_transposed(padded, E4M3)
    assert qt.shape == (256, 256) and torch.equal(qt.view(torch.uint8), qt_ref.view(torch.uint8))
    assert torch.equal(st, st_ref) and torch.all(qt[:, 200:].float() == 0)
    assert s.stride() == (1, 200) and st.stride() == (1, 256)
    # Re-tiling the FP8 rows instead would round twice: the single quantization is closer to x.
    twice_t, twice_st = quantize_1x128_transposed(torch.cat([dequantize_1x128(q, s), torch.zeros(56, 256)]), E4M3)
    once_err = (dequantize_1x128(qt, st).t()[:200] - x).norm()
    twice_err = (dequantize_1x128(twice_t, twice_st).t()[:200] - x).norm()
    assert once_err < twice_err


def test_unaligned_shapes_are_rejected_with_the_size():
    with pytest.raises(ValueError, match="= 100 is not a multiple of the FP8 tile size 128"):
        quantize_1x128(torch.randn(4, 100), E4M3)
    with pytest.raises(ValueError, match="output dim = 200"):
        quantize_128x128(torch.randn(200, 128), E4M3)


def test_vanishingly_small_tiles_do_not_overflow_into_nan():
    x = torch.zeros(2, 256)
    x[0, :128] = torch.linspace(-1e-37, 1e-37, 128)  # 448 / 1e-37 would overflow FP32
    x[1, 128] = 3e-38
    for pow2 in (False, True):
        q, scale = quantize_1x128(x, E4M3, power_of_two=pow2)
        deq = dequantize_1x128(q, scale)
        assert torch.isfinite(deq).all() and torch.isfinite(scale).all()
        assert (deq - x).abs().max() < 1e-36
