"""SM90's Gluon quantizing kernels against the Triton kernels other GPUs run, byte for byte (skipped without CUDA;
each test skips off SM90): SwiGLU backward's column kernel (its thread layouts, and reading by TMA), SwiGLU
backward's rows and columns in one launch, the row + column quantizer (dy, RMSNorm's output, the MoE gathers) and
RoPE's backward quantizer. Moved out of `tests/test_fp8_gpu.py`, which keeps the FP8 layers on the GPU."""
from __future__ import annotations

import pytest
import torch

from tests.fp8_checks import assert_same_quantization

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("m", [328, 256, 1, 2])
@pytest.mark.parametrize("tokens_each, features_each, warps", [(8, 4, 4), (4, 8, 4), (8, 4, 8), (16, 2, 4)])
def test_the_gluon_swiglu_column_kernel_gives_the_triton_kernels_bits(tokens_each, features_each, warps, m):
    """SM90 runs SwiGLU backward's column outputs through the Gluon kernel (`swiglu_cols_gluon`), other GPUs
    through the Triton one: every layout of the Gluon kernel must write the Triton kernel's bytes (values and
    scales, the padding rows past M included), with power-of-two scales, E5M2 gradients, outliers and a nan; also
    for one and two tokens (one token: the twin of `gluon_tiles.TokenCountLaunch`) and a whole token block (256)."""
    gluon = pytest.importorskip("megafp8.precision.kernels.swiglu_cols_gluon")
    if torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("the Gluon column kernel runs on SM90 only")
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import producers, tiles
    torch.manual_seed(0)
    f = 384
    gu = (torch.randn(m, 2 * f, device=CUDA) * torch.logspace(-3, 3, 2 * f, device=CUDA)).bfloat16()
    da = torch.randn(m, f, device=CUDA, dtype=torch.bfloat16)
    gu[17 % m, 3] = float("nan")
    for grad_fmt, pow2 in ((E4M3, False), (E5M2, True)):
        outputs = []
        for run in (producers.swiglu_backward_cols,
                    lambda *a: gluon.swiglu_backward_cols(*a, num_warps=warps, tokens_each=tokens_each,
                                                          features_each=features_each)):
            qt, st = tiles.rows_cols_outputs(m, 2 * f, grad_fmt, CUDA)[2:]
            at, ats = tiles.rows_cols_outputs(m, f, E4M3, CUDA)[2:]
            for t in (qt, at):
                t.view(torch.uint8).fill_(0x55)  # a byte left unwritten shows
            run(gu, da, qt, st, at, ats, E4M3, grad_fmt, pow2)
            outputs.append(((qt, st), (at, ats)))
        (want_d, want_a), (got_d, got_a) = outputs
        assert_same_quantization(got_d, want_d, f"d(gu)^T, {grad_fmt}, pow2={pow2}")
        assert_same_quantization(got_a, want_a, f"a^T, pow2={pow2}")


@pytest.mark.parametrize("m", [328, 256, 8, 136])
@pytest.mark.parametrize("a_blocks", [False, True], ids=["a_in_tiles", "a_in_blocks"])
def test_the_swiglu_column_kernel_reading_by_tma_gives_the_pointer_kernels_bits(m, a_blocks):
    """SwiGLU backward's Gluon column kernel reads gu and da through TMA into shared memory where M is a multiple
    of 8 (`swiglu_cols_gluon._swiglu_backward_cols_tma_kernel`, slabs of tokens 8 apart): the bytes of the same
    kernel reading them with the threads' loads (which the test above holds to the Triton kernel's), a^T in tiles
    and in 128x128 blocks, partial and whole token blocks, E5M2 and power-of-two scales, outliers and a nan, and
    gu a view whose rows lie further apart than its width (the slab view must stay inside its storage)."""
    gluon = pytest.importorskip("megafp8.precision.kernels.swiglu_cols_gluon")
    if torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("the Gluon column kernel runs on SM90 only")
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import producers, tiles
    torch.manual_seed(0)
    f = 384
    wide = (torch.randn(m, 2 * f + 64, device=CUDA) * torch.logspace(-3, 3, 2 * f + 64, device=CUDA)).bfloat16()
    gu = wide[:, 32:32 + 2 * f]  # rows 2F + 64 apart, starting 64 bytes in
    da = torch.randn(m, f, device=CUDA, dtype=torch.bfloat16)
    gu[17 % m, 3] = float("nan")
    assert gluon.tma_fits(gu, da)
    a_amax = producers.swiglu_quantize(gu, E4M3, False, row_amax=True)[2] if a_blocks else None
    for grad_fmt, pow2 in ((E4M3, False), (E5M2, True)):
        outputs = []
        for use_tma in (False, True):
            qt, st = tiles.rows_cols_outputs(m, 2 * f, grad_fmt, CUDA)[2:]
            at, ats = tiles.rows_cols_outputs(m, f, E4M3, CUDA, cols_in_blocks=a_blocks)[2:]
            for t in (qt, at):
                t.view(torch.uint8).fill_(0x55)  # a byte left unwritten shows
            gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, E4M3, grad_fmt, pow2, a_amax=a_amax,
                                       use_tma=use_tma)
            outputs.append(((qt, st), (at, ats)))
        (want_d, want_a), (got_d, got_a) = outputs
        assert_same_quantization(got_d, want_d, f"d(gu)^T, {grad_fmt}, pow2={pow2}")
        assert_same_quantization(got_a, want_a, f"a^T, pow2={pow2}")


