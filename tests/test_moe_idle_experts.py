"""The experts a micro-batch gives no rows, and the lazily quantized ones: each expert's FP8 weight is quantized
(`Fp8WeightCache.per_expert`) and its transpose made only when a micro-batch first gives it rows; the kernels'
choices in Triton's interpreter, the cache's semantics, the traced op under Inductor's in-graph recomputation, no
weight copy saved from a compiled forward to its backward, and micro-batches in flight (a pipeline stage's)."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from megafp8.config import load_config
from megafp8.model import init_weights
from megafp8.precision import PrecisionRecipe


# The weight transpose's kernel with experts left out, run by Triton's CPU interpreter (a subprocess: the
# interpreter is chosen at import).
INTERPRETED_TRANSPOSE = r'''
import torch
from megafp8.precision.kernels import quantize
g = torch.Generator().manual_seed(0)
e, n, k = 4, 256, 384
q = (torch.randn(e, n, k, generator=g) * 50).to(torch.float8_e4m3fn)
s = torch.rand(e, n // 128, k // 128, generator=g)
qt = torch.full((e, k, n), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN bytes
st = torch.full((e, k // 128, n // 128), float("nan"))
quantize.transpose_blocks(q, s, qt, st, torch.tensor([2, 0, 5, 0], dtype=torch.int32))
for i, used in enumerate((True, False, True, False)):
    if used:
        assert torch.equal(qt[i].view(torch.uint8), q[i].t().contiguous().view(torch.uint8)), i
        assert torch.equal(st[i], s[i].t()), i
    else:  # left exactly as it was
        assert bool((qt[i].view(torch.uint8) == 0x7F).all()) and bool(st[i].isnan().all()), i
quantize.transpose_blocks(q, s, qt, st)  # without the counts: every expert
assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).contiguous().view(torch.uint8))
assert torch.equal(st, s.transpose(1, 2))
try:
    quantize.transpose_blocks(q, s, qt, st, torch.ones(3, dtype=torch.int32))
except ValueError as error:
    assert "one entry per expert (4)" in str(error), error
else:
    raise AssertionError("a count per expert was not checked")
print("ok")
'''


def test_the_weight_transpose_skips_experts_without_rows_in_the_interpreter(tmp_path):
    """dgrad's w^T, made in each expert projection's backward, transposes only the experts with rows: the others'
    bytes and scales are left as they were (no grouped GEMM reads them), the used ones are w's exact bytes
    transposed, and without counts every expert is transposed. Triton's CPU interpreter runs the kernel."""
    from tests.scripts import run_in_triton_interpreter
    run_in_triton_interpreter(tmp_path, INTERPRETED_TRANSPOSE)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced ops"])
def test_the_grouped_dgrad_transposes_only_the_experts_with_rows(monkeypatch, traced):
    """The grouped dgrad hands the layout's tiles per expert to the weight's transpose, eagerly and through the
    traced custom ops (what compiled MoE blocks call), so a backend can skip idle experts (`transpose_blocks`)."""
    from megafp8.precision.backends.reference import Fp8Backend
    from megafp8.precision.expert_layout import expert_rows
    from megafp8.precision.formats import E4M3
    from megafp8.precision import fp8_ops, quantize as ref

    seen = []
    original = Fp8Backend._transpose_into

    def recording(self, w, out, experts_used=None):
        seen.append(None if experts_used is None else experts_used.tolist())
        original(self, w, out, experts_used)
    monkeypatch.setattr(Fp8Backend, "_transpose_into", recording)
    backend = Fp8Backend()
    rows = expert_rows([130, 0, 5], torch.device("cpu"))
    w_host = torch.randn(3, 256, 128)
    w = backend.empty_weight(w_host.shape, E4M3, torch.device("cpu"), transpose=False)
    backend.quantize_weight_(w_host, w, E4M3, False)
    dy, dy_scale = ref.quantize_1x128(torch.randn(rows.total, 256), E4M3)
    k = fp8_ops.kernels("reference" if traced else backend, traced)
    dx = k.grouped_gemm_1x128_128x128(dy, dy_scale, w, True, rows, torch.float32)
    assert seen == [[2, 0, 1]] and dx.shape == (rows.total, 128)


