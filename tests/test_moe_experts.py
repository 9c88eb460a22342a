"""The routed experts' grouped layers on CPU: a grouped expert linear against one linear per expert, where BF16 runs
`torch._grouped_mm` and its gradients into `main_grad`, the FP8 experts' fused SwiGLU MLP and its own combine against
two grouped linears and the separate combine, and a MoE layer traced into one graph with eager's bits. (Routing,
dispatch and expert parallelism: `tests/test_moe.py`; the experts without rows and lazily quantized experts:
`tests/test_moe_idle_experts.py`; the grouped kernels on a GPU: `tests/test_moe_gpu.py`.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.model import init_weights
from megafp8.model.moe import MoE
from megafp8.parallel import ExpertParallel, ParallelDims, TensorParallel
from megafp8.parallel.permute import RowSource
from megafp8.precision import PrecisionRecipe
from megafp8.train.trainer import Trainer
from tests.test_moe import MOE, _tokens_as_rows


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize("seed", [0, 5])
def test_grouped_expert_linear_equals_one_linear_per_expert(recipe, seed):
    """One grouped call (rows padded per expert, quantized once; stacked weight quantized once) gives each expert
    what its own linear gives: same FP8 operands, so outputs, input and weight gradients differ at most by the
    CPU matmul's summation order (it blocks a 128-row padded segment differently from 5 rows), which can move a
    BF16 result by one unit in the last place. Counts include 0 and 1."""
    from megafp8.parallel import ColumnParallelLinear
    from megafp8.parallel.experts import ExpertLinear

    torch.manual_seed(seed)
    prec = PrecisionRecipe.from_name(recipe)
    counts = [5, 0, 130, 1]
    grouped = ExpertLinear(4, 256, 128, prec, ExpertParallel.single())
    torch.nn.init.normal_(grouped.weight, std=0.05)
    x = torch.randn(sum(counts), 256).to(prec.param_dtype).requires_grad_(True)
    dy = torch.randn(sum(counts), 128).to(prec.param_dtype)
    y = grouped(x, counts)
    y.backward(dy)

    def same(a, b):  # equal up to one BF16 ulp (2^-8 relative) of the largest value
        return (a.float() - b.float()).abs().max() <= 2**-8 * b.float().abs().max()

    start = 0
    for e, count in enumerate(counts):
        single = ColumnParallelLinear(256, 128, prec)
        with torch.no_grad():
            single.weight.copy_(grouped.weight[e])
        xe = x.detach()[start:start + count].clone().requires_grad_(True)
        ye = single(xe)
        ye.backward(dy[start:start + count])
        if count:
            assert same(y[start:start + count], ye) and same(x.grad[start:start + count], xe.grad), e
            assert same(grouped.weight.grad[e], single.weight.grad), e
        else:
            assert torch.equal(grouped.weight.grad[e], torch.zeros_like(single.weight))
        start += count


# ------------------------------------------------------------------------------- BF16 grouped GEMMs

@pytest.mark.parametrize("where, dtype, rows, k, n, experts, runs", [
    (("cpu", None), torch.bfloat16, 136, 256, 128, 4, True),
    (("cpu", None), torch.float16, 136, 256, 128, 4, True),
    (("cpu", None), torch.float32, 136, 20, 12, 4, True),  # FP32: 20 and 12 elements are 16-byte multiples
    (("cpu", None), torch.bfloat16, 136, 20, 128, 4, False),  # a BF16 row of 20 elements is 40 bytes
    (("cpu", None), torch.bfloat16, 136, 256, 12, 4, False),
    (("cpu", None), torch.bfloat16, 0, 256, 128, 4, False),  # no rows: wgrad's contracted dim would be empty
    (("cpu", None), torch.float8_e4m3fn, 136, 256, 128, 4, False),
    (("cuda", (9, 0)), torch.bfloat16, 136, 256, 128, 4, True),  # H100/H200: CUTLASS grouped kernel
    (("cuda", (10, 0)), torch.bfloat16, 136, 256, 128, 4, True),
    (("cuda", (9, 0)), torch.bfloat16, 136, 256, 128, 1024, False),  # the CUTLASS kernel takes < 1024 groups
    (("cuda", (9, 0)), torch.float16, 136, 256, 128, 4, False),  # torch's fallback: a host sync and a loop
    (("cuda", (9, 0)), torch.float32, 136, 256, 128, 4, False),
    (("cuda", (8, 0)), torch.bfloat16, 136, 256, 128, 4, False),
    (("cuda", (12, 0)), torch.bfloat16, 136, 256, 128, 4, False),
])
def test_grouped_mm_runs_only_where_torch_has_a_sync_free_kernel(where, dtype, rows, k, n, experts, runs):
    from megafp8.precision.grouped import grouped_mm_unsupported_reason

    reason = grouped_mm_unsupported_reason(*where, dtype, rows, experts, k, n, has_generic_kernel=True)
    assert (reason is None) == runs, reason
    assert grouped_mm_unsupported_reason("cuda", (9, 0), torch.bfloat16, 136, 4, 256, 128, hip=True) is not None
    assert grouped_mm_unsupported_reason("cpu", None, torch.bfloat16, 136, 4, 256, 128,
                                         has_generic_kernel=False) is not None
    assert grouped_mm_unsupported_reason("cuda", (9, 0), torch.bfloat16, 136, 4, 256, 128,
                                         has_grouped_mm=False) is not None


def _plain_grouped_run(monkeypatch, grouped: bool, x, weight, dy, counts, main_grad=None, queue=None):
    """y, dx and the weight gradient (dw, or main_grad after backward) of the plain grouped linear, through
    `torch._grouped_mm` (`grouped`) or the per-expert loop; also how many `_grouped_mm` calls ran."""
    from megafp8.precision import grouped as grouped_module

    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    if not grouped:
        monkeypatch.setattr(grouped_module, "_use_grouped_mm", lambda x, w: False)
    w = weight.detach().clone().requires_grad_(True)
    if main_grad is not None:
        w.main_grad = main_grad.clone()
    xg = x.detach().clone().requires_grad_(True)
    y = grouped_module.grouped_linear(xg, w, counts, None, None, None, queue)
    y.backward(dy)
    monkeypatch.undo()
    return y.detach(), xg.grad, (w.grad if main_grad is None else w.main_grad), w, len(calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("counts", [[5, 0, 130, 1], [0, 64, 0, 8], [16, 16, 16, 16]])
def test_bf16_grouped_linear_runs_grouped_mm_and_matches_the_per_expert_loop(monkeypatch, dtype, counts):
    """Without an FP8 recipe each of fprop, dgrad and wgrad is one `torch._grouped_mm` (on CPU too, where torch
    2.13 has it), equal to the loop of one matmul per expert it replaced (same per-expert GEMMs: equal up to
    summation order); experts without rows get an exactly zero weight gradient."""
    g = torch.Generator().manual_seed(sum(counts))
    m, k, n = sum(counts), 256, 128
    x = torch.randn(m, k, generator=g).to(dtype)
    weight = (0.05 * torch.randn(len(counts), n, k, generator=g)).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    y, dx, dw, _, calls = _plain_grouped_run(monkeypatch, True, x, weight, dy, counts)
    assert calls == 3
    y_loop, dx_loop, dw_loop, _, loop_calls = _plain_grouped_run(monkeypatch, False, x, weight, dy, counts)
    assert loop_calls == 0
    for got, want in ((y, y_loop), (dx, dx_loop), (dw, dw_loop)):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)
    start = 0
    for e, c in enumerate(counts):  # and both are the per-expert GEMMs in FP32 (to the dtype's rounding)
        rows = slice(start, start + c)
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(y[rows].float(), x[rows].float() @ weight[e].float().t(), **tol)
        torch.testing.assert_close(dx[rows].float(), dy[rows].float() @ weight[e].float(), **tol)
        torch.testing.assert_close(dw[e].float(), dy[rows].float().t() @ x[rows].float(), **tol)
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))
        start += c


def test_bf16_grouped_linear_gradients_reach_main_grad_as_the_loop_does(monkeypatch):
    """With an FP32 `main_grad` the weight gradient is added into it (no `.grad`), now or, given a queue, when the
    queue runs: the same with `torch._grouped_mm` as with the loop."""
    from megafp8.precision import WeightGradQueue

    counts = [40, 0, 24]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g).bfloat16()
    weight = (0.05 * torch.randn(3, 256, 128, generator=g)).bfloat16()
    dy = torch.randn(64, 256, generator=g).bfloat16()
    main_grad = torch.randn(3, 256, 128, generator=g)
    results = {}
    for grouped in (True, False):
        *_, added, w, calls = _plain_grouped_run(monkeypatch, grouped, x, weight, dy, counts, main_grad)
        assert w.grad is None and calls == (3 if grouped else 0)
        queue = WeightGradQueue()
        *_, deferred, wq, calls = _plain_grouped_run(monkeypatch, grouped, x, weight, dy, counts, main_grad, queue)
        assert wq.grad is None and torch.equal(deferred, main_grad) and len(queue) == 1  # nothing added yet
        queue.take()()
        assert torch.equal(wq.main_grad, added)
        results[grouped] = added
    torch.testing.assert_close(results[True], results[False])
    assert torch.equal(results[True][1], main_grad[1])  # the expert without rows adds nothing


def test_fp8_expert_weight_gradients_are_added_into_main_grad_in_fp32_now_or_when_the_queue_runs():
    """Under FP8 the experts' wgrad GEMMs add their FP32 result into an FP32 `main_grad` themselves (never rounded
    to BF16 first): main_grad afterwards is main_grad before plus the FP32 gradient the same GEMMs return, in the
    fused MLP and in the grouped linear, at once or, given a queue, when it runs; an expert without rows adds
    nothing."""
    from megafp8.model.moe import RoutedExperts
    from megafp8.precision import WeightGradQueue

    cfg = dataclasses.replace(MOE.moe, num_experts=3, ffn_hidden_size=128)
    counts = [5, 0, 199]
    rows = _tokens_as_rows(sum(counts) // 3, 3, MOE.hidden_size)
    dy = torch.randn(sum(counts), MOE.hidden_size, generator=torch.Generator().manual_seed(1))
    for observed in (False, True):  # the fused MLP, then its two grouped linears
        experts = RoutedExperts(cfg, MOE.hidden_size, PrecisionRecipe.from_name("fp8"), ExpertParallel.single())
        experts.observed = observed
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(p.numel()))
        weights = [experts.gate_up_proj.weight, experts.down_proj.weight]
        _, _, *returned = _expert_mlp_outputs(experts, rows, counts, dy)  # no main_grad: returned, in BF16
        for w in weights:
            w.main_grad = torch.zeros(w.shape)
        _expert_mlp_outputs(experts, rows, counts, dy)
        products = [w.main_grad.clone() for w in weights]
        for product, g in zip(products, returned):
            assert float((product - g.float()).norm() / g.float().norm()) < 2**-8, observed  # BF16 vs FP32
            assert not torch.equal(product, product.bfloat16().float())  # never rounded to BF16
        for queue in (None, WeightGradQueue()):
            before = [torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) for w in weights]
            for w, b in zip(weights, before):
                w.main_grad = b.clone()
            experts.gate_up_proj.wgrad_queue = experts.down_proj.wgrad_queue = queue
            _expert_mlp_outputs(experts, rows, counts, dy)
            assert all(w.grad is None for w in weights)
            if queue is not None:
                assert all(torch.equal(w.main_grad, b) for w, b in zip(weights, before)) and len(queue) == 2
                queue.take()()
            for w, b, product in zip(weights, before, products):
                assert torch.equal(w.main_grad, b + product), observed
                assert torch.equal(w.main_grad[1], b[1])  # the expert without rows
        for w in weights:
            del w.main_grad


def test_compiled_bf16_grouped_linear_adds_into_main_grad_through_the_op_that_skips_idle_experts():
    """Traced, the BF16 grouped linear's backward graph adds its weight gradient into the main_grad slot's alias
    through `megafp8::add_experts_with_rows_into_` (which on CUDA leaves the experts without rows out), with the
    `_grouped_mm` offsets; main_grad ends as the eager run's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from megafp8.precision import MainGradSlot
    from megafp8.precision.grouped import grouped_linear

    counts = torch.tensor([40, 0, 24])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g).bfloat16()
    w0 = (0.05 * torch.randn(3, 256, 128, generator=g)).bfloat16()
    dy = torch.randn(64, 256, generator=g).bfloat16()
    targets = []

    def record(gm, _):  # a declared mutation is functionalized: the op is the wrapper's first argument
        targets.extend(str(node.args[0] if "auto_functionalized" in str(node.target) else node.target)
                       for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    main_grads = []
    for compiled in (False, True):
        w = torch.nn.Parameter(w0.clone())
        w.main_grad = torch.ones(w.shape)
        slot = MainGradSlot()
        slot.refresh(w)
        fn = lambda inp: grouped_linear(inp, w, counts, None, None, None, main_grad_slot=slot)  # noqa: E731
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
        fn(x.clone().requires_grad_(True)).backward(dy)
        assert w.grad is None
        main_grads.append(w.main_grad)
    torch._dynamo.reset()
    assert "megafp8.add_experts_with_rows_into_.default" in targets, " ".join(sorted(set(targets)))
    assert torch.equal(main_grads[0], main_grads[1]) and bool((main_grads[1][1] == 1).all())


# The BF16 experts' weight-gradient add with idle experts left out, run by Triton's CPU interpreter.
INTERPRETED_EXPERTS_ADD = r'''
import torch
from megafp8.precision.kernels import experts_add
g = torch.Generator().manual_seed(0)
e, n, k = 4, 96, 100  # 9,600 elements an expert: a block and a part of one
out = torch.randn(e, n, k, generator=g)
x = torch.randn(e, n, k, generator=g).to(torch.bfloat16)
x[1] = float("nan")  # an expert without rows: its bytes must never be read
x[3] = float("nan")
before = out.clone()
offs = torch.tensor([7, 7, 300, 300], dtype=torch.int32)  # rows 7, 0, 293, 0
experts_add.add_experts_with_rows_(out, x, offs)
want = before.clone()
want[[0, 2]] += x[[0, 2]]  # torch's add of BF16 into FP32: the bits the kernel must give
assert torch.equal(out[[0, 2]], want[[0, 2]])
assert torch.equal(out[[1, 3]], before[[1, 3]])  # left exactly as they were
for bad in ((out.double(), x, offs), (out, x[:3], offs), (out, x, offs[:3]), (out.transpose(1, 2), x, offs)):
    try:
        experts_add.add_experts_with_rows_(*bad)
    except ValueError:
        pass
    else:
        raise AssertionError("bad operands were not refused")
print("ok")
'''


def test_the_bf16_experts_weight_gradient_add_skips_experts_without_rows_in_the_interpreter(tmp_path):
    """BF16 experts add their stacked weight gradient into FP32 `main_grad` in a pass of its own; on CUDA a Triton
    kernel adds only the experts with rows (an idle expert's gradient is zero: adding it moved 10 bytes a
    parameter for nothing). The experts with rows get `main_grad.add_(dw)`'s exact bits, the others are left
    untouched even where their gradient holds NaN (never read), and bad operands are refused. Triton's CPU
    interpreter runs the kernel."""
    from tests.scripts import run_in_triton_interpreter
    run_in_triton_interpreter(tmp_path, INTERPRETED_EXPERTS_ADD)


def test_the_bf16_experts_weight_gradient_add_on_the_cpu_is_the_whole_add():
    """Off CUDA the op adds everything (an idle expert's gradient is exact zeros there too)."""
    from megafp8.precision.grouped import add_experts_with_rows_into_
    out, x = torch.randn(3, 16, 8), torch.randn(3, 16, 8).bfloat16()
    want = out + x.float()
    add_experts_with_rows_into_(out, x, torch.tensor([2, 2, 9], dtype=torch.int32))
    assert torch.equal(out, want)


def test_bf16_grouped_linear_falls_back_to_the_loop_where_grouped_mm_cannot_run(monkeypatch):
    """Features that are not 16-byte multiples, and no rows at all: the per-expert loop, no `_grouped_mm`."""
    g = torch.Generator().manual_seed(2)
    for counts, k, n in (([3, 0, 4], 20, 12), ([0, 0], 256, 128)):
        x = torch.randn(sum(counts), k, generator=g).bfloat16()
        weight = torch.randn(len(counts), n, k, generator=g).bfloat16()
        dy = torch.randn(sum(counts), n, generator=g).bfloat16()
        y, dx, dw, _, calls = _plain_grouped_run(monkeypatch, True, x, weight, dy, counts)
        assert calls == 0 and y.shape == (sum(counts), n) and dx.shape == x.shape
        start = 0
        for e, c in enumerate(counts):
            rows = slice(start, start + c)
            torch.testing.assert_close(dw[e], (dy[rows].t() @ x[rows]) if c else torch.zeros_like(dw[e]))
            start += c


def test_partial_fp8_recipes_are_refused_for_experts_with_a_way_out(tiny_overrides):
    overrides = tiny_overrides + ["model.moe.ffn_hidden_size=128", "precision.fp8_wgrad=false"]
    for start in (0, 5):  # also when FP8 starts later: the error comes at start-up, not at the switch
        with pytest.raises(ConfigError, match=r"bf16_layers=\['\*.experts.\*'\]"):
            Trainer(load_config("tiny_moe_fp8", overrides + [f"precision.fp8_start_step={start}"]),
                    ParallelDims.single(), torch.device("cpu"))
    trainer = Trainer(load_config("tiny_moe_fp8", overrides + ["precision.bf16_layers=['*.experts.*']"]),
                      ParallelDims.single(), torch.device("cpu"))
    assert not trainer.model.layers[1].mlp.experts.gate_up_proj.runs_fp8


def _expert_mlp_outputs(experts, rows: RowSource, counts: list[int], dy: torch.Tensor) -> list[torch.Tensor]:
    """(y, d source, d w_gate_up, d w_down) of a RoutedExperts on `rows` (y in the order of the rows)."""
    source = rows.source.clone().requires_grad_()
    out, out_rows = experts(RowSource(source, rows.row_to_source, rows.source_to_rows), counts)
    y = out if out_rows is None else out[out_rows]
    (y.float() * dy).sum().backward()
    grads = [experts.gate_up_proj.weight.grad, experts.down_proj.weight.grad]
    experts.zero_grad(set_to_none=True)
    return [y.detach(), source.grad, *grads]


def test_fp8_experts_run_their_swiglu_mlp_as_one_function_within_fp8_tolerance_of_two_grouped_linears():
    """Under FP8 the experts' MLP stays in the padded layout from the first GEMM to the last, SwiGLU's kernels
    quantizing their FP32 outputs (the grouped linears' own forwards never run); sampled for FP8 health
    (`observed`) it runs as its two grouped linears. Both agree within FP8 rounding (one E4M3 ULP on a few
    percent of SwiGLU's outputs), an expert without rows gets exactly zero weight gradients, and both stay close
    to the BF16 experts."""
    from megafp8.model.moe import RoutedExperts

    torch.manual_seed(0)
    cfg = dataclasses.replace(MOE.moe, num_experts=3, ffn_hidden_size=128)
    experts = RoutedExperts(cfg, MOE.hidden_size, PrecisionRecipe.from_name("fp8"), ExpertParallel.single())
    bf16 = RoutedExperts(cfg, MOE.hidden_size, PrecisionRecipe.from_name("bf16"), ExpertParallel.single())
    for layer in (experts, bf16):
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(p.numel()))
    counts = [5, 0, 199]
    rows = _tokens_as_rows(sum(counts) // 3, 3, MOE.hidden_size)  # each token feeds three rows
    dy = torch.randn(sum(counts), MOE.hidden_size, generator=torch.Generator().manual_seed(1))
    calls = []
    for linear in (experts.gate_up_proj, experts.down_proj):
        linear.register_forward_hook(lambda *args: calls.append(1))
    fused = _expert_mlp_outputs(experts, rows, counts, dy)
    assert not calls, "the fused path ran a grouped linear's own forward"
    experts.observed = True
    unfused = _expert_mlp_outputs(experts, rows, counts, dy)
    assert len(calls) == 2
    plain = _expert_mlp_outputs(bf16, rows, counts, dy)
    for name, a, b, c in zip(("y", "dx", "dw gate/up", "dw down"), fused, unfused, plain):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.03, name
        assert float((a.float() - c.float()).norm() / c.float().norm()) < 0.1, name
    assert not fused[2][1].any() and not fused[3][1].any()  # the expert without rows


def test_fp8_experts_combining_their_own_output_match_the_separate_combine_within_fp8_rounding(monkeypatch):
    """With one EP rank the fused FP8 experts combine their own output (`CombinedOutput`): the same forward bits as
    the separate combine, and a backward that quantizes the experts' output gradient from the FP32 product
    w[t, j] * dout[t] instead of its BF16 copy: gradients within FP8 rounding of the separate path's, the routing
    weights' gradient (the same dot products) equal."""
    import megafp8.model.moe as moe_module

    calls = []
    counted = moe_module.combine_weights_grad
    monkeypatch.setattr(moe_module, "combine_weights_grad", lambda *args: calls.append(1) or counted(*args))
    results = []
    for separate in (False, True):
        moe = MoE(MOE.moe, MOE.hidden_size, PrecisionRecipe.from_name("fp8"), TensorParallel.single(),
                  ExpertParallel.single())
        init_weights(moe, MOE, seed=0)
        if separate:
            moe.experts.combined = lambda *args: None
        x = torch.randn(64, MOE.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
        y, aux = moe(x, batch=2, seq_len=32)
        (y.float().square().sum() + aux).backward()
        results.append([y, x.grad, moe.router.weight.grad, moe.experts.gate_up_proj.weight.grad,
                        moe.experts.down_proj.weight.grad])
    assert len(calls) == 1  # the combined run's backward only
    (fused, separate) = results
    assert torch.equal(fused[0], separate[0]) and torch.equal(fused[2], separate[2])  # output, router gradient
    for name, a, b in zip(("dx", "dw gate/up", "dw down"), (fused[1], *fused[3:]), (separate[1], *separate[3:])):
        err = float((a.float() - b.float()).norm() / b.float().norm())
        assert err < 0.03, (name, err)


def _moe_gemm_layers(moe: MoE) -> list:
    from megafp8.precision import GemmLayer
    return [m for m in moe.modules() if isinstance(m, GemmLayer)]


def _moe_micro_batches(moe: MoE, forward, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs and input gradients of each micro-batch, then each GEMM layer's FP32 main_grad (summed over the
    micro-batches) and every other parameter's gradient. Each micro-batch first prepares the GEMM layers, as
    `Block.forward` does before its compiled code."""
    layers = _moe_gemm_layers(moe)
    for p in moe.parameters():
        p.grad = None
    for layer in layers:
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
    results = []
    for x0 in inputs:
        for layer in layers:
            layer.prepare_for_compiled()
        x = x0.clone().requires_grad_()
        y, aux = forward(x, batch=2, seq_len=32)
        (y.float().square().sum() + aux).backward()
        results += [y, x.grad]
    results += [layer.weight.main_grad for layer in layers]
    return results + [p.grad for p in moe.parameters() if p.grad is not None]


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_a_moe_layer_compiles_into_one_graph_with_eager_bits(recipe):
    """With one EP rank the MoE layer traces whole (no graph break): the router and dispatch, the experts (FP8: the
    fused grouped MLP as custom ops, reading the weights prepared eagerly; BF16: `torch._grouped_mm`), and the
    weighted combine. Compiled (AOTAutograd, exact bits) over two micro-batches it gives eager's outputs, input
    gradients, FP32 main_grad of every GEMM layer (expert wgrads added in by the graph) and router gradients; each
    expert weight is quantized once."""
    torch._dynamo.reset()
    moe = MoE(MOE.moe, MOE.hidden_size, PrecisionRecipe.from_name(recipe), TensorParallel.single(),
              ExpertParallel.single())
    init_weights(moe, MOE, seed=0)
    inputs = [torch.randn(64, MOE.hidden_size, generator=torch.Generator().manual_seed(i)).bfloat16()
              for i in (1, 2)]
    for layer in _moe_gemm_layers(moe):
        layer.prepare_for_compiled()
    explained = torch._dynamo.explain(moe)(inputs[0], batch=2, seq_len=32)
    assert explained.graph_break_count == 0, explained.break_reasons
    code = "\n".join(g.print_readable(print_output=False) for g in explained.graphs)
    assert "megafp8.weighted_combine" in code
    if recipe == "fp8":
        assert "megafp8.grouped_gemm_1x128_128x128" in code and "megafp8.gather_quantize_rows_cols" in code
        assert "megafp8.quantize_weight" not in code  # experts with rows: the cache's own op, after routing
        assert code.count("megafp8.quantize_stale_experts") == 2
    else:
        assert "torch._grouped_mm" in code
    torch._dynamo.reset()
    eager = _moe_micro_batches(moe, moe, inputs)
    compiled = _moe_micro_batches(moe, torch.compile(moe, backend="aot_eager", fullgraph=True), inputs)
    assert len(eager) == len(compiled) > 8
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert torch.equal(a, b), i
    assert all(layer.weight.main_grad.any() for layer in _moe_gemm_layers(moe))
    if recipe == "fp8":
        assert [layer.fp8_cache.quantize_count for layer in (moe.experts.gate_up_proj, moe.experts.down_proj)] == [1, 1]


@pytest.mark.parametrize("interleave", [True, False])
def test_the_hopper_backends_grouped_fprop_and_dgrad_reach_the_kernel_with_its_ffma_interleaving(monkeypatch,
                                                                                                 interleave):
    """`HopperBackend.grouped_interleave_ffma` reaches `ws_gemm` through `gemm.grouped_gemm` (from `f6e6d2b` to
    `425867d` the pass-through was lost, and the grouped GEMMs ran the plain cubin whatever the backend asked). The
    kernel is replaced by a recorder: no GPU needed, only Triton with Gluon to import the kernel's module."""
    pytest.importorskip("triton.experimental.gluon")
    from megafp8.precision.backends.hopper_backend import HopperBackend
    from megafp8.precision.expert_layout import expert_rows
    from megafp8.precision.formats import E4M3
    from megafp8.precision.kernels import ws_gemm
    from megafp8.precision.backends.reference import QuantizedWeight

    calls = []
    monkeypatch.setattr(ws_gemm, "ws_gemm", lambda *args, **kwargs: calls.append(kwargs) or args[4])
    monkeypatch.setattr(HopperBackend, "grouped_interleave_ffma", interleave)
    backend = HopperBackend()  # (constructing it checks no device: the kernel never runs)
    a, a_scale = torch.zeros(256, 256, dtype=E4M3.dtype), torch.ones(256, 2)
    w = QuantizedWeight(torch.zeros(2, 384, 256, dtype=E4M3.dtype), torch.ones(2, 3, 2), None, None)
    backend.grouped_gemm_1x128_128x128(a, a_scale, w, False, expert_rows([128, 128], torch.device("cpu")),
                                       torch.bfloat16)
    assert len(calls) == 1 and calls[0]["interleave_ffma"] is interleave and calls[0]["b_blockwise"]