@pytest.mark.parametrize("m, f", [(328, 384), (256, 128), (8, 256), (136, 1024)])
@pytest.mark.parametrize("a_blocks", [False, True], ids=["a_in_tiles", "a_in_blocks"])
def test_swiglu_backward_rows_and_columns_in_one_launch_give_the_two_kernels_bits(m, f, a_blocks):
    """`swiglu_cols_gluon.swiglu_backward_rows_cols` (row and column programs in one launch) writes what the Triton
    row kernel and the TMA column kernel write, every byte: d(gu) along the features and its scales, d(gu)^T, a^T
    in tiles and in 128x128 blocks, partial and whole token blocks, one to eight units of 128 features, E5M2 and
    power-of-two scales, outliers, a nan, and gu a view whose rows lie further apart than its width. Bytes left
    unwritten show (the outputs start as 0x55)."""
    gluon = pytest.importorskip("megafp8.precision.kernels.swiglu_cols_gluon")
    if torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("the Gluon kernels run on SM90 only")
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import producers, tiles
    torch.manual_seed(0)
    wide = (torch.randn(m, 2 * f + 64, device=CUDA) * torch.logspace(-3, 3, 2 * f + 64, device=CUDA)).bfloat16()
    gu = wide[:, 32:32 + 2 * f]  # rows 2F + 64 apart, starting 64 bytes in
    da = torch.randn(m, f, device=CUDA, dtype=torch.bfloat16)
    gu[17 % m, 3] = float("nan")
    da[5 % m, f - 1] = 3e4  # an outlier in the last feature of d(up)'s source
    assert gluon.tma_fits(gu, da)
    a_amax = producers.swiglu_quantize(gu, E4M3, False, row_amax=True)[2] if a_blocks else None
    for grad_fmt, pow2 in ((E4M3, False), (E5M2, True)):
        outputs = []
        for one_launch in (False, True):
            q, s, qt, st = tiles.rows_cols_outputs(m, 2 * f, grad_fmt, CUDA)
            at, ats = tiles.rows_cols_outputs(m, f, E4M3, CUDA, cols_in_blocks=a_blocks)[2:]
            for t in (q, qt, at):
                t.view(torch.uint8).fill_(0x55)
            for t in (s, st, ats):
                t.fill_(-1.0)
            if one_launch:
                gluon.swiglu_backward_rows_cols(gu, da, q, s, qt, st, at, ats, E4M3, grad_fmt, pow2, a_amax=a_amax)
            else:
                producers.swiglu_backward_rows(gu, da, q, s, grad_fmt, pow2)
                gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, E4M3, grad_fmt, pow2, a_amax=a_amax)
            outputs.append(((q, s), (qt, st), (at, ats)))
        (want_rows, want_d, want_a), (got_rows, got_d, got_a) = outputs
        assert_same_quantization(got_rows, want_rows, f"d(gu), {grad_fmt}, pow2={pow2}")
        assert_same_quantization(got_d, want_d, f"d(gu)^T, {grad_fmt}, pow2={pow2}")
        assert_same_quantization(got_a, want_a, f"a^T, pow2={pow2}")


