"""The FP8 linear on the reference backend: accuracy against BF16 and float64, weight caching, saved
activations, FP32 gradient accumulation, per-GEMM switches, the layer plan and bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megafp8.config import ConfigError, load_config
from megafp8.model import Fp8Converter, Transformer
from megafp8.parallel import ColumnParallelLinear, ParallelDims
from megafp8.precision import E4M3, Fp8Recipe, PrecisionRecipe, select_backend
from megafp8.precision.quantize import dequantize_1x128, quantize_1x128

# Tolerance: E4M3 keeps 3 mantissa bits, so each operand element carries a rounding error of up to
# 2^-4 relative (about 2.4% RMS for values spread over a binade); two quantized operands give ~3.5% RMS
# relative error in a GEMM result, whatever K is (errors add incoherently, like the signal). We assert 5%.
FP8_REL_TOL = 0.05
BF16_REL_TOL = 0.005  # 8 mantissa bits: ~0.3% measured


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fp8_layer(k, n, weight, **recipe):
    layer = ColumnParallelLinear(k, n, PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference", **recipe)))
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def inputs(kind: str, m=512, k=256, n=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if kind == "outliers":  # an outlier channel and an outlier token, as in real activations
        x[:, 7] *= 100.0
        x[13] *= 50.0
    return x, torch.randn(n, k, generator=g) * 0.05, torch.randn(m, n, generator=g)


@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_fp8_linear_tracks_bf16_and_float64(kind):
    x, w, dy = inputs(kind)
    exact = (x.double() @ w.double().t(), dy.double() @ w.double(), dy.double().t() @ x.double())
    xb = x.bfloat16().requires_grad_()
    wb = w.bfloat16().requires_grad_()
    (xb @ wb.t()).backward(dy.bfloat16())
    bf16 = ((xb.detach() @ wb.detach().t()), xb.grad, wb.grad)
    layer = fp8_layer(256, 384, w.bfloat16())
    xf = x.bfloat16().requires_grad_()
    y = layer(xf)
    y.backward(dy.bfloat16())
    fp8 = (y, xf.grad, layer.weight.grad)
    for name, got, ref16, ref64 in zip(("y", "dx", "dw"), fp8, bf16, exact):
        assert got.dtype == torch.bfloat16
        assert rel_err(ref16, ref64) < BF16_REL_TOL, name
        assert rel_err(got, ref64) < FP8_REL_TOL, f"{name}: {rel_err(got, ref64):.4f}"
        assert rel_err(got, ref16) < FP8_REL_TOL, name


def test_per_tile_scaling_confines_an_extreme_outlier_to_its_tile():
    """With one channel 1e5 times larger, per-tensor scaling pushes every other value below E4M3's smallest
    subnormal; per-tile scaling leaves the tiles without the outlier at the format's usual ~2.5% error."""
    x, _, _ = inputs("random")
    x[:, 7] *= 1e5
    per_tile = dequantize_1x128(*quantize_1x128(x, E4M3))
    scale = x.abs().max() / 448.0
    per_tensor = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert rel_err(per_tile[:, 128:], x[:, 128:]) < 0.03
    assert rel_err(per_tensor[:, 128:], x[:, 128:]) > 0.3  # measured 0.37


def test_weight_is_quantized_once_per_version_and_never_stale():
    x, w, dy = inputs("random", m=128)
    layer = fp8_layer(256, 384, w.bfloat16())
    for _ in range(3):  # three micro-batches of one step
        layer(x.bfloat16()).backward(dy[:128].bfloat16())
    assert layer.fp8_cache.quantize_count == 1
    with torch.no_grad():
        layer.weight.mul_(-1.0)  # an optimizer step writing the weight in place
    y = layer(x.bfloat16())
    assert layer.fp8_cache.quantize_count == 2
    fresh = fp8_layer(256, 384, layer.weight.detach())
    assert torch.equal(y, fresh(x.bfloat16()))


