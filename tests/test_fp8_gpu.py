"""FP8 fast paths on the GPU against the reference backend (skipped without CUDA).

Quantization must match bit for bit (FP8 bytes and FP32 scales); GEMMs may differ only by
summation order, so they are compared within FP32 accumulation tolerance.
"""
from __future__ import annotations

import pytest
import torch

from megafp8.precision import E4M3, E5M2, Fp8Recipe, PrecisionRecipe, select_backend, why_unavailable
from megafp8.precision import quantize as ref
from megafp8.precision.backends import Fp8Backend

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
REFERENCE = Fp8Backend()


def fast_backends():
    names = [n for n in ("triton", "cublas") if why_unavailable(n, CUDA) is None]
    assert "triton" in names, why_unavailable("triton", CUDA)
    return [select_backend(n, CUDA) for n in names]


def outlier_tensor(m, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device=CUDA, generator=g)
    x[:, 5] *= 300.0  # an outlier channel
    x[7 % m, :128] = 0.0  # a zero tile
    x[9 % m, 130 % k] = 1e-30  # a tiny value
    if k >= 384:
        x[11 % m, 256:384] = torch.randn(128, device=CUDA, generator=g) * 1e-37  # a tile below MIN_AMAX
    return x.to(torch.bfloat16)


def assert_same_quantization(got, want):
    q, s = got
    q_ref, s_ref = want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    diff = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert len(diff) == 0, f"{len(diff)} FP8 bytes differ, first at {diff[:3].tolist()}: " \
        f"{q[tuple(diff[0])].float().item()} vs reference {q_ref[tuple(diff[0])].float().item()}"
    assert torch.equal(s.contiguous(), s_ref.contiguous()), "scales differ"


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantizers_match_reference_bit_for_bit(fmt, pow2):
    x = outlier_tensor(384, 512)
    w = outlier_tensor(256, 512, seed=1)
    for backend in fast_backends():
        assert_same_quantization(backend.quantize_tiles(x, fmt, pow2), ref.quantize_1x128(x, fmt, pow2))
        assert_same_quantization(backend.quantize_tiles_transposed(x, fmt, pow2),
                                 ref.quantize_1x128_transposed(x, fmt, pow2))
        got = backend.quantize_blocks_with_transpose(w, fmt, pow2)
        want = REFERENCE.quantize_blocks_with_transpose(w, fmt, pow2)
        assert_same_quantization(got[:2], want[:2])
        assert_same_quantization(got[2:], want[2:])
        assert_same_quantization(backend.quantize_blocks(w, fmt, pow2), want[:2])  # without the transpose
        q, s = ref.quantize_1x128(x, fmt, pow2)
        assert_same_quantization(backend.retile_transposed(q, s, fmt, pow2), ref.retile_1x128_transposed(q, s, fmt, pow2))


