"""Conformance of every registered FP8 backend with the reference definitions (`megafp8.precision.backends`).

Each backend runs on each device it supports (the reference on the CPU; the GPU backends, `gpu`-marked, on
CUDA); what it computes is compared on the CPU with the reference functions applied to the same inputs:
- standalone quantizers (rows; rows and columns; weights with their transpose, in place): bit for bit;
- quantizers fused into their producers (RMSNorm, SwiGLU, SwiGLU's backward): within one E4M3 ULP of the
  pure-torch twins (`megafp8.precision.producers`), scales within a few FP32 ULPs; RMSNorm given the kernel's
  own inverse RMS, bit for bit;
- GEMMs, dense and grouped by expert: within FP32 accumulation tolerance.
"""
from __future__ import annotations

import pytest
import torch

from tests.fp8_checks import assert_same_quantization, assert_within_one_fp8_ulp, float_ulps, outlier_tensor, ties_tensor
from megafp8.precision import E4M3, E5M2, producers
from megafp8.precision import quantize as ref
from megafp8.precision.backends import REGISTERED, Fp8Backend
from megafp8.precision.grouped import expert_rows

REFERENCE = Fp8Backend()
# The producer's own FP32 arithmetic (exp, a row's sum of squares) may differ from torch's in the last bits; a
# scale is the tile's max-abs over 448, so it inherits that difference.
PRODUCER_SCALE_ULPS = 8


def _backend_params():
    params = []
    for cls in REGISTERED:
        devices = ["cpu", "cuda"] if cls.name == "reference" else ["cuda"]
        for device in devices:
            marks = [pytest.mark.gpu] if device == "cuda" else []
            params.append(pytest.param((cls, device), id=f"{cls.name}-{device}", marks=marks))
    return params


@pytest.fixture(params=_backend_params())
def backend_on(request):
    cls, device = request.param
    reason = cls.unavailable_reason(torch.device(device))
    if reason is not None:
        pytest.skip(reason)
    return cls(), torch.device(device)


def _inputs(fmt, device):
    x_nan = outlier_tensor(200, 384, seed=5)
    x_nan[150, 5] = float("nan")
    x_nan[20, 300] = float("inf")
    return [outlier_tensor(384, 512), outlier_tensor(200, 384, seed=1), outlier_tensor(1, 256, seed=2),
            ties_tensor(fmt), x_nan]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2-scales"])
def test_quantizers_give_the_reference_bits(backend_on, fmt, pow2):
    """Rows, and rows and columns from one read (x^T padded with zero rows to a multiple of 128), on outliers,
    zero and tiny tiles, every tie between FP8 values, a nan and an inf (which poison their tiles)."""
    backend, device = backend_on
    for x in _inputs(fmt, device):
        x_dev = x.to(device)
        assert_same_quantization(backend.quantize_rows(x_dev, fmt, pow2), ref.quantize_1x128(x, fmt, pow2),
                                 f"rows {tuple(x.shape)}")
        got, want = backend.quantize_rows_cols(x_dev, fmt, pow2), ref.quantize_rows_cols(x, fmt, pow2)
        assert got[1].stride(0) == 1 and got[3].stride(0) == 1, "scales are returned column-major"
        assert_same_quantization(got[:2], want[:2], f"rows of rows_cols {tuple(x.shape)}")
        assert_same_quantization(got[2:], want[2:], f"columns of rows_cols {tuple(x.shape)}")


def _tokens_in_padded_layout(seed: int) -> tuple:
    """150 outlier-laden tokens (a nan in one), each feeding two rows of the padded expert layout of four experts
    (one without rows): (tokens, row_to_source, layout, index: the padded layout's source rows, -1 for padding)."""
    from megafp8.precision.grouped import padded_source_index
    tokens = outlier_tensor(150, 384, seed=8 + seed)
    tokens[7, 9] = float("nan")
    row_to_source = torch.randperm(300, generator=torch.Generator().manual_seed(seed)) // 2
    layout = expert_rows([130, 0, 3, 167], torch.device("cpu"))
    return tokens, row_to_source, layout, padded_source_index(layout, row_to_source)


def test_the_gathering_quantizer_gives_the_reference_bits(backend_on):
    """Token rows gathered into the padded expert layout (each token feeding two rows, zero rows between experts,
    an expert without rows, a nan in one token) and quantized both ways: the bits of the reference quantizer on
    the padded copy."""
    backend, device = backend_on
    source, row_to_source, layout, index = _tokens_in_padded_layout(0)
    padded = source.new_zeros(layout.total, 384).index_copy_(0, layout.index, source[row_to_source])
    for fmt, pow2 in ((E4M3, False), (E5M2, True)):
        got = backend.gather_quantize_rows_cols(source.to(device), index.to(device), fmt, pow2)
        want = ref.quantize_rows_cols(padded, fmt, pow2)
        assert_same_quantization(got[:2], want[:2], f"rows, {fmt.name}")
        assert_same_quantization(got[2:], want[2:], f"columns, {fmt.name}")