def test_forward_saves_the_fp8_input_for_wgrad_not_the_bf16_one():
    """Only x^T in FP8 (1x128 tiles along the tokens, quantized from x itself) is kept for the weight gradient."""
    x, w, _ = inputs("random")
    layer = fp8_layer(256, 384, w.bfloat16())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x.bfloat16().requires_grad_())
    weights = {t.data_ptr() for t in (layer.weight, *layer.fp8_cache.entry.tensors()) if t is not None}
    activations = [t for t in saved if t is not None and t.data_ptr() not in weights]
    assert {t.dtype for t in activations} == {torch.float8_e4m3fn, torch.float32}
    assert [t.shape for t in activations] == [(256, 512), (256, 4)]  # x^T and its scales along the tokens
    saved_bytes = sum(t.numel() * t.element_size() for t in activations)
    assert saved_bytes == 512 * 256 * (1 + 4 / 128)  # FP8 values + one FP32 scale per 128; BF16 would be 2 bytes


def test_weight_gradient_accumulates_in_fp32_main_grad():
    """Each micro-batch's FP8 weight gradient is added into main_grad as the FP32 product of its quantized
    operands: never rounded to BF16 on the way (the GEMM adds it itself on the cublas backend)."""
    x, w, dy = inputs("random")
    layer = fp8_layer(256, 384, w.bfloat16())
    layer.weight.main_grad = torch.zeros(384, 256)
    xs, dys = x.bfloat16(), dy.bfloat16()
    layer(xs[:256]).backward(dys[:256])
    layer(xs[256:]).backward(dys[256:])
    assert layer.weight.grad is None
    backend = select_backend("reference", torch.device("cpu"))
    expected = torch.zeros(384, 256)
    for rows in (slice(0, 256), slice(256, 512)):
        dyt = backend.quantize_rows_cols(dys[rows], E4M3, False)[2:]
        xt = backend.quantize_rows_cols(xs[rows], E4M3, False)[2:]
        expected += backend.gemm_1x128_1x128(*dyt, *xt, torch.float32)
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=0, atol=0)
    rounded = expected.bfloat16().float()  # what adding BF16 weight gradients would have kept instead
    assert not torch.equal(layer.weight.main_grad, rounded)


def test_token_count_need_not_be_a_multiple_of_128():
    x, w, dy = inputs("random")
    layer = fp8_layer(256, 384, w.bfloat16())
    x3 = x[:150].reshape(3, 50, 256).bfloat16().requires_grad_()
    y = layer(x3)
    assert y.shape == (3, 50, 384)
    y.backward(dy[:150].reshape(3, 50, 384).bfloat16())
    assert rel_err(layer.weight.grad, dy[:150].double().t() @ x[:150].double()) < FP8_REL_TOL
    assert rel_err(x3.grad.reshape(150, 256), dy[:150].double() @ w.double()) < FP8_REL_TOL


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_each_gemm_can_stay_bf16(gemm):
    x, w, dy = inputs("random")
    layer = fp8_layer(256, 384, w.bfloat16(), **{gemm: False})
    xb = x.bfloat16().requires_grad_()
    y = layer(xb)
    y.backward(dy.bfloat16())
    wb = w.bfloat16()
    plain = {"fprop": (y, F.linear(xb.detach(), wb)), "dgrad": (xb.grad, dy.bfloat16() @ wb),
             "wgrad": (layer.weight.grad, dy.bfloat16().t() @ xb.detach())}
    got, want = plain[gemm]
    assert torch.equal(got, want)
    others = [g for g in plain if g != gemm]
    assert all(not torch.equal(*plain[g]) for g in others)  # the other two still ran in FP8