@pytest.mark.parametrize("norm, gather", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("spread_rows, spread_cols, m", [(True, True, 328), (False, True, 328), (False, False, 328),
                                                         (True, True, 256), (True, True, 1), (True, True, 2)])
def test_the_gluon_rows_cols_kernel_gives_the_triton_kernels_bits(norm, gather, spread_rows, spread_cols, m):
    """SM90 quantizes dy both ways, RMSNorm's output and the MoE dispatch's gathered rows through the Gluon kernel
    (`rows_cols_gluon`), other GPUs through the Triton one: the same bytes (values and scales, x^T's padding rows
    included), with E4M3 and E5M2, power-of-two scales, outliers, a nan, a partial last token block, a whole one
    (256 tokens: RMSNorm's tiles then load and store rows without predicates) and (gathering) zero rows, however the
    divisions are shared out, and for one and two tokens (one token is what ptxas miscompiled when M was compiled
    in: `gluon_tiles.TokenCountLaunch`). Both (norm, gather): the MoE combine's gradient, factors per gathered row
    as the inverse RMS and ones as the weight (`gather_scale_quantize_rows_cols`). The grid walking the token blocks
    first (`launch(rows_first=True)`) writes the same bytes."""
    gluon = pytest.importorskip("megafp8.precision.kernels.rows_cols_gluon")
    if torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("the Gluon rows + columns kernel runs on SM90 only")
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import quantize, tiles
    torch.manual_seed(0)
    k = 384
    x = (torch.randn(m, k, device=CUDA) * torch.logspace(-3, 3, k, device=CUDA)).bfloat16()
    x[17 % m, 3] = float("nan")
    rstd = torch.rsqrt(x.float().pow(2).mean(1) + 1e-5) if norm else None
    weight = (torch.rand(k, device=CUDA) + 0.5).bfloat16() if norm else None
    index = (torch.randperm(600, device=CUDA) % (m + 100) - 100) if gather else None  # rows of x, zero rows
    if gather:
        # as few gathered rows as x has tokens: one token gathers x's row 0 (the nan's row); two tokens gather
        # row 1 (the nan's) and a zero row
        index = torch.tensor([m - 1, -1], device=CUDA)[:m] if m < 128 else index
        m = index.shape[0]
    if norm and gather:  # a factor per gathered row (some zero), ones as the weight
        rstd = torch.rand(m, device=CUDA) * (torch.arange(m, device=CUDA) % 7 != 0)
        weight = torch.ones(k, device=CUDA)
    for fmt, pow2 in ((E4M3, False), (E5M2, True)):
        want, got, walked = (tiles.rows_cols_outputs(m, k, fmt, CUDA) for _ in range(3))
        for out in (want, got, walked):
            for t in (out[0], out[2]):
                t.view(torch.uint8).fill_(0x55)  # a byte left unwritten shows
        quantize.launch_rows_cols_triton(x, rstd, weight, want, fmt, pow2, index=index)
        for out, rows_first in ((got, False), (walked, True)):
            gluon.launch(x, rstd, weight, out, fmt, pow2, spread_rows=spread_rows, spread_cols=spread_cols,
                         index=index, rows_first=rows_first)
            label = f"{fmt}, pow2={pow2}, norm={norm}, rows_first={rows_first}"
            assert_same_quantization(out[:2], want[:2], f"rows, {label}")
            assert_same_quantization(out[2:], want[2:], f"columns, {label}")


@pytest.mark.parametrize("tokens_each, warps", [(16, 4), (8, 8)])
@pytest.mark.parametrize("m, head_dim", [(200, 128), (384, 128), (256, 64), (1, 128)],
                         ids=["partial_tile", "whole", "heads_64", "one_token"])
def test_the_gluon_rope_backward_kernel_gives_the_triton_kernels_bits(tokens_each, warps, m, head_dim):
    """SM90 runs RoPE's backward quantizer (the fused QKV projection's output gradient) as the Gluon kernel
    (`rows_cols_gluon.launch_rope_backward`), other GPUs as the Triton one: the same bytes, values and scales, x^T's
    padding included, in both thread layouts, with a partial last tile (masked loads) and whole ones (unmasked),
    heads of 128 and 64, sequences shorter than the rows (positions wrapping), outliers and a nan, and one token
    (the twin of `gluon_tiles.TokenCountLaunch`)."""
    gluon = pytest.importorskip("megafp8.precision.kernels.rows_cols_gluon")
    if torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("the Gluon RoPE backward kernel runs on SM90 only")
    from megafp8.model.rope import RotaryEmbedding
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import producers, tiles
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim, 128, 10000.0, device=CUDA)
    widths = (256, 128, 256)
    dq, dk, dv = ((torch.randn(m, w, device=CUDA) * torch.logspace(-3, 3, w, device=CUDA)).bfloat16()
                  for w in widths)
    dk[17 % m, 3] = float("nan")
    n = sum(widths)
    for fmt, pow2 in ((E4M3, False), (E5M2, True)):
        want, got = (tiles.rows_cols_outputs(m, n, fmt, CUDA) for _ in range(2))
        for out in (want, got):
            for t in (out[0], out[2]):
                t.view(torch.uint8).fill_(0x55)  # a byte left unwritten shows
        producers.launch_rope_backward_triton(dq, dk, dv, rope.cos, rope.sin, 128, head_dim, want, fmt, pow2)
        gluon.launch_rope_backward(dq, dk, dv, rope.cos, rope.sin, 128, head_dim, got, fmt, pow2,
                                   tokens_each=tokens_each, num_warps=warps)
        assert_same_quantization(got[:2], want[:2], f"rows, {fmt}, pow2={pow2}")
        assert_same_quantization(got[2:], want[2:], f"columns, {fmt}, pow2={pow2}")