@pytest.mark.parametrize("m", [384, 200, 1])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_fused_row_and_column_quantization_matches_reference_bit_for_bit(m, fmt, pow2):
    """The output gradient's two quantizations from one read (dgrad tiles, and wgrad tiles of dy^T padded to 128
    tokens) equal the reference's; a nan surfaces in both."""
    x = outlier_tensor(m, 512)
    want = REFERENCE.quantize_tiles_both(x, fmt, pow2)
    x_nan = x.clone()
    x_nan[m // 2, 300] = float("nan")
    for backend in fast_backends():
        got = backend.quantize_tiles_both(x, fmt, pow2)
        assert_same_quantization(got[:2], want[:2])
        assert_same_quantization(got[2:], want[2:])
        q, s, qt, st = backend.quantize_tiles_both(x_nan, fmt, pow2)
        rows, cols = ref.dequantize_1x128(q, s), ref.dequantize_1x128(qt, st)
        tile = (m // 2) // 128 * 128  # the token tile holding the nan
        assert not torch.isfinite(rows[m // 2, 256:384]).all()
        assert not torch.isfinite(cols[300, tile:tile + 128]).all()
        assert torch.isfinite(rows[(m // 2 + 1) % m]).all() or m == 1


@pytest.mark.parametrize("pow2", [False, True])
def test_every_autotuned_configuration_of_the_fused_quantizer_gives_the_reference_bits(pow2):
    """The autotuner may pick any configuration of `quantize_both`: each one must produce the reference's bits."""
    from megafp8.precision import triton_kernels as tk

    x = outlier_tensor(200, 384)
    x_nan = x.clone()
    x_nan[150, 5] = float("nan")
    want = REFERENCE.quantize_tiles_both(x, E4M3, pow2)
    for config in tk.BOTH_CONFIGS:
        got = tk.quantize_both(x, E4M3, pow2, config=config)
        assert_same_quantization(got[:2], want[:2])
        assert_same_quantization(got[2:], want[2:])
        q, s, qt, st = tk.quantize_both(x_nan, E4M3, pow2, config=config)
        assert not torch.isfinite(ref.dequantize_1x128(q, s)[150, :128]).all()
        assert not torch.isfinite(ref.dequantize_1x128(qt, st)[5, 128:256]).all()
        assert torch.isfinite(ref.dequantize_1x128(qt, st)[6]).all()


def ties_tensor(fmt):
    """(128, 256): in every row, a tile of the format's maximum and every midpoint between neighbouring FP8 values
    (subnormal ones included), and the same negated; at scale 1 each midpoint is a tie to round to the even side."""
    grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # sorted non-negative FP8 values
    ties = (grid[:-1] + grid[1:]) / 2  # exact in BF16 (one more mantissa bit than the format)
    tile = torch.cat([torch.tensor([fmt.max]), ties, grid])[:128]
    x = torch.cat([tile, -tile]).repeat(128, 1).to(CUDA, torch.bfloat16)
    assert torch.equal(x[0, 1:len(ties) + 1].float().cpu(), ties)
    return x


@pytest.mark.parametrize("explicit_round", [True, False], ids=["explicit-rounding", "cast-rounding"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_both_fp8_roundings_of_every_quantizer_give_the_reference_bits(fmt, explicit_round):
    """Each Triton quantizer, with the FP8 rounding done explicitly in FP32 or by the conversion instruction, on
    outliers, tiny and zero tiles, and on every tie (subnormal ties too): the reference's bits."""
    from megafp8.precision import triton_kernels as tk

    for x in (outlier_tensor(200, 384), ties_tensor(fmt)):
        x128 = ref.pad_rows(x, -x.shape[0] % 128, 0.0)
        for pow2 in (False, True):
            rows, cols = ref.quantize_1x128(x, fmt, pow2), ref.quantize_1x128_transposed(x128, fmt, pow2)
            assert_same_quantization(tk.quantize_rows(x, fmt, pow2, explicit_round=explicit_round), rows)
            assert_same_quantization(tk.quantize_cols(x128, fmt, pow2, explicit_round=explicit_round), cols)
            both = tk.quantize_both(x, fmt, pow2, explicit_round=explicit_round)
            assert_same_quantization(both[:2], rows)
            assert_same_quantization(both[2:], cols)
            q, s = ref.quantize_1x128(x128, fmt, pow2)
            assert_same_quantization(tk.quantize_cols(q, fmt, pow2, in_scale=s, explicit_round=explicit_round),
                                     ref.retile_1x128_transposed(q, s, fmt, pow2))
            if x.shape[0] % 128 == 0:
                assert_same_quantization(tk.quantize_blocks(x, fmt, pow2, transpose=False,
                                                            explicit_round=explicit_round),
                                         ref.quantize_128x128(x, fmt, pow2))


def test_non_finite_inputs_surface_on_gpu():
    x = torch.randn(128, 256, device=CUDA, dtype=torch.bfloat16)
    x[3, 7] = float("inf")
    x[100, 200] = float("nan")
    for backend in fast_backends():
        q, s = backend.quantize_tiles(x, E4M3, False)
        deq = ref.dequantize_1x128(q, s)
        assert not torch.isfinite(deq[3, :128]).all() and not torch.isfinite(deq[100, 128:]).all()
        assert torch.isfinite(deq[50]).all()


# Odd row counts (1, 5, 129) are what MoE experts get; cuBLAS needs them padded to a multiple of 4.
@pytest.mark.parametrize("m, k, n", [(256, 512, 384), (2048, 1024, 2048), (1, 256, 128), (5, 256, 128), (129, 512, 256)])
def test_gemms_match_reference_within_accumulation_tolerance(m, k, n):
    a = ref.quantize_1x128(outlier_tensor(m, k), E4M3)
    b_blocks = ref.quantize_128x128(outlier_tensor(n, k, seed=2), E4M3)
    b_tiles = ref.quantize_1x128(outlier_tensor(n, k, seed=3), E4M3)
    for backend in fast_backends():
        for b, blockwise in ((b_blocks, True), (b_tiles, False)):
            b_fast = (b[0], backend.block_scales_for_gemm(b[1])) if blockwise else b
            for out_dtype in (torch.bfloat16, torch.float32):
                got = backend.gemm(*a, *b_fast, blockwise, out_dtype)
                want = REFERENCE.gemm(*a, *b, blockwise, torch.float32)
                assert got.dtype == out_dtype and got.shape == (m, n)
                err = (got.float() - want).norm() / want.norm()
                # FP32 out: beyond summation order, Hopper's FP8 MMA (cuBLAS and Triton alike) keeps fewer
                # accumulator bits within a 128-wide K block (the effect DeepSeek-V3 reports), ~1e-4 relative.
                # BF16 out: one rounding to 8 mantissa bits (2^-9 relative, ~2e-3 RMS).
                limit = 4e-3 if out_dtype == torch.bfloat16 else 3e-4
                assert err < limit, f"{backend.name} blockwise={blockwise} {out_dtype}: rel err {err:.2e}"


def test_fp8_linear_on_gpu_matches_reference_backend():
    from megafp8.parallel import ColumnParallelLinear

    torch.manual_seed(0)
    x = torch.randn(4, 256, 512, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    results = {}
    for name in ["reference"] + [b.name for b in fast_backends()]:
        layer = ColumnParallelLinear(512, 384, PrecisionRecipe.from_name("fp8", Fp8Recipe(backend=name)), device=CUDA)
        torch.manual_seed(1)
        with torch.no_grad():
            layer.weight.normal_(0, 0.02)
        x.grad = None
        y = layer(x)
        y.backward(torch.ones_like(y) * 0.01)
        results[name] = (y.float(), x.grad.float(), layer.weight.grad.float())
    for name, outs in results.items():
        for got, want, what in zip(outs, results["reference"], ("y", "dx", "dw")):
            err = (got - want).norm() / want.norm()
            assert err < 5e-3, f"{name} {what}: rel err {err:.2e} vs reference backend"


def test_compiled_fp8_linear_on_gpu_equals_eager():
    """Under torch.compile the FP8 linear is custom ops inside the graph; on each GPU backend they compute the eager
    path's exact bits (y, dx, dw), 300 tokens (not a multiple of 128), Inductor compiling the code around it, with
    the weight quantized in the graph or read from a cache prepared before (as a compiled block does)."""
    from megafp8.precision.fp8_linear import Fp8GemmConfig, Fp8WeightCache, fp8_linear

    cfg = Fp8GemmConfig.from_names("e4m3", "e4m3", False, True, True, True)
    torch.manual_seed(0)
    w0 = torch.randn(384, 512, device=CUDA).mul(0.02).to(torch.bfloat16)
    x0 = torch.randn(3, 100, 512, device=CUDA, dtype=torch.bfloat16)
    for backend in fast_backends():
        for prepared in (False, True):  # the graph quantizes the weight, or reads a cache prepared eagerly
            cache = Fp8WeightCache()

            def f(x, w):
                return fp8_linear(x, w, cache, cfg, backend)

            runs = []
            for fn in (f, torch.compile(f)):
                torch._dynamo.reset()
                x, w = x0.clone().requires_grad_(True), torch.nn.Parameter(w0.clone())
                cache.clear()
                if prepared and fn is not f:
                    cache.prepare(w, backend, cfg.fmt, cfg.power_of_two)
                y = fn(x, w)
                y.backward(torch.ones_like(y) * 0.01)
                runs.append((y, x.grad, w.grad))
            for got, want, what in zip(runs[1], runs[0], ("y", "dx", "dw")):
                assert torch.equal(got, want), f"{backend.name} {what} differs compiled (prepared cache: {prepared})"
            graphs = torch._dynamo.explain(f)(x0, w).graphs  # w: the compiled run's weight, its cache prepared
            code = "\n".join(g.print_readable(print_output=False) for g in graphs)
            assert "megafp8.fp8_fprop" in code and ("megafp8.fp8_weight" in code) != prepared


def test_fp8_training_on_gpu_learns(tiny_overrides):
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["training.steps=12"])
    trainer = Trainer(cfg, ParallelDims.single(), CUDA)
    assert trainer.model.layers[0].mlp.down_proj._fp8_backend is None  # resolved lazily, logged at build
    losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
    assert trainer.model.layers[0].mlp.down_proj._fp8_backend.name in ("cublas", "triton")
    assert losses[-1] < losses[0] - 1.0, losses


def test_grouped_expert_gemms_match_reference():
    """The Triton grouped GEMMs (fprop/dgrad over 128-row expert tiles, k-grouped wgrad) against the reference
    backend's per-expert loop, on counts that include an empty expert, a single row and a partial tile."""
    from megafp8.precision.grouped import expert_rows

    counts = [5, 0, 130, 1, 300]
    rows = expert_rows(counts, CUDA)
    a = ref.quantize_1x128(outlier_tensor(rows.total, 512), E4M3)
    w = outlier_tensor(len(counts) * 256, 512, seed=2)
    w_fp8, w_scale = ref.quantize_128x128(w, E4M3)
    w_fp8, w_scale = w_fp8.view(len(counts), 256, 512), w_scale.view(len(counts), 2, 4)
    at = ref.quantize_1x128(outlier_tensor(256, rows.total, seed=3), E4M3)
    bt = ref.quantize_1x128(outlier_tensor(512, rows.total, seed=4), E4M3)
    for backend in fast_backends():
        for got, want in (
            (backend.grouped_gemm(*a, w_fp8, w_scale, rows, torch.float32),
             REFERENCE.grouped_gemm(*a, w_fp8, w_scale, rows, torch.float32)),
            (backend.grouped_wgrad(*at, *bt, rows, len(counts), torch.float32),
             REFERENCE.grouped_wgrad(*at, *bt, rows, len(counts), torch.float32)),
        ):
            assert got.shape == want.shape
            for e, lo, hi in rows.segments:  # rows outside the segments are padding
                g, r = (got[lo:hi], want[lo:hi]) if got.dim() == 2 else (got[e], want[e])
                assert (g - r).norm() <= 3e-4 * r.norm(), (backend.name, e)
            if got.dim() == 3:
                assert torch.equal(got[1], torch.zeros_like(got[1]))  # the empty expert