def test_the_scaling_gathering_quantizer_gives_its_twins_bits(backend_on):
    """The MoE combine's gradient into the padded expert layout: padded row p is w[p] * dout[token[p]] computed in
    FP32 and quantized from FP32 both ways (zero rows for padding, a nan in one token, a zero weight): the bits of
    the reference quantizer on that FP32 product, computed here independently of the backend."""
    backend, device = backend_on
    dout, row_to_source, layout, index = _tokens_in_padded_layout(1)
    factor = torch.rand(layout.total, generator=torch.Generator().manual_seed(2)) * (index >= 0)
    factor[layout.index[5]] = 0.0
    product = torch.zeros(layout.total, 384).index_copy_(
        0, layout.index, dout[row_to_source].float() * factor[layout.index][:, None])
    for fmt, pow2 in ((E5M2, False), (E4M3, True)):
        got = backend.gather_scale_quantize_rows_cols(dout.to(device), index.to(device), factor.to(device), fmt,
                                                      pow2)
        want = ref.quantize_rows_cols(product, fmt, pow2)
        assert_same_quantization(got[:2], want[:2], f"rows, {fmt.name}")
        assert_same_quantization(got[2:], want[2:], f"columns, {fmt.name}")


@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2-scales"])
@pytest.mark.parametrize("shape", [(256, 384), (3, 128, 256)], ids=["dense", "experts"])
def test_weight_quantization_gives_the_reference_bits_in_place(backend_on, pow2, shape):
    backend, device = backend_on
    out = backend.empty_weight(torch.Size(shape), E4M3, device)
    addresses = [t.data_ptr() for t in out.tensors()]
    for seed in (0, 1):  # the second version overwrites the first, in the same tensors
        w = outlier_tensor(shape[-2] * (shape[0] if len(shape) == 3 else 1), shape[-1], seed=seed).view(shape)
        backend.quantize_weight_(w.to(device), out, E4M3, pow2)
        assert [t.data_ptr() for t in out.tensors()] == addresses
        q, s = ref.quantize_128x128(w.reshape(-1, shape[-1]), E4M3, pow2)
        q, s = q.view(shape), s.view(*shape[:-2], shape[-2] // 128, shape[-1] // 128)
        kb, nb = s.shape[-1], s.shape[-2]
        assert_same_quantization((out.w_fp8, backend.block_scales_nk(out.w_scale)[..., :kb]), (q, s), "w")
        qt = q.view(torch.uint8).transpose(-2, -1).contiguous().view(q.dtype)
        assert_same_quantization((out.wt_fp8, backend.block_scales_nk(out.wt_scale)[..., :nb]),
                                 (qt, s.transpose(-2, -1)), "w^T")


@pytest.mark.parametrize("shape", [(256, 384), (3, 128, 256)], ids=["dense", "experts"])
def test_a_weight_quantized_without_its_transpose_makes_the_same_transpose_on_demand(backend_on, shape):
    """A cache that does not keep w^T (the MoE experts') holds w with the same bits, nothing else, and
    `weight_transposed` makes w^T and its scales, in the GEMM's layout, bit for bit the kept ones."""
    backend, device = backend_on
    w = outlier_tensor(shape[-2] * (shape[0] if len(shape) == 3 else 1), shape[-1], seed=7).view(shape).to(device)
    kept, bare = backend.empty_weight(torch.Size(shape), E4M3, device), \
        backend.empty_weight(torch.Size(shape), E4M3, device, transpose=False)
    assert bare.wt_fp8 is None and bare.wt_scale is None
    for out in (kept, bare):
        backend.quantize_weight_(w, out, E4M3, False)
    nb, kb = shape[-2] // 128, shape[-1] // 128
    assert_same_quantization((bare.w_fp8, backend.block_scales_nk(bare.w_scale)[..., :kb]),
                             (kept.w_fp8, backend.block_scales_nk(kept.w_scale)[..., :kb]), "w")
    assert backend.weight_transposed(kept) == (kept.wt_fp8, kept.wt_scale)  # a kept transpose is returned as is
    wt, wt_scale = backend.weight_transposed(bare)
    assert wt.shape == kept.wt_fp8.shape and wt_scale.shape == kept.wt_scale.shape
    assert wt_scale.stride() == kept.wt_scale.stride()  # the layout the backend's GEMM reads
    assert_same_quantization((wt, backend.block_scales_nk(wt_scale)[..., :nb]),
                             (kept.wt_fp8, backend.block_scales_nk(kept.wt_scale)[..., :nb]), "w^T")


@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2-scales"])
def test_fused_producers_stay_within_one_fp8_ulp_of_their_twins(backend_on, pow2):
    backend, device = backend_on
    fmt = E4M3
    h = outlier_tensor(200, 384, seed=3)
    norm_weight = (1 + 0.1 * torch.randn(384, generator=torch.Generator().manual_seed(4))).to(torch.bfloat16)
    *got, rstd = backend.rmsnorm_quantize(h.to(device), norm_weight.to(device), 1e-5, fmt, pow2)
    *want, want_rstd = producers.rmsnorm_quantize(h, norm_weight, 1e-5, fmt, pow2)
    # The sum of squares in another order: the mean within a few ULPs, its inverse square root within half that.
    assert int(float_ulps(rstd.cpu(), want_rstd).max()) <= 4, "RMSNorm's inverse RMS"
    for i, part in ((0, "rows"), (2, "columns")):
        assert_within_one_fp8_ulp(got[i:i + 2], want[i:i + 2], PRODUCER_SCALE_ULPS, f"rmsnorm {part}")
    # Given the kernel's own inverse RMS, the rest of its arithmetic (two multiplies, then the quantizer) is exact.
    exact = producers.rmsnorm_quantize(h, norm_weight, 1e-5, fmt, pow2, rstd=rstd.cpu())
    assert_same_quantization(got[:2], exact[:2], "rmsnorm rows given its rstd")
    assert_same_quantization(got[2:], exact[2:4], "rmsnorm columns given its rstd")

    gu = outlier_tensor(200, 512, seed=6)
    da = outlier_tensor(200, 256, seed=7)
    got, want = backend.swiglu_quantize(gu.to(device), fmt, pow2), producers.swiglu_quantize(gu, fmt, pow2)
    assert_within_one_fp8_ulp(got, want, PRODUCER_SCALE_ULPS, "swiglu rows")
    got = backend.swiglu_backward_quantize(gu.to(device), da.to(device), fmt, E5M2, pow2)
    want = producers.swiglu_backward_quantize(gu, da, fmt, E5M2, pow2)
    for i, part in ((0, "d(gu) rows"), (2, "d(gu) columns"), (4, "SwiGLU output columns")):
        assert_within_one_fp8_ulp(got[i:i + 2], want[i:i + 2], PRODUCER_SCALE_ULPS, f"swiglu backward {part}")
    assert got[0].dtype == E5M2.dtype and got[4].dtype == fmt.dtype
    # Forward and backward quantize SwiGLU's output from the same FP32 values: its rows and its columns agree.
    rows, cols = ref.dequantize_1x128(*(t.cpu() for t in backend.swiglu_quantize(gu.to(device), fmt, pow2))), \
        ref.dequantize_1x128(*(t.cpu() for t in got[4:]))
    assert float((rows - cols.t()[:200]).norm() / rows.norm()) < 0.05


def _rope_gradients(rows: int, widths: tuple[int, int, int], seed: int = 11) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv (rows, width) BF16 with outliers, as the attention core hands them back."""
    return tuple(outlier_tensor(rows, w, seed=seed + i) for i, w in enumerate(widths))


def test_rope_backward_is_autograds_gradient_through_the_rotation():
    """The twin's RoPE backward is, bit for bit, what autograd computes in FP32 through `megafp8.model.rope`'s
    rotation (token-major rows, positions repeating every sequence), and its quantized form is the reference
    quantizer's bits on [that | that | dv] in FP32."""
    from megafp8.model.rope import RotaryEmbedding
    from megafp8.precision.producers import rope_backward
    rope = RotaryEmbedding(64, 48, 10000.0)
    batch, seq, heads = 3, 48, 4
    x = torch.randn(batch, seq, heads, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    q_rot, _ = rope(x, x.detach())
    grad = torch.randn_like(q_rot)
    q_rot.backward(grad)
    got = rope_backward(grad.reshape(batch * seq, heads * 64), rope.cos, rope.sin, seq, 64)
    assert torch.equal(got, x.grad.reshape(batch * seq, heads * 64))

    dq, dk, dv = _rope_gradients(batch * seq, (256, 128, 128))
    fp32 = torch.cat([rope_backward(dq, rope.cos, rope.sin, seq, 64), rope_backward(dk, rope.cos, rope.sin, seq, 64),
                      dv.float()], dim=-1)
    got = producers.rope_backward_quantize(dq, dk, dv, rope.cos, rope.sin, seq, 64, E4M3, True)
    want = ref.quantize_rows_cols(fp32, E4M3, True)
    assert_same_quantization(got[:2], want[:2], "rope backward, rows")
    assert_same_quantization(got[2:], want[2:], "rope backward, columns")


@pytest.mark.parametrize("head_dim, widths", [(128, (512, 256, 256)), (64, (256, 128, 384))],
                         ids=["heads_of_128", "heads_of_64"])
def test_rope_backward_quantize_stays_within_one_fp8_ulp_of_its_twin(backend_on, head_dim, widths):
    """The QKV projection's output gradient through RoPE's backward, quantized from FP32 both ways (200 rows: 3
    sequences of 64 tokens and a partial one), against `producers.rope_backward_quantize`."""
    from megafp8.model.rope import RotaryEmbedding
    backend, device = backend_on
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    dq, dk, dv = _rope_gradients(200, widths)
    got = backend.rope_backward_quantize(dq.to(device), dk.to(device), dv.to(device), rope.cos.to(device),
                                         rope.sin.to(device), 64, head_dim, E5M2, False)
    want = producers.rope_backward_quantize(dq, dk, dv, rope.cos, rope.sin, 64, head_dim, E5M2, False)
    for i, part in ((0, "rows"), (2, "columns")):
        assert_within_one_fp8_ulp(got[i:i + 2], want[i:i + 2], PRODUCER_SCALE_ULPS, f"rope backward {part}")
    assert got[0].shape == (200, sum(widths)) and got[0].dtype == E5M2.dtype


def test_rope_backward_quantize_reads_no_table_row_past_its_tokens(backend_on):
    """One sequence of 200 tokens, its tables exactly 200 rows long (a view of a longer buffer whose next rows hold
    nan): the last tile's padding rows (200-255) must read neither gradient nor table, or a nan read there would
    make every column scale of that tile nan."""
    from megafp8.model.rope import RotaryEmbedding
    backend, device = backend_on
    rope = RotaryEmbedding(128, 256, 10000.0)
    cos, sin = (t.clone().to(device) for t in (rope.cos, rope.sin))
    cos[200:], sin[200:] = float("nan"), float("nan")
    dq, dk, dv = _rope_gradients(200, (128, 128, 128))
    got = backend.rope_backward_quantize(dq.to(device), dk.to(device), dv.to(device), cos[:200], sin[:200], 256, 128,
                                         E4M3, False)
    want = producers.rope_backward_quantize(dq, dk, dv, rope.cos[:200], rope.sin[:200], 256, 128, E4M3, False)
    assert not any(bool(t.float().isnan().any()) for t in got)
    for i, part in ((0, "rows"), (2, "columns")):
        assert_within_one_fp8_ulp(got[i:i + 2], want[i:i + 2], PRODUCER_SCALE_ULPS, f"rope backward {part}")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want).norm() / want.norm())


