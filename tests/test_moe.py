"""Mixture of experts: routing on hand-made scores, balancing, dropless dispatch, and expert parallelism
(EP=2, EP=4, EP=2 x TP=2 on gloo) against EP=1. (The grouped expert layers themselves: `tests/test_moe_experts.py`.)

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


def test_one_expert_a_token_learns_its_router_only_with_unnormalized_weights():
    """With top_k=1 a normalized weight is s / s = 1: the router's weight gets no gradient from the loss (the reason
    `model.moe.top_k=1` with `norm_topk_prob=true` is refused); left unnormalized, the expert's output carries s."""
    grads = {}
    for norm in (True, False):
        moe = dataclasses.replace(UNGROUPED, top_k=1, norm_topk_prob=norm, num_shared_experts=0, aux_loss_coeff=0.0)
        layer = MoE(moe, 128, PrecisionRecipe.from_name("fp32"), TensorParallel.single(), ExpertParallel.single())
        init_weights(layer, dataclasses.replace(MOE, moe=moe), seed=0)
        y, _ = layer(torch.randn(40, 128, generator=torch.Generator().manual_seed(0)), batch=2, seq_len=20)
        y.square().sum().backward()
        grads[norm] = layer.router.weight.grad.abs().max().item()
    assert grads[True] < 1e-6 * grads[False], grads


def test_weights_are_normalized_unbiased_scores_times_the_scaling_factor():
    router = Router(dataclasses.replace(UNGROUPED, routed_scaling_factor=2.5), 128)
    torch.nn.init.normal_(router.weight)
    router.expert_bias.uniform_(-0.5, 0.5)
    x = torch.randn(16, 128)
    weights, chosen, scores = router(x)
    expected = scores.gather(1, chosen)
    torch.testing.assert_close(weights, 2.5 * expected / expected.sum(-1, keepdim=True))
    assert router.load.sum().item() == 16 * 2


def test_chosen_scores_that_all_underflow_give_zero_weights_not_nan():
    """Sigmoid scores of logits below ~-88 are 0 in FP32: normalized without DeepSeek-V3's 1e-20, the token's
    weights were 0 / 0 (NaN), and every step after it was skipped as non-finite."""
    router = Router(UNGROUPED, 128)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.linspace(0.5, 1.0, 8)  # each expert's logit: a multiple of the token's first value
    x = torch.zeros(2, 128)
    x[0, 0], x[1, 0] = 1.0, -200.0  # token 1's logits are -100 to -200
    weights, _, scores = router(x)
    assert (scores[1] == 0).all() and torch.isfinite(weights).all() and (weights[1] == 0).all()
    assert weights[0].sum().item() == pytest.approx(MOE.moe.routed_scaling_factor)


def test_expert_loads_count_exactly_past_two_to_the_24():
    """An expert's count and the counts' sum were FP32: past 2^24 (16.7M: a collapsed router at scale, or any
    step's sum over experts and layers with a 4M-token batch) +1 was lost, and moe_dropped_tokens logged assignments
    as dropped that were not."""
    from megafp8.train.expert_balance import ExpertBalance

    router = Router(UNGROUPED, 128)
    router.load.fill_(2.0**24)
    router(torch.randn(1, 128))
    assert router.load.sum().item() == 8 * 2.0**24 + UNGROUPED.top_k
    balance = ExpertBalance([router], UNGROUPED, ParallelDims.single())
    balance(None)
    tokens = (8 * 2**24) // UNGROUPED.top_k + 1  # every assignment routed: none dropped
    assert balance.record(tokens, seq_len=1)["moe_dropped_tokens"] == 0