def test_unaligned_layer_and_unavailable_backend_are_rejected():
    with pytest.raises(ValueError, match="in_features to be a multiple of 128, got 200"):
        ColumnParallelLinear(200, 256, PrecisionRecipe.from_name("fp8"))
    with pytest.raises(ConfigError, match="the cublas backend needs a CUDA GPU, but this run is on cpu"):
        select_backend("cublas", torch.device("cpu"))
    with pytest.raises(ConfigError, match="the hopper backend needs a CUDA GPU, but this run is on cpu"):
        select_backend("hopper", torch.device("cpu"))
    assert select_backend("auto", torch.device("cpu")).name == "reference"
    with pytest.raises(ConfigError, match="'cuda_magic' is not a backend; choose one of auto, reference, triton, cublas, "
                                          "hopper"):
        select_backend("cuda_magic", torch.device("cpu"))


def plan_for(*overrides):
    cfg = load_config("tiny_dense_fp8", ["model.vocab_size=384", *overrides])
    recipe = PrecisionRecipe.from_config(cfg.precision)
    model = Transformer(cfg.model, recipe, 64)
    converter = Fp8Converter(cfg.precision, recipe, cfg.model.num_layers)
    converter.check(model)
    return model, converter.convert(model)


def test_layer_plan_keeps_islands_and_chosen_blocks_in_bf16():
    model, plan = plan_for()
    assert len(plan.fp8_layers) == 16 and plan.bf16_layers == ["lm_head"]
    assert model.layers[2].mlp.down_proj.runs_fp8 and not model.lm_head.runs_fp8
    _, plan = plan_for("precision.bf16_first_last_blocks=1", "precision.bf16_layers=[layers.1.attn.*]")
    assert sorted(plan.bf16_layers) == sorted(["lm_head", "layers.0.attn.qkv_proj", "layers.0.attn.out_proj",
                                               "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj",
                                               "layers.3.attn.qkv_proj", "layers.3.attn.out_proj",
                                               "layers.3.mlp.gate_up_proj", "layers.3.mlp.down_proj",
                                               "layers.1.attn.qkv_proj", "layers.1.attn.out_proj"])
    _, plan = plan_for("precision.fp8_layers=[layers.*.mlp.*]")
    assert all(".mlp." in n for n in plan.fp8_layers) and len(plan.fp8_layers) == 8


def test_ffn_that_is_not_whole_tiles_stays_bf16_and_the_plan_says_which():
    """DeepSeek-V2-Lite's dense FFN (10944) is not a multiple of 128: a weight that is not whole 128x128 tiles runs
    BF16 (down_proj, 256 x 704), one that is runs FP8 (gate_up_proj, 1408 x 256), and the summary names them."""
    model, plan = plan_for("model.ffn_hidden_size=704")
    downs = [f"layers.{i}.mlp.down_proj" for i in range(4)]
    assert plan.untiled == downs and set(downs) <= set(plan.bf16_layers) and len(plan.fp8_layers) == 12
    assert model.layers[0].mlp.gate_up_proj.runs_fp8 and not model.layers[3].mlp.down_proj.runs_fp8
    assert plan.summary() == ("12 of 17 GEMM layers in FP8; BF16: lm_head; BF16 as not whole 128x128 FP8 tiles: "
                              "layers.*.mlp.down_proj (x4)")
    _, plan = plan_for("model.ffn_hidden_size=700")  # 1400 rows do not tile either
    assert len(plan.untiled) == 8 and len(plan.fp8_layers) == 8


@pytest.mark.parametrize("overrides, message", [
    (["precision.fp8_layers=[lm_head]"], "names 'lm_head', a precision island"),
    (["precision.fp8_layers=[embed]"], "names 'embed', a precision island"),
    (["precision.fp8_layers=[layers.0.attn_norm]"], "a precision island"),
    (["precision.fp8_layers=[layers.*.mpl.*]"], "matches no GEMM layer (names look like layers.0.attn.qkv_proj)"),
    (["precision.bf16_layers=[layer.0.*]"], "precision.bf16_layers entry 'layer.0.*' matches no GEMM layer"),
])
def test_bad_layer_requests_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        plan_for(*overrides)