# Odd row counts (1, 5, 129) are what MoE experts get; cuBLAS needs them padded to a multiple of 4.
@pytest.mark.parametrize("m, k, n", [(256, 512, 384), (1, 256, 128), (5, 256, 128), (129, 512, 256)])
def test_gemms_match_the_reference_within_accumulation_tolerance(backend_on, m, k, n):
    backend, device = backend_on
    a = ref.quantize_1x128(outlier_tensor(m, k), E4M3)
    w = backend.empty_weight(torch.Size((n, k)), E4M3, device)
    w_host = outlier_tensor(n, k, seed=2)
    backend.quantize_weight_(w_host.to(device), w, E4M3, False)
    w_ref = ref.quantize_128x128(w_host, E4M3)
    b_tiles = ref.quantize_1x128(outlier_tensor(n, k, seed=3), E4M3)
    on_device = [t.to(device) for t in a]
    for out_dtype in (torch.bfloat16, torch.float32):
        # FP32 out: beyond summation order, Hopper's FP8 MMA keeps fewer accumulator bits within a 128-wide K block
        # (the effect DeepSeek-V3 reports), ~1e-4 relative. BF16 out: one rounding to 8 mantissa bits.
        limit = 4e-3 if out_dtype == torch.bfloat16 else 3e-4
        got = backend.gemm_1x128_128x128(*on_device, w.w_fp8, w.w_scale, out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, n)
        assert _relative_error(got, REFERENCE.gemm_1x128_128x128(*a, *w_ref, torch.float32)) < limit
        got = backend.gemm_1x128_1x128(*on_device, *(t.to(device) for t in b_tiles), out_dtype)
        assert _relative_error(got, REFERENCE.gemm_1x128_1x128(*a, *b_tiles, torch.float32)) < limit