def test_mtp_positions_without_a_target_are_left_out_of_the_expert_loads(tiny_overrides):
    """MTP depth k's last k positions have no target in the sample (their inputs repeat its last token): they reach
    no loss, yet their routing counted into the expert loads that move the balancing bias and fill the log's moe_*
    figures (k / seq_len of the MTP layers' counts). The main layers still count every token, as before."""
    from megafp8.model.moe import routers
    from megafp8.parallel.experts import count_per_expert

    cfg = load_config("tiny_moe_fp8", tiny_overrides + [
        "precision.recipe=fp32", "model.mtp_depth=2", "training.steps=1", "training.eval_interval=0",
        "optimizer.warmup_steps=1"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    named = routers(trainer.model)
    chosen: dict[str, list[torch.Tensor]] = {}  # each router's choice per micro-batch: (B*T, top_k)
    for name, router in named:
        router.register_forward_hook(lambda _, args, out, name=name: chosen.setdefault(name, []).append(out[1]))
    [record] = [r for r in trainer.fit() if r["kind"] == "train"]
    seq_len, top_k = cfg.data.seq_len, cfg.model.moe.top_k
    assert [name for name, _ in named] == ["layers.1.mlp.router", "mtp.0.block.mlp.router", "mtp.1.block.mlp.router"]
    for (name, _), loads, tail in zip(named, trainer.expert_balance.loads, [0, 1, 2]):
        kept = [c.view(-1, seq_len, top_k)[:, :seq_len - tail] for c in chosen[name]]
        assert torch.equal(loads, sum(count_per_expert(c, 8) for c in kept).double()), name
    assert record["moe_dropped_tokens"] == 0


def test_the_counted_tokens_are_found_by_position_under_sequence_and_context_parallelism():
    """A rank's tokens are a slice of the micro-batch under sequence parallelism, and under context parallelism its
    two chunks of each sequence: rank 0 of two holds chunks 0 and 3, so the sequence's end."""
    from megafp8.model.moe import counted_tokens
    from megafp8.parallel import ContextParallel

    cpu = torch.device("cpu")
    # tokens 4-9 of sequences of 5 (a TP rank's slice): positions 4, 0, 1, 2, 3, 4; the last 2 of each not counted
    assert counted_tokens(6, 4, 5, 2, ContextParallel.single(), cpu).tolist() == [False, True, True, True, False, False]
    first, second = (counted_tokens(8, 0, 8, 2, ContextParallel(None, 2, r), cpu).tolist() for r in (0, 1))
    assert first == [True] * 6 + [False] * 2 and second == [True] * 8


def test_an_mtp_depth_s_balance_loss_is_that_of_the_positions_with_a_target():
    """Depth k's sequence-wise balance loss sums over the T - k positions that have a target (DeepSeek-V3 runs depth k
    on T - k tokens): the same loss as the truncated sequences' own, whatever the last k positions chose."""
    from megafp8.model.moe import counted_tokens, sequence_balance_loss
    from megafp8.parallel import ContextParallel

    batch, seq_len, tail, experts, top_k = 3, 8, 2, 6, 2
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(batch * seq_len, experts, generator=g)
    chosen = scores.topk(top_k, dim=-1).indices
    single, cpu = ContextParallel.single(), torch.device("cpu")
    counted = counted_tokens(batch * seq_len, 0, seq_len, tail, single, cpu)
    masked = sequence_balance_loss(scores, chosen, batch, seq_len, 0, TensorParallel.single(), single, counted, tail)
    keep = torch.arange(batch * seq_len) % seq_len < seq_len - tail
    truncated = sequence_balance_loss(scores[keep], chosen[keep], batch, seq_len - tail, 0, TensorParallel.single())
    torch.testing.assert_close(masked, truncated, rtol=1e-6, atol=0)
    everything = sequence_balance_loss(scores, chosen, batch, seq_len, 0, TensorParallel.single())
    assert not torch.allclose(masked, everything)  # the tail changes the loss where it is counted


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


def _no_rows_worker(rank, world, recipe_name, fp8_dispatch, observed):
    recipe = PrecisionRecipe.from_name(recipe_name)
    ep = ExpertParallel(dist.group.WORLD, world, rank)
    moe = MoE(MOE.moe, MOE.hidden_size, recipe, TensorParallel.single(), ep, fp8_dispatch)
    init_weights(moe, MOE, seed=3)
    moe.experts.observed = observed  # FP8 health's sampled steps: the experts unfused
    moe.router.expert_bias[8 // world:] = -100.0  # every token to rank 0's experts: the other ranks receive no rows
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(rank)).to(recipe.param_dtype)
    x.requires_grad_(True)
    for _ in range(2):  # the collectives of the second pass pair up only if the first's all did
        y, aux = moe(x, batch=2, seq_len=20)
        y.float().sum().add(aux).backward()
    assert torch.isfinite(x.grad).all()
    down = moe.experts.down_proj.weight
    grad = down.grad if down.grad is not None else down.main_grad
    assert (grad.abs().sum() > 0) == (rank == 0), grad.abs().sum()


@pytest.mark.parametrize("recipe, fp8_dispatch, observed", [("bf16", False, False), ("fp8", False, False),
                                                            ("fp8", True, False), ("fp8", False, True)])
def test_an_ep_rank_that_receives_no_rows_takes_part_in_every_all_to_all(recipe, fp8_dispatch, observed):
    """Routing that sends every token to one rank's experts: the others run their experts on zero rows (the FP8
    experts then take the unfused path, `RoutedExperts._runs_fused`) and still call each all-to-all their peers
    call, forward and backward."""
    spawn(2, _no_rows_worker, recipe, fp8_dispatch, observed)


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


@pytest.mark.parametrize("eval_iters", [1, 3])
def test_ep2_evaluates_micro_batches_that_do_not_divide_over_its_ranks(parity, eval_iters):
    """A held-out set of 1 or 3 micro-batches over 2 EP ranks: the rank with fewer runs one more forward, not
    counted, so its experts' all-to-alls pair with its peer's (before, it left the collective early: a hang on
    NCCL, an error on gloo), and the loss is that of one rank evaluating them all."""
    evaluating = MODEL + ["precision.recipe=bf16", "training.steps=2", "training.eval_interval=2",
                          f"training.eval_iters={eval_iters}"]
    parity.check(evaluating, ["parallel.ep=2"], 2, LOW_PRECISION_TOL, "tiny_moe_fp8", evals=1)


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
    (["model.moe.top_k=1"], r"top_k=1 with model.moe.norm_topk_prob=true weighs every token's expert 1, so the "
                            r"router's weight gets no gradient from the loss and never learns: set "
                            r"model.moe.norm_topk_prob=false"),
])
def test_bad_moe_configs_give_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_for_world(load_config("tiny_moe_fp8", overrides), 6)