INTERPRETED_STALE = r'''
import torch
from megafp8.precision import E4M3
from megafp8.precision.kernels import quantize
g = torch.Generator().manual_seed(0)
e, n, k = 4, 256, 128
w = torch.randn(e, n, k, generator=g).to(torch.bfloat16)
full_q, full_s = torch.empty(e, n, k, dtype=torch.float8_e4m3fn), torch.empty(e, n // 128, k // 128)
quantize.quantize_weight_(w, full_q, full_s, None, None, E4M3, False)
q = torch.full((e, n, k), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
s = torch.full((e, n // 128, k // 128), float("nan"))
version, current = torch.tensor([-1, 3, -1, -1]), torch.tensor([3])
quantize.quantize_weight_(w, q, s, None, None, E4M3, False, (version, current, torch.tensor([1, 1, 0, 2],
                                                                                            dtype=torch.int32)))
for i, chosen in enumerate((True, False, False, True)):  # expert 1 current already, expert 2 without rows
    same = torch.equal(q[i].view(torch.uint8), full_q[i].view(torch.uint8)) and torch.equal(s[i], full_s[i])
    assert same == chosen and (chosen or bool((q[i].view(torch.uint8) == 0x7F).all())), i
assert version.tolist() == [3, 3, -1, 3], version
quantize.quantize_weight_(w, q, s, None, None, E4M3, False, (version, current, None))  # the stale rest
assert torch.equal(q[2].view(torch.uint8), full_q[2].view(torch.uint8)) and version.tolist() == [3] * 4
assert bool((q[1].view(torch.uint8) == 0x7F).all())  # current: left alone, whatever its bytes
print("ok")
'''


def test_the_weight_quantizer_quantizes_only_stale_experts_with_rows_in_the_interpreter(tmp_path):
    """The weight kernel with per-expert versions (`Fp8WeightCache.per_expert`): an expert is quantized only where
    its version is not current and, with the layout's tiles, where it has rows; those get the full quantizer's
    exact bytes and scales and are marked current, the others keep theirs. Triton's interpreter runs it."""
    from tests.scripts import run_in_triton_interpreter
    run_in_triton_interpreter(tmp_path, INTERPRETED_STALE)


def test_a_per_expert_cache_quantizes_experts_when_they_get_rows_once_per_version():
    """`Fp8WeightCache(per_expert=True)` on the reference backend: `prepare` quantizes nothing; `get_for_rows`
    quantizes the experts with rows, bit for bit as the whole weight's quantization, and leaves the others; a second
    micro-batch quantizes only its newly busy experts; `get` brings every expert up to date; a new weight version
    makes every expert stale again."""
    from megafp8.precision import E4M3
    from megafp8.precision.backends.reference import Fp8Backend
    from megafp8.precision.weight_cache import Fp8WeightCache

    backend = Fp8Backend()
    calls = []
    quantize = backend.quantize_weight_
    backend.quantize_weight_ = lambda w, out, fmt, pow2, stale=None: (
        calls.append(None if stale is None or stale.used is None else stale.chosen().tolist()),
        quantize(w, out, fmt, pow2, stale))
    weight = torch.randn(4, 256, 128).to(torch.bfloat16)

    def full(w):
        out = backend.empty_weight(w.shape, E4M3, torch.device("cpu"), transpose=False)
        Fp8Backend().quantize_weight_(w, out, E4M3, False)
        return out

    want = full(weight)
    cache = Fp8WeightCache(keep_transpose=False, per_expert=True)
    cache.prepare(weight, backend, E4M3, False)
    assert calls == [] and cache.quantize_count == 1 and cache.traced_entry() is cache.entry
    entry = cache.get_for_rows(weight, backend, E4M3, False, torch.tensor([2, 0, 1, 0], dtype=torch.int32))
    assert calls == [[True, False, True, False]]
    for e in (0, 2):
        assert torch.equal(entry.w_fp8[e].view(torch.uint8), want.w_fp8[e].view(torch.uint8))
        assert torch.equal(entry.w_scale[e], want.w_scale[e])
    cache.get_for_rows(weight, backend, E4M3, False, torch.tensor([1, 1, 0, 0], dtype=torch.int32))
    assert calls[-1] == [False, True, False, False]  # expert 0 is current already
    cache.get(weight, backend, E4M3, False)
    assert torch.equal(entry.w_fp8.view(torch.uint8), want.w_fp8.view(torch.uint8)) and cache.stale.version.tolist() \
        == [1] * 4 and len(calls) == 3
    cache.get(weight, backend, E4M3, False)  # all current: nothing to launch
    assert len(calls) == 3 and cache.quantize_count == 1
    with torch.no_grad():
        weight.mul_(-1.0)  # an optimizer step
    cache.prepare(weight, backend, E4M3, False)
    assert cache.quantize_count == 2 and len(calls) == 3
    cache.get_for_rows(weight, backend, E4M3, False, torch.tensor([0, 0, 0, 5], dtype=torch.int32))
    assert calls[-1] == [False, False, False, True]
    assert torch.equal(entry.w_fp8[3].view(torch.uint8), full(weight).w_fp8[3].view(torch.uint8))

    # A graph reading the prepared cache other than through the experts' MLP would read stale experts: refused.
    from megafp8.precision.fp8_linear import current_weight
    recipe = PrecisionRecipe.from_config(load_config("tiny_moe_fp8").precision).fp8
    with pytest.raises(RuntimeError, match="stale experts"):
        current_weight(cache, weight, recipe, backend, traced=True)