def test_fp8_config_rejects_unaligned_sizes():
    with pytest.raises(ConfigError, match=r"multiples of the 128-wide FP8 tile, but model.hidden_size = 320: "
                                          r"change model.hidden_size \(e.g. to make it 384\)"):
        load_config("tiny_dense_fp8", ["model.hidden_size=320", "model.attention.head_dim=64"])
    with pytest.raises(ConfigError, match=r"QKV width\) = 192"):
        load_config("tiny_dense_fp8", ["model.hidden_size=128", "model.num_heads=4", "model.attention.num_kv_heads=1"])


def test_fp8_backend_that_cannot_run_here_is_a_config_error(tiny_overrides):
    from megafp8.train import Trainer
    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["precision.fp8_backend=cublas"])
    with pytest.raises(ConfigError, match="the cublas backend needs a CUDA GPU.*set precision.fp8_backend=auto"):
        Trainer(cfg, ParallelDims.single(), torch.device("cpu"))


def test_optimizer_step_invalidates_the_quantized_weight():
    """The sharded optimizer writes weights through a flat buffer the parameters view; the FP8 cache must see it."""
    from megafp8.config import OptimizerConfig
    from megafp8.optim import DistributedAdamW
    from megafp8.parallel import GradBuckets

    x, w, dy = inputs("random", m=128)
    layer = fp8_layer(256, 384, w.bfloat16())
    buckets = GradBuckets([layer.weight], {layer.weight: None}, bucket_numel=10**6, sharded=True)
    opt = DistributedAdamW(buckets, {layer.weight: "weight"}, OptimizerConfig(lr=1e-2, warmup_steps=0))
    buckets.prepare_backward(last_micro_batch=True)
    layer(x.bfloat16()).backward(dy[:128].bfloat16())
    buckets.finish()
    opt.step(1e-2)
    y = layer(x.bfloat16())
    assert layer.fp8_cache.quantize_count == 2
    assert torch.equal(y, fp8_layer(256, 384, layer.weight.detach())(x.bfloat16()))


def _norm_then_fp8(recipe, queue=None, fused_norm=False, keep_transpose=True):
    from megafp8.model.norm import RMSNorm
    from megafp8.precision import Fp8WeightCache, fp8_linear
    from megafp8.precision.backends import Fp8Backend

    norm = RMSNorm(256, 1e-5, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 256))
    cache = Fp8WeightCache(keep_transpose)

    def f(x, w):
        if fused_norm:  # the norm's kernel quantizes its FP32 output for the GEMM
            y = fp8_linear(x, w, cache, recipe, Fp8Backend(), wgrad_queue=queue, norm=norm)
        else:
            y = fp8_linear(norm(x), w, cache, recipe, Fp8Backend(), wgrad_queue=queue)
        return (y * 1.5).float().square().mean()
    return f


def _loss_and_grads(fn, x0, w):
    x = x0.clone().requires_grad_(True)
    w.grad = None
    loss = fn(x, w)
    loss.backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("fused_norm", [False, True], ids=["norm-then-linear", "fused-norm"])
def test_fp8_linear_compiles_into_the_graph_with_the_eager_bits(fused_norm):
    """Under torch.compile a plain FP8 linear (with its input's norm fused in, or not) is custom ops inside the graph
    (no graph break), and computes exactly what the eager FP8 linear does: loss, input gradient and weight
    gradient, 200 tokens (not a multiple of 128)."""
    from megafp8.precision import WeightGradQueue

    torch.manual_seed(0)
    recipe = Fp8Recipe(backend="reference")
    w = torch.nn.Parameter((torch.randn(384, 256) * 0.05).to(torch.bfloat16))
    x0 = torch.randn(2, 100, 256).to(torch.bfloat16)
    f = _norm_then_fp8(recipe, fused_norm=fused_norm)
    assert torch._dynamo.explain(f)(x0.clone().requires_grad_(True), w).graph_break_count == 0
    eager = _loss_and_grads(f, x0, w)
    torch._dynamo.reset()
    compiled = _loss_and_grads(torch.compile(f, backend="aot_eager"), x0, w)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    # Deferred weight gradients (zero-bubble pipelines) keep the eager path: a graph break.
    torch._dynamo.reset()
    deferred = _norm_then_fp8(recipe, WeightGradQueue())
    assert torch._dynamo.explain(deferred)(x0.clone().requires_grad_(True), w).graph_break_count > 0