def test_expert_rows_from_device_counts_bound_the_layout_and_agree_with_the_exact_one():
    """Counts left on the device give the exact layout's positions, tiles and segments, sized by the upper bound
    (each expert adds at most 127 padding rows), the tiles past the last expert's marked -1."""
    counts = [5, 0, 130, 1, 300]
    exact = expert_rows(counts, torch.device("cpu"))
    bound = expert_rows(torch.tensor(counts), torch.device("cpu"), sum(counts))
    assert exact.total == 7 * 128 and bound.total == (436 + 5 * 127) // 128 * 128 == 8 * 128
    assert bound.segments == exact.segments == [(0, 0, 128), (2, 128, 384), (3, 384, 512), (4, 512, 896)]
    for name in ("index", "tile_start", "tile_count", "counts"):
        assert torch.equal(getattr(bound, name), getattr(exact, name)), name
    assert bound.tile_expert.tolist() == exact.tile_expert.tolist() + [-1] == [0, 2, 2, 3, 4, 4, 4, -1]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # the bound holds for any counts
        c = torch.randint(0, 300, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        c[torch.rand(c.shape, generator=g) < 0.3] = 0
        layout = expert_rows(c, torch.device("cpu"), int(c.sum()))
        exact_tiles = int(((c + 127) // 128).sum())
        assert layout.total >= exact_tiles * 128 and (layout.tile_expert[exact_tiles:] == -1).all()
    with pytest.raises(ValueError, match="needs `rows`"):
        expert_rows(torch.tensor(counts), torch.device("cpu"))


@pytest.mark.parametrize("counts_on", ["host", "device"])
def test_grouped_gemms_match_the_reference(backend_on, counts_on):
    """fprop/dgrad over 128-row expert tiles and the k-grouped wgrad, on counts that include an empty expert, a
    single row and a partial tile; with the counts on the device, the layout's tiles past the last expert's
    (expert -1) come out zero. The weights' tensors start as NaN bytes: dgrad's w^T, made for the call, leaves the
    empty expert's part unwritten on the fast backends, and no GEMM may read it."""
    backend, device = backend_on
    empty_weight = backend.empty_weight

    def poisoned(*args, **kwargs):
        out = empty_weight(*args, **kwargs)
        for t in out.tensors():
            if t is not None:
                t.view(torch.uint8).fill_(0x7F) if t.element_size() == 1 else t.fill_(float("nan"))
        return out
    backend.empty_weight = poisoned
    counts = [5, 0, 130, 1, 300]
    if counts_on == "host":
        rows, rows_cpu = expert_rows(counts, device), expert_rows(counts, torch.device("cpu"))
    else:
        rows = expert_rows(torch.tensor(counts, device=device), device, sum(counts))
        rows_cpu = expert_rows(torch.tensor(counts), torch.device("cpu"), sum(counts))
    a = ref.quantize_1x128(outlier_tensor(rows.total, 512), E4M3)
    w_host = outlier_tensor(len(counts) * 256, 512, seed=2).view(len(counts), 256, 512)
    # without its transpose kept, as the experts' weights are (dgrad's w^T is made for the call)
    w = backend.empty_weight(w_host.shape, E4M3, device, transpose=False)
    w_ref = REFERENCE.empty_weight(w_host.shape, E4M3, "cpu")
    backend.quantize_weight_(w_host.to(device), w, E4M3, False)
    REFERENCE.quantize_weight_(w_host, w_ref, E4M3, False)
    at = ref.quantize_1x128(outlier_tensor(256, rows.total, seed=3), E4M3)
    bt = ref.quantize_1x128(outlier_tensor(512, rows.total, seed=4), E4M3)
    dev = lambda pair: [t.to(device) for t in pair]  # noqa: E731
    a_t = ref.quantize_1x128(outlier_tensor(rows.total, 256, seed=5), E4M3)
    for transposed, lhs in ((False, a), (True, a_t)):
        got = backend.grouped_gemm_1x128_128x128(*dev(lhs), w, transposed, rows, torch.float32)
        want = REFERENCE.grouped_gemm_1x128_128x128(*lhs, w_ref, transposed, rows_cpu, torch.float32)
        for _, lo, hi in rows.segments:  # rows outside the segments are padding
            assert _relative_error(got[lo:hi], want[lo:hi]) <= 6e-4  # Hopper's FP8 MMA accumulation: 4.4e-4 seen
        end = rows.segments[-1][2]
        assert got.shape[0] == rows.total and torch.equal(got[end:].cpu(), torch.zeros_like(want[end:]))
    if backend.name != "reference":  # the empty expert's w^T was not made (the definition makes every expert's)
        assert backend.weight_transposed(w, rows.tile_count)[0][1].float().isnan().all()
    got = backend.grouped_gemm_1x128_1x128(*dev(at), *dev(bt), rows, len(counts), torch.float32)
    want = REFERENCE.grouped_gemm_1x128_1x128(*at, *bt, rows_cpu, len(counts), torch.float32)
    for e, _, _ in rows.segments:
        assert _relative_error(got[e], want[e]) <= 6e-4
    assert torch.equal(got[1].cpu(), torch.zeros_like(want[1]))  # the empty expert
    # added into an FP32 main_grad, as training runs it; the empty expert's left as it was
    main_grad = torch.randn(len(counts), 256, 512)
    added = backend.grouped_gemm_1x128_1x128(*dev(at), *dev(bt), rows, len(counts), torch.float32,
                                             accumulate=main_grad.to(device, copy=True)).cpu()
    for e, _, _ in rows.segments:
        assert _relative_error(added[e] - main_grad[e], want[e]) <= 6e-4
    assert torch.equal(added[1], main_grad[1])


def _rope_tables(head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    from megafp8.model.rope import RotaryEmbedding
    rope = RotaryEmbedding(head_dim, positions, 10000.0)
    return rope.cos, rope.sin


def test_every_custom_op_agrees_with_its_fake_implementation():
    """The ops a compiled graph records (`megafp8.precision.fp8_ops`) on the reference backend: `opcheck` runs each
    for real and through its fake implementation and compares shapes, dtypes and strides (which Inductor relies
    on and checks at run time)."""
    from megafp8.precision import fp8_ops

    x = outlier_tensor(200, 256)
    gu, da = outlier_tensor(200, 512, seed=1), outlier_tensor(200, 256, seed=2)
    w = outlier_tensor(384, 256, seed=3)
    norm_weight = torch.linspace(0.5, 1.5, 256).to(torch.bfloat16)
    a, a_scale = REFERENCE.quantize_rows(x, E4M3, False)
    qw = fp8_ops.quantize_weight(w, "e4m3", False, "reference")
    b, b_scale = REFERENCE.quantize_rows(w, E4M3, False)
    cases = [
        (fp8_ops.quantize_rows, (x, "e4m3", False, "reference")),
        (fp8_ops.quantize_rows_cols, (x, "e4m3", True, "reference")),
        (fp8_ops.rmsnorm_quantize, (x, norm_weight, 1e-5, "e4m3", False, "reference")),
        (fp8_ops.swiglu_quantize, (gu, "e4m3", False, "reference")),
        (fp8_ops.swiglu_backward_quantize, (gu, da, "e4m3", "e5m2", False, "reference")),
        (fp8_ops.swiglu_quantize_amax, (gu, "e4m3", False, "reference")),
        (fp8_ops.swiglu_backward_quantize, (gu, da, "e4m3", "e5m2", False, "reference",
                                            producers.tile_maxima(producers.swiglu(gu)))),
        (fp8_ops.rope_backward_quantize, (*_rope_gradients(200, (256, 128, 128)), *_rope_tables(64, 64), 64, 64,
                                          "e5m2", False, "reference")),
        (fp8_ops.quantize_weight, (w, "e4m3", False, "reference")),
        (fp8_ops.transpose_weight, (qw[0], qw[1], "reference")),
        (fp8_ops.gemm_1x128_128x128, (a, a_scale, qw[0], qw[1], torch.bfloat16, "reference")),
        (fp8_ops.gemm_1x128_1x128, (a, a_scale, b, b_scale, torch.float32, "reference")),
        *_grouped_op_cases(),
    ]
    for op, args in cases:
        torch.library.opcheck(op.op, args, test_utils=("test_faketensor",))


def _grouped_op_cases() -> list[tuple]:
    """The MoE experts' ops (`megafp8.precision.fp8_ops`, `megafp8.parallel.permute`) on a padded layout of three
    experts, one without rows."""
    from megafp8.parallel import permute
    from megafp8.precision import fp8_ops
    from megafp8.precision.grouped import add_experts_with_rows_into_, expert_rows, padded_source_index

    counts = [5, 0, 199]
    rows = expert_rows(counts, torch.device("cpu"))
    source = outlier_tensor(102, 256, seed=4)
    row_to_source = torch.arange(sum(counts)) % source.shape[0]
    index = padded_source_index(rows, row_to_source)
    x, x_scale, xt, xt_scale = fp8_ops.gather_quantize_rows_cols(source, index, "e4m3", False, "reference")
    _, _, dyt, dyt_scale = REFERENCE.quantize_rows_cols(outlier_tensor(rows.total, 384, seed=5), E5M2, False)
    w = fp8_ops.quantize_weight(outlier_tensor(3 * 384, 256, seed=6).view(3, 384, 256), "e4m3", False, "reference")
    tiles = (rows.tile_expert, rows.tile_start, rows.tile_count)
    pos = torch.randperm(rows.total)[:2 * 50].view(50, 2)
    y, weights = outlier_tensor(rows.total, 256, seed=7), torch.rand(50, 2)
    return [
        (fp8_ops.gather_quantize_rows_cols, (source, index, "e4m3", True, "reference")),
        (fp8_ops.gather_scale_quantize_rows_cols, (source, index, torch.rand(rows.total), "e5m2", False,
                                                   "reference")),
        (fp8_ops.transpose_weight, (w[0], w[1], "reference")),
        (fp8_ops.grouped_gemm_1x128_128x128, (x, x_scale, w[0], w[1], *tiles, torch.bfloat16, "reference")),
        (fp8_ops.grouped_gemm_1x128_1x128, (dyt, dyt_scale, xt, xt_scale, *tiles[1:], torch.float32, "reference")),
        (fp8_ops.grouped_gemm_1x128_1x128_accumulate_, (torch.zeros(3, 384, 256), dyt, dyt_scale, xt, xt_scale,
                                                        *tiles[1:], "reference")),
        (add_experts_with_rows_into_, (torch.zeros(3, 384, 256), torch.randn(3, 384, 256).bfloat16(),
                                       torch.tensor([5, 5, 204], dtype=torch.int32))),
        (permute._gather_sum_op, (y, pos)),
        (permute._combine_op, (y, pos, weights)),
        (permute._combine_backward_op, (outlier_tensor(50, 256, seed=8), y, pos, weights)),
        (permute.combine_weights_grad, (outlier_tensor(50, 256, seed=8), y, pos)),
    ]


def test_kernel_launchers_refuse_tensors_past_int32_offsets_before_launching():
    """The quantizing kernels address elements with int32 offsets: a tensor spanning 2^31 elements or more (65,536
    tokens x SwiGLU's 2 x 18,432, or its transpose) would wrap around and read or write the wrong memory without
    any error. The launchers refuse it first, naming the settings to lower; a stack of expert weights is checked
    one expert at a time (the kernels index experts in int64). Shapes only: meta tensors, nothing allocated."""
    from megafp8.precision.kernels.limits import check_offsets

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    check_offsets("fits", meta(65536, 32768), meta(32768, 65536))  # 2^31 elements: the last offset is 2^31 - 1
    with pytest.raises(ValueError, match="2,147,483,649 elements"):
        check_offsets("one more", meta(65537, 32768)[:, :1])  # the last element one past int32
    with pytest.raises(ValueError, match=r"swiglu: a \(65536, 36864\) tensor spans .*micro_batch_size"):
        check_offsets("swiglu", meta(65536, 36864))
    with pytest.raises(ValueError, match="2,415,919,104 elements"):
        check_offsets("x^T", meta(36864, 65536))
    with pytest.raises(ValueError):  # a strided view spans its storage's extent, not its element count
        check_offsets("view", meta(65536, 65536)[:, :128])
    check_offsets("one expert of 300", meta(300, 4096, 2048)[:1])
    check_offsets("no experts", meta(0, 4096, 2048)[:1])
    with pytest.raises(ValueError):
        check_offsets("all 300 experts", meta(300, 4096, 2048))


def test_the_triton_launchers_check_offsets_before_allocating_work_for_the_gpu():
    """The check is wired into the launchers (it raises on meta tensors before any kernel is launched)."""
    pytest.importorskip("triton")
    from megafp8.precision.kernels import producers as kp, quantize as kq

    big = torch.empty(65536, 36864, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="quantize_rows_cols"):
        kq.quantize_rows_cols(big, E4M3, False)
    with pytest.raises(ValueError, match="swiglu_quantize"):
        kp.swiglu_quantize(big, E4M3, False)
    with pytest.raises(ValueError, match="swiglu_backward_quantize"):
        kp.swiglu_backward_quantize(big, big[:, :18432], E4M3, E5M2, False)


@pytest.mark.parametrize("k_blocks", [3, 4], ids=["padded", "unpadded"])
def test_cublas_block_scales_are_k_major_with_zeroed_padding(k_blocks):
    """The cublas backend's 128x128 block scales: (K/128 padded to a multiple of 4, N/128), entry (n, k) at storage
    offset n * padded_k + k; the padding zeroed (the kernels write only the real entries)."""
    from megafp8.precision.backends.cublas_backend import _block_scales

    scales = _block_scales(5, k_blocks, torch.device("cpu"))
    assert scales.shape == (4, 5) and scales.stride() == (1, 4) and scales.dtype == torch.float32
    if k_blocks == 3:
        assert torch.equal(scales[3], torch.zeros(5))


@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2-scales"])
def test_x_in_128x128_blocks_for_wgrad_matches_the_reference(backend_on, pow2):
    """`precision.fp8_wgrad_input_blocks`: on a backend that takes it, x^T quantized in 128x128 blocks by the row +
    column quantizer (plain, gathering, and RMSNorm's given the kernel's own inverse RMS) gives the reference bits,
    and the wgrad GEMMs reading it (dense, into BF16 and added into FP32 main_grad; grouped by expert, with an empty
    expert and a partial tile) match the reference within FP32 accumulation. A backend that does not take it says
    so instead of computing with the wrong scales."""
    backend, device = backend_on
    x = outlier_tensor(200, 384, seed=11)
    dy = outlier_tensor(200, 256, seed=12)
    if not backend.wgrad_input_blocks:
        *_, dyt, dyt_s = ref.quantize_rows_cols(dy, E4M3)
        *_, xt, xt_s = ref.quantize_rows_cols(x, E4M3, cols_in_blocks=True)
        with pytest.raises(ValueError, match="precision.fp8_wgrad_input_blocks needs the hopper backend"):
            backend.gemm_1x128_1x128(dyt.to(device), dyt_s.to(device), xt.to(device), xt_s.to(device), torch.float32)
        return
    got = backend.quantize_rows_cols(x.to(device), E4M3, pow2, cols_in_blocks=True)
    want = ref.quantize_rows_cols(x, E4M3, pow2, cols_in_blocks=True)
    assert_same_quantization(got[:2], want[:2], "rows")
    assert_same_quantization(got[2:], want[2:], "x^T in blocks")
    index = torch.tensor([i * 7 % 200 if i % 5 else -1 for i in range(300)])
    got = backend.gather_quantize_rows_cols(x.to(device), index.to(device), E4M3, pow2, cols_in_blocks=True)
    gathered = torch.where((index >= 0)[:, None], x[index.clamp(min=0)], torch.zeros(()))
    assert_same_quantization(got[2:], ref.quantize_rows_cols(gathered, E4M3, pow2, cols_in_blocks=True)[2:],
                             "gathered x^T in blocks")
    h, norm_weight = outlier_tensor(256, 384, seed=13).bfloat16(), (torch.rand(384) + 0.5).bfloat16()
    *got, rstd = backend.rmsnorm_quantize(h.to(device), norm_weight.to(device), 1e-5, E4M3, pow2,
                                          cols_in_blocks=True)
    want = producers.rmsnorm_quantize(h, norm_weight, 1e-5, E4M3, pow2, rstd=rstd.cpu(), cols_in_blocks=True)
    assert_same_quantization(got[2:4], want[2:4], "RMSNorm's x^T in blocks")
    _check_swiglu_output_in_blocks(backend, device, pow2)
    # the GEMMs, on the reference's operands
    *_, dyt, dyt_s = ref.quantize_rows_cols(dy, E4M3, pow2)
    *_, xt, xt_s = ref.quantize_rows_cols(x, E4M3, pow2, cols_in_blocks=True)
    dev = [t.to(device) for t in (dyt, dyt_s, xt, xt_s)]
    want = REFERENCE.gemm_1x128_1x128(dyt, dyt_s, xt, xt_s, torch.float32)
    assert _relative_error(backend.gemm_1x128_1x128(*dev, torch.bfloat16), want) <= 4e-3  # BF16 output
    main_grad = torch.randn(256, 384)
    added = main_grad.to(device, copy=True)
    backend.gemm_1x128_1x128_accumulate_(added, *dev)
    assert _relative_error(added.cpu() - main_grad, want) <= 6e-4
    counts = [5, 0, 130, 1, 300]
    rows, rows_cpu = expert_rows(counts, device), expert_rows(counts, torch.device("cpu"))
    at = ref.quantize_1x128(outlier_tensor(256, rows.total, seed=14), E4M3)
    bt = ref.quantize_128x128(outlier_tensor(384, rows.total, seed=15), E4M3)
    want = REFERENCE.grouped_gemm_1x128_1x128(*at, *bt, rows_cpu, len(counts), torch.float32)
    main_grad = torch.randn(len(counts), 256, 384)
    added = backend.grouped_gemm_1x128_1x128(*[t.to(device) for t in (*at, *bt)], rows, len(counts), torch.float32,
                                             accumulate=main_grad.to(device, copy=True)).cpu()
    for e, _, _ in rows.segments:
        assert _relative_error(added[e] - main_grad[e], want[e]) <= 6e-4
    assert torch.equal(added[1], main_grad[1])  # the empty expert


def _check_swiglu_output_in_blocks(backend, device, pow2: bool) -> None:
    """SwiGLU's output a^T in 128x128 blocks (the down projection's wgrad input): the forward writes each 1x128
    tile's max |a| (its rows unchanged by it), and the backward, given them, makes a^T's block scales from them
    exactly (the max over a block's 128 tokens, then the scale) and a^T within one FP8 ULP of the definition (the
    kernels' exp is not torch's), its other outputs unchanged."""
    for m in (300, 256):  # a partial last token block, and none
        gu, da = outlier_tensor(m, 512, seed=16), outlier_tensor(m, 256, seed=17)
        plain = backend.swiglu_quantize(gu.to(device), E4M3, pow2)
        *rows, amax = backend.swiglu_quantize(gu.to(device), E4M3, pow2, row_amax=True)
        assert_same_quantization(rows, plain, "SwiGLU's rows with its tile maxima")
        assert amax.stride() == (1, m)  # tokens first, as the kernel reads a block's 128 tokens
        want_amax = producers.swiglu_quantize(gu, E4M3, pow2, row_amax=True)[2]
        assert int(float_ulps(amax.cpu(), want_amax).max()) <= PRODUCER_SCALE_ULPS, "tile maxima"
        tiles = backend.swiglu_backward_quantize(gu.to(device), da.to(device), E4M3, E5M2, pow2)
        got = backend.swiglu_backward_quantize(gu.to(device), da.to(device), E4M3, E5M2, pow2, amax)
        for i, part in ((0, "d(gu) rows"), (2, "d(gu) columns")):
            assert_same_quantization(got[i:i + 2], tiles[i:i + 2], f"{part} beside a^T in blocks")
        m_pad = -(-m // 128) * 128
        assert got[4].shape == (256, m_pad) and got[5].shape == (2, m_pad // 128)
        block_amax = torch.nn.functional.pad(amax.cpu(), (0, 0, 0, m_pad - m)).reshape(m_pad // 128, 128, 2)
        scale, _ = ref.scales_from_amax(block_amax.amax(dim=1).t(), E4M3, pow2)
        assert torch.equal(got[5].cpu(), scale), "a^T's block scales from the forward's tile maxima"
        want = producers.swiglu_backward_quantize(gu, da, E4M3, E5M2, pow2, want_amax)
        assert_within_one_fp8_ulp(got[4:], want[4:], PRODUCER_SCALE_ULPS, "SwiGLU output columns in blocks")