def test_a_recomputed_compiled_moe_block_quantizes_its_experts_once_in_the_forward(tiny_overrides, monkeypatch):
    """Inductor, every block recomputed inside its compiled backward: the experts' weights are quantized by the
    graph's forward (the cache-mutating op left out of the recomputation), once per projection and micro-batch, and
    the losses are the uncompiled run's to BF16 rounding."""
    from megafp8.model import Fp8Converter, Transformer, apply_compile, apply_recompute
    from megafp8.precision.backends.reference import Fp8Backend

    calls = []
    quantize = Fp8Backend.quantize_weight_

    def counting(self, w, out, fmt, pow2, stale=None):
        calls.append(stale is not None and stale.used is not None)
        quantize(self, w, out, fmt, pow2, stale)
    monkeypatch.setattr(Fp8Backend, "quantize_weight_", counting)
    full = load_config("tiny_moe_fp8", tiny_overrides + ["model.num_layers=2", "model.moe.first_dense_layers=1",
                                                         "model.vocab_size=512", "precision.fp8_backend=reference"])
    cfg, recipe = full.model, PrecisionRecipe.from_config(full.precision)
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))

    def losses(compiled: bool) -> list[float]:
        torch._dynamo.reset()
        model = Transformer(cfg, recipe, 64)
        init_weights(model, cfg, 0)
        Fp8Converter(full.precision, recipe, cfg.num_layers).convert(model)
        apply_recompute(model, "full")
        if compiled:
            apply_compile(model, backend="inductor")
        out = []
        for _ in range(2):  # two micro-batches of one weight version
            loss = model(tokens, tokens)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss.backward()
            out.append(loss.item())
        return out

    eager = losses(compiled=False)
    calls.clear()
    compiled = losses(compiled=True)
    assert calls.count(True) == 2 * 2, calls  # gate/up and down, each micro-batch, in the forward only
    assert compiled == pytest.approx(eager, rel=5e-3)


