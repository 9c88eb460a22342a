"""`precision.fp8_wgrad_input_blocks` on the CPU (the reference backend): the weight gradient's input x quantized
in 128x128 blocks instead of 1x128 tiles along the tokens, from the quantizer through the GEMMs, eager and
compiled, and the backends that refuse it. (The Gluon quantizer and the warp-specialized GEMMs that run it on SM90
are checked against these definitions by `tests/test_fp8_gpu.py` and `tests/test_gluon_kernels_gpu.py`.)"""
from __future__ import annotations

import logging

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.parallel import ColumnParallelLinear
from megafp8.precision import E4M3, Fp8Recipe, PrecisionRecipe
from megafp8.precision import quantize as ref
from megafp8.precision.backends import Fp8Backend
from megafp8.precision.backends.cublas_backend import CublasBackend
from megafp8.precision.backends.hopper_backend import HopperBackend
from megafp8.precision.backends.triton_backend import TritonBackend
from megafp8.precision.expert_layout import expert_rows


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m", [256, 200], ids=["whole_token_blocks", "partial_last_block"])
def test_x_transposed_in_blocks_is_the_weight_quantizer_applied_to_the_padded_transpose(m):
    """One scale per 128 features x 128 tokens, (K/128, M_pad/128) column-major, and x^T's bytes those of the
    128x128 block quantizer applied to x^T with the rows padded by zeros; the rows' quantization is unchanged."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(m, 384, generator=g) * torch.exp(torch.randn(384, generator=g))).bfloat16()
    q, s, qt, st = ref.quantize_rows_cols(x, E4M3, cols_in_blocks=True)
    q1, s1, qt1, st1 = ref.quantize_rows_cols(x, E4M3)
    assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1)
    padded = torch.cat([x.float(), x.new_zeros(-m % 128, 384).float()])
    want_q, want_s = ref.quantize_128x128(padded.t().contiguous(), E4M3)
    assert qt.shape == qt1.shape == (384, 256)
    assert torch.equal(qt.view(torch.uint8), want_q.view(torch.uint8))
    assert st.shape == (3, 2) and st.stride() == (1, 3) and torch.equal(st, want_s)
    assert ref.scales_in_blocks(qt, st) and not ref.scales_in_blocks(qt1, st1)
    # Each block's scale is the largest of its 1x128 tiles' scales: coarser, never finer
    assert torch.equal(st, st1.reshape(3, 128, 2).amax(dim=1))


def test_the_fused_rmsnorm_quantizer_takes_the_same_block_layout():
    from megafp8.precision import producers
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(256, 256, generator=g).bfloat16(), torch.rand(256, generator=g).bfloat16() + 0.5
    *parts, rstd = producers.rmsnorm_quantize(h, w, 1e-5, E4M3, False, cols_in_blocks=True)
    y32 = h.float() * rstd.unsqueeze(-1) * w.float()
    for got, want in zip(parts, ref.quantize_rows_cols(y32, E4M3, cols_in_blocks=True)):
        assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3.dtype else got,
                           want.view(torch.uint8) if want.dtype == E4M3.dtype else want)


def test_the_reference_wgrads_read_either_layout_by_its_scales():
    """Dense and grouped (per expert's rows) weight gradients with x^T in blocks: the product of the dequantized
    operands, and within FP8's error of the exact dy^T x."""
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(512, 256, generator=g).bfloat16(), torch.randn(512, 384, generator=g).bfloat16()
    backend = Fp8Backend()
    *_, dyt, dyt_s = ref.quantize_rows_cols(dy, E4M3)
    *_, xt, xt_s = ref.quantize_rows_cols(x, E4M3, cols_in_blocks=True)
    want = ref.dequantize_1x128(dyt, dyt_s) @ ref.dequantize_128x128(xt, xt_s).t()
    assert torch.equal(backend.gemm_1x128_1x128(dyt, dyt_s, xt, xt_s, torch.float32), want)
    out = torch.ones(384, 256)
    backend.gemm_1x128_1x128_accumulate_(out, dyt, dyt_s, xt, xt_s)
    assert torch.equal(out, want + 1)
    assert rel_err(want, dy.double().t() @ x.double()) < 0.05
    rows = expert_rows([256, 0, 256], x.device)  # an expert with no rows gets a zero gradient
    grouped = backend.grouped_gemm_1x128_1x128(dyt, dyt_s, xt, xt_s, rows, 3, torch.float32)
    for e, lo, hi in ((0, 0, 256), (2, 256, 512)):
        one = ref.dequantize_1x128(dyt[:, lo:hi], dyt_s[:, lo // 128:hi // 128]) @ \
            ref.dequantize_128x128(xt[:, lo:hi], xt_s[:, lo // 128:hi // 128]).t()
        assert torch.equal(grouped[e], one)
    assert torch.equal(grouped[1], torch.zeros(384, 256))


def _layer(blocks: bool) -> ColumnParallelLinear:
    recipe = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference", wgrad_input_blocks=blocks))
    layer = ColumnParallelLinear(256, 384, recipe)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(384, 256, generator=torch.Generator().manual_seed(3)) * 0.05).bfloat16())
    return layer


def test_an_fp8_linear_with_x_in_blocks_changes_only_its_weight_gradient():
    """The opt-in changes x^T's quantization and nothing else: the output and the input gradient keep the default
    recipe's bits, and dW is the blocks' GEMM, within FP8's error of the exact one."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 256, generator=g).bfloat16()
    dy = torch.randn(300, 384, generator=g).bfloat16()
    results = []
    for blocks in (False, True):
        layer = _layer(blocks)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        results.append((y, xi.grad, layer.weight.grad))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert not torch.equal(dw0, dw1)
    exact = dy.double().t() @ x.double()
    assert rel_err(dw1, exact) < 0.05 and rel_err(dw0, exact) < 0.05


def test_a_compiled_fp8_linear_with_x_in_blocks_keeps_the_eager_bits():
    """The custom ops' fake outputs give the blocks' scale shape: traced without a graph break, the same bits."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    x0, dy = torch.randn(200, 256, generator=g).bfloat16(), torch.randn(200, 384, generator=g).bfloat16()

    def run(layer_fn):
        layer = _layer(True)
        x = x0.clone().requires_grad_()
        y = layer_fn(layer)(x)
        y.backward(dy)
        return y.detach(), x.grad, layer.weight.grad

    eager = run(lambda layer: layer)
    torch._dynamo.reset()
    compiled = run(lambda layer: torch.compile(layer, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_a_compiled_fp8_mlp_with_its_wgrads_inputs_in_blocks_keeps_the_eager_bits():
    """The fused SwiGLU MLP traced whole: SwiGLU's tile maxima (the op `swiglu_quantize_amax`) and a^T's block
    scales have fake shapes a graph accepts, and the compiled MLP gives the eager bits."""
    from megafp8.parallel import swiglu_mlp
    from tests.fp8_checks import run_with_grads, swiglu_mlp_layers

    recipe = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference", wgrad_input_blocks=True))
    gate_up, down, norm = swiglu_mlp_layers(recipe, 256, 384, 0.05, 2)
    params = [norm.weight, gate_up.weight, down.weight]
    x0 = torch.randn(2, 100, 256, generator=torch.Generator().manual_seed(6)).bfloat16()

    def f(x):
        return swiglu_mlp(x, gate_up, down, norm)
    eager = run_with_grads(f, x0, params, dy_scale=0.01)
    torch._dynamo.reset()
    compiled = run_with_grads(torch.compile(f, backend="aot_eager", fullgraph=True), x0, params, dy_scale=0.01)
    torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def _swiglu_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gu = (torch.randn(200, 512, generator=torch.Generator().manual_seed(8)) * 2).bfloat16()
    return gu, torch.randn(200, 256, generator=torch.Generator().manual_seed(9)).bfloat16()


def test_swiglus_output_in_blocks_is_the_block_quantizer_of_a():
    """The reference: the forward's tile maxima are max |a| per 1x128 tile, tokens first; given them, a^T in blocks
    is `quantize_rows_cols(a, cols_in_blocks=True)`'s and the other outputs are unchanged; tile maxima laid out
    otherwise are refused."""
    from megafp8.precision import producers

    gu, da = _swiglu_inputs()
    q, s, amax = producers.swiglu_quantize(gu, E4M3, False, row_amax=True)
    assert amax.shape == (200, 2) and amax.stride() == (1, 200)
    assert torch.equal(amax, producers.swiglu(gu).abs().reshape(200, 2, 128).amax(-1))
    tiles = producers.swiglu_backward_quantize(gu, da, E4M3, E4M3, False)
    blocks = producers.swiglu_backward_quantize(gu, da, E4M3, E4M3, False, amax)
    for a, b in zip(tiles[:4], blocks[:4]):
        assert torch.equal(a, b)
    for a, b in zip(blocks[4:], ref.quantize_rows_cols(producers.swiglu(gu), E4M3, cols_in_blocks=True)[2:]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="tile maxima"):
        producers.swiglu_backward_quantize(gu, da, E4M3, E4M3, False, amax.contiguous())


def test_the_triton_swiglu_kernels_refuse_its_output_in_blocks_with_what_to_change(monkeypatch):
    """Off SM90 (no Gluon column kernel) the Triton kernels refuse a^T in blocks before launching anything, instead
    of writing tiles where block scales are expected."""
    pytest.importorskip("triton")
    from megafp8.precision import producers
    from megafp8.precision.kernels import producers as kernels, tiles

    monkeypatch.setattr(tiles, "hopper_gluon", lambda device, module: None)
    gu, da = _swiglu_inputs()
    amax = producers.swiglu_quantize(gu, E4M3, False, row_amax=True)[2]
    with pytest.raises(ValueError, match="the hopper backend"):
        kernels.swiglu_backward_quantize(gu, da, E4M3, E4M3, False, amax)


def test_backends_whose_wgrads_read_tiles_only_refuse_the_blocks_with_what_to_change():
    recipe = Fp8Recipe(backend="reference", wgrad_input_blocks=True)
    recipe.check_backend(Fp8Backend())
    assert HopperBackend.wgrad_input_blocks and not TritonBackend.wgrad_input_blocks
    for cls in (TritonBackend, CublasBackend):
        with pytest.raises(ConfigError, match=f"the {cls.name} backend.*precision.fp8_backend=hopper"):
            recipe.check_backend(cls.__new__(cls))  # (unbuilt: building one needs a GPU)
    Fp8Recipe(wgrad_input_blocks=False).check_backend(CublasBackend.__new__(CublasBackend))


def test_each_backend_tells_the_layouts_apart_by_the_scales_and_refuses_what_it_cannot_read():
    """The GPU backends' wgrads dispatch on `_x_in_blocks`: x^T's layout read off its scales, block scales refused by
    a backend whose wgrads read 1x128 tiles only (the error the GPU conformance test expects). Unbuilt backends: the
    check is plain Python."""
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(6)).bfloat16()
    tiles = ref.quantize_rows_cols(x, E4M3)[2:]
    blocks = ref.quantize_rows_cols(x, E4M3, cols_in_blocks=True)[2:]
    hopper = HopperBackend.__new__(HopperBackend)
    assert hopper._x_in_blocks(*blocks) and not hopper._x_in_blocks(*tiles)
    for cls in (TritonBackend, CublasBackend):
        backend = cls.__new__(cls)
        assert not backend._x_in_blocks(*tiles)
        with pytest.raises(ValueError, match=f"the {cls.name} backend's weight-gradient GEMMs read x\\^T in 1x128 "
                                             "tiles only; precision.fp8_wgrad_input_blocks needs the hopper"):
            backend._x_in_blocks(*blocks)


def _fp8_config(tiny_overrides, blocks: bool, *extra: str, model: str = "tiny_dense"):
    return load_config(model, tiny_overrides + [
        "precision.recipe=fp8", "precision.fp8_backend=reference", f"precision.fp8_wgrad_input_blocks={blocks}",
        *extra])


def test_the_config_switch_reaches_the_recipe(tiny_overrides):
    assert PrecisionRecipe.from_config(_fp8_config(tiny_overrides, True).precision).fp8.wgrad_input_blocks
    assert not PrecisionRecipe.from_config(_fp8_config(tiny_overrides, False).precision).fp8.wgrad_input_blocks


def _record_wgrad_layouts(monkeypatch) -> list:
    """Patch the reference backend's weight-gradient GEMMs (dense into a new tensor or into main_grad, grouped) to
    note, call by call, (grouped, x^T's rows: the features, whether x^T came in 128x128 blocks by its scales)."""
    seen, depth = [], [0]

    def spy(name: str, b_at: int):
        original = getattr(Fp8Backend, name)

        def wrapped(self, *args, **kwargs):
            b, b_scale = args[b_at], args[b_at + 1]
            if not depth[0]:  # not the reference's grouped GEMM calling its dense one per expert
                seen.append((name.startswith("grouped"), b.shape[0], ref.scales_in_blocks(b, b_scale)))
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        monkeypatch.setattr(Fp8Backend, name, wrapped)

    spy("gemm_1x128_1x128", 2)
    spy("gemm_1x128_1x128_accumulate_", 3)
    spy("grouped_gemm_1x128_1x128", 2)
    return seen


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe_fp8"])
def test_a_tiny_model_trains_with_x_in_blocks_as_it_does_with_tiles(tiny_overrides, model, caplog, monkeypatch):
    """A few optimizer steps of a tiny FP8 model, dense and MoE (reference backend, CPU): the losses track the
    default recipe's closely (the blocks change only the weight gradients' rounding), and the first, which no weight
    gradient has touched yet, is the same. With the switch on every dense FP8 weight gradient reads x^T in blocks
    (the norms' outputs, the linears' own inputs, SwiGLU's outputs), and so do the experts' gate/up projections
    (their gathered rows); the experts' down projections keep SwiGLU's output in tiles (measured no faster in
    blocks). Off, none reads blocks. The run's start-up line says the recipe left DeepSeek-V3's tiles."""
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    losses, said, layouts = {}, {}, {}
    for blocks in (False, True):
        torch.manual_seed(0)
        cfg = _fp8_config(tiny_overrides, blocks, "training.steps=4", "optimizer.warmup_steps=1",
                          f"run_name=blocks_{blocks}", model=model)
        caplog.clear()
        with caplog.at_level(logging.INFO), monkeypatch.context() as patch:
            seen = _record_wgrad_layouts(patch)
            records = Trainer(cfg, ParallelDims.single(), torch.device("cpu")).fit()
        losses[blocks] = [r["loss"] for r in records if r["kind"] == "train"]
        said[blocks] = "the wgrads' x in 128x128 blocks" in caplog.text
        layouts[blocks] = set(seen)
    assert said == {False: False, True: True}
    assert {blocks for *_, blocks in layouts[False]} == {False}
    assert {blocks for grouped, _, blocks in layouts[True] if not grouped} == {True}
    grouped = {(features, blocks) for is_grouped, features, blocks in layouts[True] if is_grouped}
    if model == "tiny_moe_fp8":  # the experts: gate/up's input in blocks, down's in tiles
        assert len(grouped) == 2 and {blocks for _, blocks in grouped} == {True, False}
    else:
        assert not grouped
    tiles, blocks = losses[False], losses[True]
    assert len(tiles) == len(blocks) == 4
    assert tiles[0] == blocks[0] and tiles != blocks
    assert all(abs(a - b) < 0.02 * abs(a) for a, b in zip(tiles, blocks)), (tiles, blocks)
    assert blocks[-1] < blocks[0]
