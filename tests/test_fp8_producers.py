"""Producers that quantize their own FP32 output (RMSNorm, SwiGLU, SwiGLU's backward): their pure-torch twins
against torch's own definitions, and the fused FP8 MLP built on them against the layers run one by one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megafp8.parallel import swiglu_mlp
from megafp8.precision import E4M3, Fp8Recipe, PrecisionRecipe, WeightGradQueue, producers
from megafp8.precision import quantize as ref
from tests.fp8_checks import assert_within_one_fp8_ulp, outlier_tensor, run_with_grads, swiglu_mlp_layers

FP8 = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_rmsnorm_twin_is_torchs_rmsnorm_quantized_from_fp32():
    h = outlier_tensor(200, 384)
    w = torch.linspace(0.5, 1.5, 384).to(torch.bfloat16)
    *got, rstd = producers.rmsnorm_quantize(h, w, 1e-5, E4M3, False)
    y32 = F.rms_norm(h.float(), (384,), w.float(), 1e-5)
    want = ref.quantize_rows_cols(y32, E4M3)
    # torch's kernel sums the squares in its own order: a few FP32 ULPs, well within the contract.
    assert_within_one_fp8_ulp(got[:2], want[:2], 4, "rows")
    assert_within_one_fp8_ulp(got[2:], want[2:], 4, "columns")
    torch.testing.assert_close(rstd, torch.rsqrt(h.double().square().mean(-1) + 1e-5).float(), rtol=1e-6, atol=0)


def test_rmsnorm_backward_matches_autograd():
    h = torch.randn(64, 256, dtype=torch.float64, requires_grad=True)
    w = torch.linspace(0.5, 1.5, 256, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(64, 256, dtype=torch.float64)
    F.rms_norm(h, (256,), w, 1e-5).backward(dy)
    dh, dw = producers.rmsnorm_backward(h.detach(), w.detach(), producers.rms_inverse(h.detach(), 1e-5).double(), dy)
    assert rel_err(dh, h.grad) < 1e-6 and rel_err(dw, w.grad) < 1e-6


def test_swiglu_and_its_backward_match_autograd():
    gu = torch.randn(64, 512, dtype=torch.float64, requires_grad=True)
    gate, up = gu.chunk(2, dim=-1)
    a = F.silu(gate) * up
    da = torch.randn(64, 256, dtype=torch.float64)
    a.backward(da)
    assert rel_err(producers.swiglu(gu.detach()), a.detach()) < 1e-6
    assert rel_err(producers.swiglu_backward(gu.detach(), da), gu.grad) < 1e-6


def _mlp(seed=0, recipe=FP8):
    return swiglu_mlp_layers(recipe, 256, 384, 0.05, seed)


_run = run_with_grads


def test_fused_fp8_mlp_tracks_the_layers_run_one_by_one_and_float64():
    """The fused MLP differs from norm -> FP8 linear -> SwiGLU -> FP8 linear only in quantizing the norm's and
    SwiGLU's outputs (and SwiGLU's input gradient) from FP32 instead of from BF16."""
    gate_up, down, norm = _mlp()
    params = [norm.weight, gate_up.weight, down.weight]
    x0 = outlier_tensor(300, 256)  # 300 tokens: not a multiple of 128
    fused = _run(lambda x: swiglu_mlp(x, gate_up, down, norm), x0, params)

    def unfused(x):
        gate, up = gate_up(norm(x)).chunk(2, dim=-1)
        return down(F.silu(gate) * up)
    one_by_one = _run(unfused, x0, params)
    gate_up64, down64, norm64 = (m.double() for m in _mlp(recipe=PrecisionRecipe.from_name("fp32")))
    exact = _run(lambda x: swiglu_mlp(x, gate_up64, down64, norm64), x0.double(), [norm64.weight, gate_up64.weight,
                                                                                   down64.weight])
    for name, a, b, e in zip(("y", "dx", "d norm", "d gate_up", "d down"), fused, one_by_one, exact):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # Two FP8 GEMMs in a row on inputs with outliers: ~5% from float64 either way (measured 1.1-6.2%, BF16
        # 0.1-0.6%); the fused path is no worse, and ~2% from the unfused one (other roundings, same recipe).
        assert rel_err(b, e) < 0.08, name
        assert rel_err(a, e) < 1.05 * rel_err(b, e) + 2e-3, name
        assert rel_err(a, b) < 0.03, name


def test_fused_fp8_mlp_keeps_fp8_activations_and_quantizes_each_weight_once():
    gate_up, down, norm = _mlp()
    x = outlier_tensor(256, 256).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = swiglu_mlp(x, gate_up, down, norm)
    weights = {t.data_ptr() for layer in (gate_up, down) for t in (layer.weight, *layer.fp8_cache.entry.tensors())
               if t is not None}
    weights.add(norm.weight.data_ptr())
    kept = {t.data_ptr(): t for t in saved if t is not None and t.data_ptr() not in weights}
    kept_bytes = sum(t.numel() * t.element_size() for t in kept.values() if t.data_ptr() != x.data_ptr())
    # x^T in FP8 with its scales, gate/up's BF16 output, the norm's FP32 inverse RMS (and x itself); SwiGLU's output
    # is not kept: backward quantizes it again from gate/up's output.
    assert kept_bytes == 256 * 256 * (1 + 4 / 128) + 256 * 768 * 2 + 256 * 4
    y.sum().backward()
    swiglu_mlp(x, gate_up, down, norm).sum().backward()
    assert gate_up.fp8_cache.quantize_count == 1 and down.fp8_cache.quantize_count == 1


def test_fused_fp8_mlp_defers_both_weight_gradients():
    gate_up, down, norm = _mlp()
    queue = WeightGradQueue()
    for layer in (gate_up, down):
        layer.wgrad_queue = queue
        layer.weight.main_grad = torch.zeros(layer.weight.shape)
    x = outlier_tensor(128, 256).requires_grad_(True)
    swiglu_mlp(x, gate_up, down, norm).sum().backward()
    assert len(queue) == 2 and gate_up.weight.main_grad.abs().sum() == 0
    queue.take()()
    assert gate_up.weight.main_grad.abs().sum() > 0 and down.weight.main_grad.abs().sum() > 0


def test_fused_fp8_mlp_compiles_into_one_graph_with_the_eager_bits():
    gate_up, down, norm = _mlp()
    params = [norm.weight, gate_up.weight, down.weight]
    x0 = outlier_tensor(200, 256)

    def f(x):
        return swiglu_mlp(x, gate_up, down, norm) * 1.5
    assert torch._dynamo.explain(f)(x0.clone().requires_grad_(True)).graph_break_count == 0
    eager = _run(f, x0, params)
    torch._dynamo.reset()
    compiled = _run(torch.compile(f, backend="aot_eager"), x0, params)
    for name, a, b in zip(("y", "dx", "d norm", "d gate_up", "d down"), eager, compiled):
        assert torch.equal(a, b), name


def test_an_mlp_keeping_no_weight_transpose_gives_the_same_bits_eagerly_and_compiled():
    """`precision.fp8_keep_weight_transpose: false`: the weight caches hold w only, each dgrad GEMM gets w^T made in
    its backward (128x128 blocks are transpose-invariant), and every output and gradient keeps the default's bits,
    eagerly and in one compiled graph."""
    no_transpose = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference", keep_weight_transpose=False))
    kept_transpose = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference", keep_weight_transpose=True))
    x0 = outlier_tensor(200, 256)
    runs = {}
    for name, recipe in (("kept", kept_transpose), ("made in backward", no_transpose)):
        gate_up, down, norm = _mlp(recipe=recipe)
        params = [norm.weight, gate_up.weight, down.weight]

        def f(x):
            return swiglu_mlp(x, gate_up, down, norm) * 1.5
        runs[name] = _run(f, x0, params)
        held = [t for layer in (gate_up, down) for t in layer.fp8_cache.entry.tensors() if t is not None]
        assert len(held) == (8 if recipe is kept_transpose else 4), name
        if recipe is no_transpose:
            assert torch._dynamo.explain(f)(x0.clone().requires_grad_(True)).graph_break_count == 0
            torch._dynamo.reset()
            runs["compiled, made in backward"] = _run(torch.compile(f, backend="aot_eager"), x0, params)
            torch._dynamo.reset()
    for name, run in runs.items():
        for what, a, b in zip(("y", "dx", "d norm", "d gate_up", "d down"), runs["kept"], run):
            assert torch.equal(a, b), (name, what)


@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_a_projection_kept_in_bf16_runs_the_layers_one_by_one(which):
    gate_up, down, norm = _mlp()
    layer = gate_up if which == "gate_up" else down
    layer.set_recipe(FP8.high_precision())
    x = outlier_tensor(128, 256)
    gate, up = gate_up(x, norm).chunk(2, dim=-1)  # an FP8 gate_up still takes the norm into its quantizer
    assert torch.equal(swiglu_mlp(x, gate_up, down, norm), down(F.silu(gate) * up))


def test_compiled_fp8_mlp_adds_its_weight_gradients_into_main_grad_inside_the_graph(monkeypatch):
    """With an FP32 main_grad, the compiled MLP's wgrad GEMMs add into it inside the graph (into the alias each
    `prepare` hands out) and return no weight gradient; two micro-batches run forward, forward, backward, backward
    (a pipeline schedule's order, which the alias is there for) and leave exactly the eager run's main_grads."""
    from megafp8.precision.backends import Fp8Backend

    calls = []
    fused = Fp8Backend.gemm_1x128_1x128_accumulate_
    monkeypatch.setattr(Fp8Backend, "gemm_1x128_1x128_accumulate_",
                        lambda self, *args: calls.append(1) or fused(self, *args))
    x0 = [outlier_tensor(200, 256, seed=s) for s in (1, 2)]

    def run(compiled: bool) -> list[torch.Tensor]:
        gate_up, down, norm = _mlp()
        for layer in (gate_up, down):
            layer.weight.main_grad = torch.zeros(layer.weight.shape)

        def f(x):
            return (swiglu_mlp(x, gate_up, down, norm) * 1.5).float().square().mean()
        fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f

        def step(x):
            for layer in (gate_up, down):  # eagerly, as `Block.forward` does before its compiled code
                layer.prepare_for_compiled()
            return fn(x.clone().requires_grad_(True))
        losses = [step(x) for x in x0]
        for loss in losses:
            loss.backward()
        assert gate_up.weight.grad is None and down.weight.grad is None
        return [gate_up.weight.main_grad, down.weight.main_grad]

    eager = run(compiled=False)
    assert len(calls) == 4
    torch._dynamo.reset()
    compiled = run(compiled=True)
    assert len(calls) == 8  # the compiled graph ran the fused op, once per projection and micro-batch
    for a, b in zip(eager, compiled):
        assert a.abs().sum() > 0 and torch.equal(a, b)