@pytest.mark.parametrize("fused_norm", [False, True], ids=["norm-then-linear", "fused-norm"])
def test_a_linear_keeping_no_weight_transpose_gives_the_same_bits_eagerly_and_compiled(fused_norm):
    """A cache without w^T (`precision.fp8_keep_weight_transpose: false`): dgrad's w^T is made in backward, by an op
    inside the compiled graph; loss and both gradients keep the kept-transpose run's bits."""
    torch.manual_seed(0)
    recipe = Fp8Recipe(backend="reference")
    w = torch.nn.Parameter((torch.randn(384, 256) * 0.05).to(torch.bfloat16))
    x0 = torch.randn(2, 100, 256).to(torch.bfloat16)
    kept = _loss_and_grads(_norm_then_fp8(recipe, fused_norm=fused_norm), x0, w)
    f = _norm_then_fp8(recipe, fused_norm=fused_norm, keep_transpose=False)
    assert torch._dynamo.explain(f)(x0.clone().requires_grad_(True), w).graph_break_count == 0
    torch._dynamo.reset()
    for run in (_loss_and_grads(f, x0, w), _loss_and_grads(torch.compile(f, backend="aot_eager"), x0, w)):
        for a, b in zip(kept, run):
            assert torch.equal(a, b)
    torch._dynamo.reset()


def test_compiled_fp8_linear_adds_its_weight_gradient_into_main_grad_inside_the_graph():
    """A traced FP8 linear whose weight has an FP32 main_grad adds its wgrad into the alias its cache's `prepare`
    hands out, inside the compiled graph, and returns no weight gradient; two micro-batches forward, forward,
    backward, backward leave exactly the eager run's main_grad. Without `prepare` (no alias) the graph returns dw."""
    from megafp8.precision.backends import Fp8Backend

    torch.manual_seed(0)
    recipe = Fp8Recipe(backend="reference")
    w0 = (torch.randn(384, 256) * 0.05).to(torch.bfloat16)
    x0 = [torch.randn(200, 256).to(torch.bfloat16) for _ in range(2)]

    def run(compiled: bool, prepare: bool = True):
        from megafp8.precision import Fp8WeightCache, fp8_linear
        w = torch.nn.Parameter(w0.clone())
        w.main_grad = torch.zeros(384, 256)
        cache = Fp8WeightCache()

        def f(x):
            return (fp8_linear(x, w, cache, recipe, Fp8Backend()) * 1.5).float().square().mean()
        fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
        losses = []
        for x in x0:
            if prepare:
                cache.prepare(w, Fp8Backend(), recipe.fmt, recipe.power_of_two_scales)
            losses.append(fn(x.clone().requires_grad_(True)))
        for loss in losses:
            loss.backward()
        return w
    eager = run(compiled=False)
    assert eager.grad is None and eager.main_grad.abs().sum() > 0
    torch._dynamo.reset()
    compiled = run(compiled=True)
    assert compiled.grad is None and torch.equal(compiled.main_grad, eager.main_grad)
    torch._dynamo.reset()
    unprepared = run(compiled=True, prepare=False)  # no alias to add into: dw comes back as the weight's grad
    assert unprepared.grad is not None and unprepared.grad.dtype == torch.bfloat16
    assert not unprepared.main_grad.any()