class _GraphsSeen(CustomGraphPass):
    """Inductor's post-grad pass that keeps a copy of each graph it compiles (forward and backward, partitioned)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.Graph] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        copy = torch.fx.Graph()
        copy.output(copy.graph_copy(graph, {}))  # graph_copy leaves the output node out
        self.graphs.append(copy)

    def uuid(self):
        return None  # never cached: every compilation is seen


def _ops_called(graph: torch.fx.Graph, name: str) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and name in str(n.target))


@pytest.mark.parametrize("keep_transpose", [False, True])
def test_a_compiled_fp8_moe_block_holds_no_weight_copy_from_its_forward_to_its_backward(tiny_overrides,
                                                                                        keep_transpose):
    """What a compiled FP8 MoE block's forward keeps for its backward holds no FP8 tensor of a weight's shape or its
    transpose's: a weight transposed for its dgrad (the experts' always; a dense layer's where no transpose is
    kept) is transposed in the backward from the cache itself. The in-graph quantization of the experts with rows
    declared its write into the cache at first; every later reader then read its functional result, a forward
    value, and the partitioner made the experts' w^T in the forward and saved them, every MoE layer's at once
    (2.5 GiB more held on the GPU, job HX)."""
    from megafp8.model import Fp8Converter, Transformer, apply_compile
    seen = _GraphsSeen()
    full = load_config("tiny_moe_fp8", tiny_overrides + [
        "model.num_layers=2", "model.moe.first_dense_layers=1", "model.vocab_size=512",
        "precision.fp8_backend=reference", f"precision.fp8_keep_weight_transpose={str(keep_transpose).lower()}"])
    cfg, recipe = full.model, PrecisionRecipe.from_config(full.precision)
    torch._dynamo.reset()
    model = Transformer(cfg, recipe, 64)
    init_weights(model, cfg, 0)
    Fp8Converter(full.precision, recipe, cfg.num_layers).convert(model)
    apply_compile(model, backend="inductor")
    tokens = torch.randint(0, 512, (6, 64), generator=torch.Generator().manual_seed(0))  # 384 rows: no weight's
    weights = [m.weight for m in model.modules() if getattr(m, "fp8_cache", None) is not None]
    shapes = {tuple(w.shape[:-2]) + s for w in weights for s in (tuple(w.shape[-2:]), tuple(w.shape[-2:])[::-1])}
    with torch._inductor.config.patch(post_grad_custom_post_pass=seen):
        loss = model(tokens, tokens)
        (loss[0] if isinstance(loss, tuple) else loss).backward()
    torch._dynamo.reset()
    forwards = [g for g in seen.graphs if not any(n.op == "placeholder" and n.name.startswith("tangents")
                                                  for n in g.nodes)]
    backwards = [g for g in seen.graphs if g not in forwards]
    assert len(forwards) == len(backwards) == cfg.num_layers, len(seen.graphs)
    moe_forward = next(g for g in forwards if _ops_called(g, "quantize_stale_experts"))
    assert _ops_called(moe_forward, "quantize_stale_experts") == 2
    for graph in forwards:
        (output,) = [n for n in graph.nodes if n.op == "output"]
        for saved in output.args[0][1:]:
            value = getattr(saved, "meta", {}).get("val")
            if getattr(saved, "op", None) == "placeholder":
                continue  # an input (a cache's tensor itself): a reference, no memory
            if isinstance(value, torch.Tensor) and value.dtype == torch.float8_e4m3fn:
                assert tuple(value.shape) not in shapes, f"{saved.name} {tuple(value.shape)} saved for backward"
        assert _ops_called(graph, "transpose_weight") == 0
    transposed = sum(_ops_called(g, "transpose_weight") for g in backwards)
    experts = sum(w.dim() == 3 for w in weights)  # the experts' weights keep no transpose in any case
    assert experts == 2 and transposed == (experts if keep_transpose else len(weights)), transposed


def in_flight_gradients(overrides: list[str], backend: str, device: torch.device, compiled: bool,
                        in_flight: bool) -> list[torch.Tensor]:
    """Every parameter's gradient (FP32 `main_grad` where the layer adds into it) after two micro-batches of the
    tiny FP8 MoE model: forward-backward twice, or (`in_flight`) both forwards and then both backwards, as a
    pipeline stage holds micro-batches in flight."""
    from megafp8.model import Fp8Converter, Transformer, apply_compile
    full = load_config("tiny_moe_fp8", overrides + ["model.num_layers=2", "model.moe.first_dense_layers=1",
                                                    "model.vocab_size=512", f"precision.fp8_backend={backend}"])
    cfg, recipe = full.model, PrecisionRecipe.from_config(full.precision)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (2, 64), generator=g).to(device) for _ in range(2)]
    torch._dynamo.reset()
    model = Transformer(cfg, recipe, 64, device=device)
    init_weights(model, cfg, 0)
    Fp8Converter(full.precision, recipe, cfg.num_layers).convert(model)
    if compiled:
        apply_compile(model, backend="inductor")

    def loss_of(tokens):
        loss = model(tokens, tokens)
        return loss[0] if isinstance(loss, tuple) else loss
    if in_flight:
        for loss in [loss_of(t) for t in batches]:
            loss.backward()
    else:
        for t in batches:
            loss_of(t).backward()
    grads = [(getattr(p, "main_grad", None) if p.grad is None else p.grad).clone() for p in model.parameters()]
    torch._dynamo.reset()
    return grads


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_micro_batches_in_flight_get_the_gradients_of_one_after_another(tiny_overrides, compiled):
    """A pipeline stage holds several micro-batches' forwards before their backwards (1F1B's warm-up, DualPipeV).
    A later forward quantizes the experts its rows reach into the cache that an earlier micro-batch's backward
    saved: two forwards then two backwards give the gradients of forward-backward twice, and no backward is
    refused for a cache written in between (it reads only its own experts, current already). (On the GPU:
    `tests/test_moe_gpu.py`.)"""
    cpu = torch.device("cpu")
    one_after_another = in_flight_gradients(tiny_overrides, "reference", cpu, compiled, in_flight=False)
    in_flight = in_flight_gradients(tiny_overrides, "reference", cpu, compiled, in_flight=True)
    assert len(in_flight) == len(one_after_another) > 0
    for a, b in zip(in_flight, one_after_another):
        assert torch.equal(a, b)