def _tokens_as_rows(tokens: int, k: int, hidden: int) -> RowSource:
    """Rows in a shuffled order, each of `tokens` random BF16 tokens feeding k of them (as a dispatch with top-k)."""
    g = torch.Generator().manual_seed(3)
    source = torch.randn(tokens, hidden, generator=g).bfloat16()
    row_to_source = torch.randperm(tokens * k, generator=g) // k
    source_to_rows = torch.argsort(row_to_source, stable=True).view(tokens, k)
    return RowSource(source, row_to_source, source_to_rows)


def test_expert_load_stats_give_the_spread_the_busiest_and_the_idle_share():
    """The balance figures the log and `train_step.py` print, on two layers of four experts (mean 4 each)."""
    from megafp8.model.moe import expert_load_stats
    from megafp8.train.metrics import format_step_line
    stats = expert_load_stats(torch.tensor([[4.0, 4.0, 4.0, 4.0], [16.0, 0.0, 0.0, 0.0]]))
    assert stats["moe_load_max_over_mean"] == 4.0 and stats["moe_load_min_over_mean"] == 0.0
    assert stats["moe_idle_experts"] == 3 / 8
    assert abs(stats["moe_load_cv"] - (0 + 3 ** 0.5) / 2) < 1e-6
    assert stats == expert_load_stats(torch.tensor([[4.0, 4.0, 4.0, 4.0], [0.0, 0.0, 16.0, 0.0]]))
    assert expert_load_stats(torch.ones(2, 4))["moe_idle_experts"] == 0.0
    record = dict(step=3, loss=2.0, lr=1e-4, grad_norm=1.0, tokens_per_s=1e3, mfu=None, elapsed_s=1, remaining_s=1,
                  **stats)
    assert "| expert load cv 0.87 max 4.00x idle 38% |" in format_step_line(record, 10)
