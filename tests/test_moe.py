"""Mixture of experts: routing on hand-made scores, balancing, dropless dispatch, and expert parallelism
(EP=2, EP=4, EP=2 x TP=2 on gloo) against EP=1.

Tolerances. Under EP each expert sees the same rows in the same order as at EP=1 (sources are
concatenated in rank order), so outputs and gradients agree to 2^-6 of the largest magnitude in
BF16/FP8 (we see exact agreement for outputs, input and expert gradients). The shared expert's FP8
weight gradient is compared against a reference that saw every rank's tokens in one GEMM, whose
token tiles of the wgrad quantization differ: 2^-4 there (we see 3.6%). Whole-model
training over 5 steps: 0.5% on the loss, 3% on the gradient norm.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from megafp8.checkpoint import find_latest, load_checkpoint
from megafp8.config import ConfigError, ModelConfig, MoeConfig, load_config, validate_for_world
from megafp8.model import init_weights
from megafp8.model.moe import MoE, Router
from megafp8.parallel import ExpertParallel, ParallelDims, TensorParallel
from megafp8.parallel.experts import combine, dispatch
from megafp8.parallel.permute import RowSource, gather_rows
from megafp8.precision import PrecisionRecipe
from megafp8.train.trainer import Trainer
from tests.distributed import spawn
from tests.parity import LOW_PRECISION_TOL, assert_close, grad_pairs

MOE = ModelConfig(hidden_size=128, num_layers=2, num_heads=2,
                  moe=MoeConfig(num_experts=8, top_k=2, ffn_hidden_size=128, num_shared_experts=1, first_dense_layers=0,
                                n_group=4, topk_group=2, aux_loss_coeff=1e-2))
UNGROUPED = dataclasses.replace(MOE.moe, n_group=1, topk_group=1)


def test_group_limited_top_k_on_hand_made_scores():
    router = Router(MOE.moe, 128)
    # Groups {0,1} {2,3} {4,5} {6,7} score 0.99, 0.9, 0.0, 0.8 (sum of their two best): groups 0 and 1 are kept,
    # so expert 6 (the single best score) is out of reach.
    scores = torch.tensor([[0.5, 0.49, 0.45, 0.45, 0.0, 0.0, 0.8, 0.0]])
    assert sorted(router.select(scores)[0].tolist()) == [0, 1]
    flat = Router(UNGROUPED, 128)
    assert sorted(flat.select(scores)[0].tolist()) == [0, 6]
    # The bias steers the choice only: expert 3 gets picked, but weighs its own (unbiased) score.
    router.expert_bias[3] = 0.2
    chosen = router.select(scores)[0]
    assert sorted(chosen.tolist()) == [0, 3]


def test_weights_are_normalized_unbiased_scores_times_the_scaling_factor():
    router = Router(dataclasses.replace(UNGROUPED, routed_scaling_factor=2.5), 128)
    torch.nn.init.normal_(router.weight)
    router.expert_bias.uniform_(-0.5, 0.5)
    x = torch.randn(16, 128)
    weights, chosen, scores = router(x)
    expected = scores.gather(1, chosen)
    torch.testing.assert_close(weights, 2.5 * expected / expected.sum(-1, keepdim=True))
    assert router.load.sum().item() == 16 * 2


def test_bias_updates_move_a_skewed_load_toward_uniform():
    router = Router(UNGROUPED, 128)
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(8, 128, generator=g) * 0.1
    x = torch.randn(512, 128, generator=g) + 2.0 * router.weight.data[0] / router.weight.data[0].norm()  # skewed
    cvs = []
    for _ in range(300):
        router.load.zero_()
        router(x)
        cvs.append((router.load.std(unbiased=False) / router.load.mean()).item())
        router.update_bias(router.load, rate=1e-3)
    assert cvs[0] > 0.5, cvs[0]  # the skew is real
    assert cvs[-1] < cvs[0] / 3, (cvs[0], cvs[-1])


def test_count_per_expert_is_bincount():
    """The sync-free count (an integer scatter-add) equals `torch.bincount`, experts with no entries included."""
    from megafp8.parallel.experts import count_per_expert

    idx = torch.randint(0, 6, (50, 3), generator=torch.Generator().manual_seed(0))
    idx[idx == 4] = 5  # expert 4 gets nothing
    got = count_per_expert(idx, 7)
    assert got.dtype == torch.int64 and got.tolist() == torch.bincount(idx.flatten(), minlength=7).tolist()
    assert got[4] == 0 and got[6] == 0


def test_dispatch_and_combine_drop_nothing():
    x = torch.randn(10, 16)
    idx = torch.randint(0, 4, (10, 3))
    weights = torch.rand(10, 3)
    plan = dispatch(x, idx, 4, ExpertParallel.single())
    counts = plan.tokens_per_expert.tolist()
    assert sum(counts) == 30 and counts == torch.bincount(idx.flatten(), minlength=4).tolist()
    doubled = torch.cat([rows * (e + 1) for e, rows in enumerate(gather_rows(plan.rows).split(counts))])
    out = combine(doubled, None, weights, plan, ExpertParallel.single())
    expected = sum(weights[:, j:j + 1] * x * (idx[:, j:j + 1] + 1) for j in range(3))
    torch.testing.assert_close(out, expected)


# ------------------------------------------------------------------------------- expert parallel

def _layer_worker(rank, world, recipe_name, fp8_dispatch):
    recipe = PrecisionRecipe.from_name(recipe_name)
    ep = ExpertParallel(dist.group.WORLD, world, rank)
    moe = MoE(MOE.moe, MOE.hidden_size, recipe, TensorParallel.single(), ep, fp8_dispatch)
    ref = MoE(MOE.moe, MOE.hidden_size, recipe, TensorParallel.single(), ExpertParallel.single())
    init_weights(moe, MOE, seed=3)
    init_weights(ref, MOE, seed=3)
    # The reference combines after its experts as the EP ranks must (at EP=1 the fused FP8 experts would combine
    # their own output and quantize its gradient from FP32: `test_fp8_experts_combining_their_own_output...`).
    ref.experts.combined = lambda *args: None
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(40, 128, generator=g).to(recipe.param_dtype) for _ in range(world)]  # each rank's tokens
    dys = [torch.randn(40, 128, generator=g).to(recipe.param_dtype) for _ in range(world)]
    x = xs[rank].clone().requires_grad_(True)
    y, aux = moe(x, batch=2, seq_len=20)
    (y.float() * dys[rank].float()).sum().add(aux).backward()
    # The reference sees every rank's sequences at once; its balance loss is the mean over all of them, the
    # EP ranks' losses are means over their own two, so it is weighted by the number of ranks.
    x_ref = torch.cat(xs).requires_grad_(True)
    y_ref, aux_ref = ref(x_ref, batch=2 * world, seq_len=20)
    (y_ref.float() * torch.cat(dys).float()).sum().add(world * aux_ref).backward()
    rows = slice(40 * rank, 40 * (rank + 1))
    if fp8_dispatch:  # rows quantized for the all-to-all re-quantize to the same FP8 values in the expert GEMM
        assert torch.equal(y, y_ref[rows].detach())
    assert_close(y, y_ref[rows], "output", 2**-6)
    assert_close(x.grad, x_ref.grad[rows], "input gradient", 2**-6)
    # Replicated parameters saw this rank's tokens only (summed over the EP group); the reference saw every rank's.
    for name, grad, expected in grad_pairs(moe, ref, TensorParallel.single(), tokens_split_over=dist.group.WORLD):
        frac = 2**-6
        if not name.startswith("experts.") and recipe.fp8 is not None:
            frac = 2**-4  # the shared expert's FP8 wgrad tiles 40 tokens here, 40 x world there
        elif name.startswith("experts.") and fp8_dispatch:
            frac = 2**-3  # the experts get FP8-rounded rows: their x^T for wgrad is quantized a second time
        assert_close(grad, expected, name, frac)
    assert moe.experts.num_local == 8 // world and moe.experts.down_proj.weight.expert_slice == (rank * 8 // world, 8)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_expert_parallel_layer_matches_ep1(world, recipe):
    spawn(world, _layer_worker, recipe, False)


def test_fp8_dispatch_gives_the_same_output_bit_for_bit():
    """FP8 rows dequantized after the all-to-all re-quantize to the same FP8 values in the expert GEMM, so the
    layer's output equals EP=1's (which sends nothing) exactly."""
    spawn(2, _layer_worker, "fp8", True)


# ------------------------------------------------------------------------------------ whole model

MODEL = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
         "model.vocab_size=512", "training.steps=5", "training.eval_interval=0", "model.moe.ffn_hidden_size=128"]


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_ep2_training_matches_ep1(parity, recipe):
    ref, got = parity.check(MODEL + [f"precision.recipe={recipe}"], ["parallel.ep=2"], 2, LOW_PRECISION_TOL,
                            "tiny_moe_fp8")
    for a, b in zip(ref.train, got.train):
        assert b["moe_dropped_tokens"] == 0 and b["moe_load_cv"] >= 0
        assert math.isclose(a["moe_bias_abs_max"], b["moe_bias_abs_max"], rel_tol=1e-6)


def test_ep2_compiled_training_matches_one_eager_rank(parity):
    """torch.compile with EP=2 (the experts' GEMMs eager inside the compiled blocks: the next test) trains like one
    eager rank."""
    parity.check(MODEL + ["precision.recipe=fp8"], ["parallel.ep=2", "training.compile=true"], 2, LOW_PRECISION_TOL,
                 "tiny_moe_fp8")


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_experts_trace_with_one_ep_rank_and_run_eagerly_across_several(recipe):
    """With one EP rank the routed experts are traced (no graph break); across EP ranks their gathers and grouped
    GEMMs run eagerly inside compiled code, where the rows received change in number every step and a traced graph
    would compile anew."""
    from megafp8.model.moe import RoutedExperts

    cfg = dataclasses.replace(MOE.moe, num_experts=4, ffn_hidden_size=128)
    for ep, counts, traced in ((ExpertParallel.single(), [40, 0, 50, 38], True),
                               (ExpertParallel(None, 2, 0), [40, 24], False)):
        torch._dynamo.reset()
        experts = RoutedExperts(cfg, MOE.hidden_size, PrecisionRecipe.from_name(recipe), ep)
        init_weights(experts, MOE, seed=0)
        for layer in (experts.gate_up_proj, experts.down_proj):
            layer.prepare_for_compiled()  # as `Block.forward` does before its compiled code
        assert experts.num_local == len(counts)
        rows = _tokens_as_rows(sum(counts) // 2, 2, MOE.hidden_size)
        explained = torch._dynamo.explain(experts)(rows, torch.tensor(counts))
        code = "\n".join(g.print_readable(print_output=False) for g in explained.graphs)
        expert_ops = ("_grouped_mm", "megafp8.")  # the grouped GEMMs, the quantizers, the gathers
        if traced:
            assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
            assert any(op in code for op in expert_ops)
        else:  # the gathers and GEMMs run eagerly; BF16's SwiGLU between them is still compiled
            assert not any(op in code for op in expert_ops), code
            assert ("silu" in code) == (recipe == "bf16"), code


def test_a_bf16_expert_weight_off_a_16_byte_boundary_runs_its_grouped_gemms_eagerly():
    """`torch._grouped_mm` needs 16-byte aligned operands. Weights are views into flat buffers, and traced code
    cannot ask for an address, so `prepare_for_compiled` reads it: a weight off the boundary keeps its grouped GEMMs
    out of the graph (eagerly, the per-expert loop takes it) and gives the same output."""
    from megafp8.model.moe import RoutedExperts

    cfg = dataclasses.replace(MOE.moe, num_experts=2, ffn_hidden_size=128)
    experts = RoutedExperts(cfg, MOE.hidden_size, PrecisionRecipe.from_name("bf16"), ExpertParallel.single())
    init_weights(experts, MOE, seed=0)
    rows, counts = _tokens_as_rows(40, 2, MOE.hidden_size), torch.tensor([50, 30])
    want = experts(rows, counts)[0]
    flat = torch.empty(experts.down_proj.weight.numel() + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view_as(experts.down_proj.weight).copy_(experts.down_proj.weight)  # 2 bytes off
    experts.down_proj.weight = torch.nn.Parameter(shifted)
    assert experts.down_proj.weight.data_ptr() % 16 == 2
    for layer in (experts.gate_up_proj, experts.down_proj):
        layer.prepare_for_compiled()
    assert experts.gate_up_proj.weight_aligned and not experts.down_proj.weight_aligned
    torch._dynamo.reset()
    explained = torch._dynamo.explain(experts)(rows, counts)
    code = "\n".join(g.print_readable(print_output=False) for g in explained.graphs)
    assert code.count('" = torch._grouped_mm(') == 3, code  # gate/up's fprop, dgrad and wgrad only
    assert torch.equal(torch.compile(experts, backend="aot_eager")(rows, counts)[0], want)


def test_ep2_x_tp2_training_matches_one_rank(parity):
    # Two shared experts: their 256-wide SwiGLU splits into 128-wide TP shards.
    parity.check(MODEL + ["precision.recipe=bf16", "model.moe.num_shared_experts=2"],
                 ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"], 4, LOW_PRECISION_TOL,
                 "tiny_moe_fp8")


def _save_worker(rank, world, overrides):
    cfg = load_config("tiny_moe_fp8", overrides)
    Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu")).fit()


def test_ep2_checkpoint_resumes_at_ep1_with_every_expert_and_bias(tiny_overrides, tmp_path):
    base = tiny_overrides + MODEL + ["training.steps=3", "checkpoint.interval=3", f"checkpoint.dir={tmp_path}/ck"]
    spawn(2, _save_worker, base + ["parallel.ep=2"])
    saved = load_checkpoint(find_latest(tmp_path / "ck"))
    assert saved["model"]["layers.1.mlp.experts.gate_up_proj.weight"].shape == (8, 256, 128)  # every expert
    assert saved["optimizer"]["masters"]["layers.1.mlp.experts.down_proj.weight"].shape == (8, 128, 128)
    assert saved["model"]["layers.1.mlp.router.expert_bias"].abs().max() > 0
    resumed = Trainer(load_config("tiny_moe_fp8", base + ["training.steps=4"]), ParallelDims.single(),
                      torch.device("cpu"))
    state = resumed.model.state_dict()
    assert all(torch.equal(state[k], saved["model"][k]) for k in saved["model"])
    resumed.fit()


@pytest.mark.parametrize("overrides, message", [
    (["parallel.ep=3"], r"model.moe.num_experts=8 is not divisible by parallel.ep=3"),
    (["model.moe.top_k=9"], r"model.moe.top_k=9 exceeds model.moe.num_experts=8"),
    (["model.moe.n_group=3"], r"model.moe.n_group=3 must divide model.moe.num_experts=8"),
    (["model.moe.top_k=6", "model.moe.topk_group=2"], r"top_k=6 exceeds the 4 experts of the topk_group=2 groups a "
                                                      r"token may use: raise model.moe.topk_group"),
    (["model.moe.num_experts=0", "parallel.ep=2"], r"parallel.ep=2 needs a mixture-of-experts model"),
])
def test_bad_moe_configs_give_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_for_world(load_config("tiny_moe_fp8", overrides), 6)


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


def _tokens_as_rows(tokens: int, k: int, hidden: int) -> RowSource:
    """Rows in a shuffled order, each of `tokens` random BF16 tokens feeding k of them (as a dispatch with top-k)."""
    g = torch.Generator().manual_seed(3)
    source = torch.randn(tokens, hidden, generator=g).bfloat16()
    row_to_source = torch.randperm(tokens * k, generator=g) // k
    source_to_rows = torch.argsort(row_to_source, stable=True).view(tokens, k)
    return RowSource(source, row_to_source, source_to_rows)


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
        assert "megafp8.quantize_weight" not in code
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
