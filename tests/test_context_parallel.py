"""Context parallelism (`parallel.cp`, `megafp8.parallel.context`): each rank's zig-zag chunks attend to the
gathered sequence as causal attention over the whole sequence would, and training at cp=2 (with data, tensor and
pipeline parallelism, MoE and its sequence-wise balance loss, MLA, multi-token prediction) gives the one-rank run's
losses and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megafp8.config import ConfigError, load_config
from megafp8.parallel import ContextParallel
from megafp8.parallel.context import attend_chunks, natural_order
from megafp8.parallel.dims import rank_groups
from tests.parity import FP32_TOL, LOW_PRECISION_TOL

FP32 = ["precision.recipe=fp32", "training.eval_interval=3"]
TP_HEADS = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
            "model.vocab_size=512"]  # tensor-parallel shards of whole 128-wide tiles
MLA = ["model.attention.kind=mla", "model.attention.q_lora_rank=64", "model.attention.kv_lora_rank=64",
       "model.attention.qk_nope_head_dim=32", "model.attention.qk_rope_head_dim=16", "model.attention.v_head_dim=32",
       "model.num_heads=4"]  # keys 48 wide, values 32


def test_each_rank_holds_two_chunks_whose_work_balances():
    """Rank r of cp holds chunks r and 2cp-1-r of 2cp: every position once over the group, each rank's keys seen
    (a causal attention's work) the same; gathered rank by rank, `natural_order` finds each chunk."""
    for cp in (1, 2, 4):
        seq = 8 * 2 * cp
        held = [ContextParallel(None, cp, r).positions(seq) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(seq))
        assert len({int((p + 1).sum()) for p in held}) == 1  # keys seen per rank: sum over its positions of (p + 1)
        gathered = torch.cat(held)
        chunks = gathered.view(2 * cp, -1)[torch.tensor(natural_order(cp))]
        assert chunks.flatten().tolist() == list(range(seq))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads, kv_heads, v_dim", [(4, 4, 16), (4, 2, 16), (4, 4, 8)], ids=["mha", "gqa", "mla"])
def test_the_ranks_chunks_attend_as_causal_attention_over_the_whole_sequence(cp, heads, kv_heads, v_dim):
    """Each rank's queries against the gathered keys, outputs and gradients put back in sequence order, equal causal
    SDPA over the whole sequence (FP32; the reference path, which the GPU test holds the kernels to)."""
    torch.manual_seed(0)
    batch, seq, dim = 2, 16 * cp, 16
    q = torch.randn(batch, seq, heads, dim, requires_grad=True)
    k = torch.randn(batch, seq, kv_heads, dim, requires_grad=True)
    v = torch.randn(batch, seq, kv_heads, v_dim, requires_grad=True)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=heads != kv_heads).transpose(1, 2)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    got = torch.empty_like(want)
    loss = 0.0
    for rank in range(cp):
        group = ContextParallel(None, cp, rank)
        where = group.positions(seq)
        out = attend_chunks(q[:, where], k, v, group)
        got[:, where] = out.detach()
        loss = loss + (out * grad_out[:, where]).sum()
    got_grads = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_context_parallel_groups_are_consecutive_data_parallel_ranks():
    groups = rank_groups(16, tp=2, pp=2, ep=2, cp=2)
    assert groups["cp"][:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert all(len(g) == 2 for g in groups["cp"]) and len(groups["cp"]) == 8
    dp = {tuple(g) for g in groups["dp"]}
    assert all(any(set(c) <= set(d) for d in dp) for c in groups["cp"])  # inside one data-parallel group


# Causal attention over 64 tokens in 4 chunks of 16 (cp=2); the tiny models' defaults otherwise.
@pytest.mark.parametrize("config, layout, world, extra", [
    ("tiny_dense", ["parallel.cp=2"], 2, []),
    ("tiny_dense", ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], 4, TP_HEADS),
    ("tiny_dense", ["parallel.cp=2", "parallel.pp=2"], 4, ["model.num_layers=4"]),
    ("tiny_dense", ["parallel.cp=2", "optimizer.sharded=true"], 4, []),
    ("tiny_moe_fp8", ["parallel.cp=2"], 2, ["model.moe.aux_loss_coeff=0.01"]),
    ("tiny_dense", ["parallel.cp=2"], 2, MLA),
    ("tiny_dense", ["parallel.cp=2"], 2, ["model.mtp_depth=2"]),
    ("tiny_dense", ["parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule=zbv"], 4,
     ["model.num_layers=4", "model.mtp_depth=1"]),
], ids=["cp2", "cp2_tp2_sp", "cp2_pp2", "cp2_dp2_sharded", "moe_balance_loss", "mla", "mtp_depth2", "mtp_pp2_zbv"])
def test_cp2_training_matches_one_rank(parity, config, layout, world, extra):
    parity.check(FP32 + extra, layout, world, FP32_TOL, config, evals=2)


@pytest.mark.parametrize("config, extra", [
    # Slow tests (cold, ~30 s the dense FP8 case and ~50 s the MoE one compiling on two cores; the suite neared 13
    # minutes of CI's 15 with them): the eager CP tests above cover what they compute, the compiled TP + SP tests
    # (tests/test_tensor_parallel.py) the same collectives' autograd functions traced, and the GPU test below the
    # chunks' attention compiled (fullgraph).
    pytest.param("tiny_dense", ["precision.recipe=fp8", *TP_HEADS], marks=pytest.mark.slow),
    pytest.param("tiny_moe_fp8", ["precision.recipe=bf16", "model.moe.aux_loss_coeff=0.01"], marks=pytest.mark.slow),
], ids=["dense_fp8", "moe_bf16_balance_loss"])
def test_compiled_cp2_training_matches_one_rank(parity, config, extra):
    """Compiled blocks at CP=2: the keys' and values' gather, the chunks' attention and the balance loss's sums
    over the group traced into the graphs, training as the eager one-rank run does."""
    short = ["training.steps=3", "training.eval_interval=0", "optimizer.warmup_steps=1"]  # compiling takes the time
    parity.check(extra + short, ["parallel.cp=2", "training.compile=true"], 2, LOW_PRECISION_TOL, config)


def test_fp8_cp2_training_matches_one_rank(parity):
    """FP8 (the reference backend on CPU), heads of 128: the fused QKV projection + RoPE reads the rank's own rows of
    the RoPE tables; each rank quantizes its own tokens' tiles; the same training within low-precision noise."""
    parity.check(["precision.recipe=fp8", *TP_HEADS], ["parallel.cp=2"], 2, LOW_PRECISION_TOL, "tiny_dense",
                 evals=2)


@pytest.mark.parametrize("setting, world, message", [
    (["parallel.cp=3"], 4, r"parallel.cp=3 must divide the data-parallel ranks \(4\)"),
    (["parallel.cp=2", "data.seq_len=66"], 2, r"data.seq_len=66 does not split into 2 x parallel.cp = 4 equal "
                                                r"chunks"),
    (["parallel.cp=0"], 1, r"parallel.cp must be at least 1"),
    (["parallel.cp=2", "model.attention_backend=cudnn"], 2, r"model.attention_backend=cudnn with parallel.cp=2"),
    (["parallel.cp=2", "training.global_batch_size=4", "training.micro_batch_size=4"], 4,
     r"training.global_batch_size=4 must be a multiple of micro_batch_size x data-parallel replicas = 4 x 2 = 8"),
])
def test_layouts_context_parallelism_cannot_run_are_refused(tiny_overrides, setting, world, message):
    from megafp8.config import validate_for_world

    cfg = load_config("tiny_dense", tiny_overrides + setting)
    with pytest.raises(ConfigError, match=message):
        validate_for_world(cfg, world)


def test_the_planner_counts_a_ranks_share_of_each_sequence_and_the_gathered_keys_and_values(tiny_overrides):
    """At cp=2 a block keeps its share of the tokens, except attention's keys and values (gathered: the whole
    sequences') and the chunks' joined output (one more copy); the plan per rank falls accordingly."""
    from megafp8.model import Transformer
    from megafp8.precision import PrecisionRecipe
    from megafp8.train.activations import MicroBatch, block_saved
    from megafp8.train.plan import make_plan

    shape = tiny_overrides + ["model.attention.num_kv_heads=2", "model.vocab_size=512"]
    saved = {}
    for cp in (1, 2):
        cfg = load_config("tiny_dense", shape + [f"parallel.cp={cp}"])
        model = Transformer(cfg.model, PrecisionRecipe.from_name("bf16"), cfg.data.seq_len, device="meta",
                            cp=ContextParallel(None, cp, 0))
        saved[cp] = block_saved(model.layers["0"], MicroBatch.of(cfg)).tensors
    for name, nbytes in saved[1].items():
        whole = name in ("attn.k_rotated", "attn.v")
        assert saved[2][name] == (nbytes if whole else nbytes / 2), name
    assert set(saved[2]) - set(saved[1]) == {"attn.attention_out_chunks"}
    assert saved[2]["attn.attention_out_chunks"] == saved[2]["attn.attention_out"]
    plans = {cp: make_plan(load_config("tiny_dense", shape + [f"parallel.cp={cp}"]), cp).bytes_per_rank
             for cp in (1, 2)}
    assert 0.5 * plans[1]["activations"] < plans[2]["activations"] < 0.75 * plans[1]["activations"]
    assert plans[2]["logits_and_loss"] == plans[1]["logits_and_loss"] / 2


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, dim, v_dim", [(8, 2, 128, 128), (8, 8, 192, 128)], ids=["gqa", "mla"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_cuda_kernels_attend_the_chunks_as_the_reference_does(heads, kv_heads, dim, v_dim, compiled):
    """BF16 on CUDA: FlashAttention-2 (grouped-query heads as they are) and the memory-efficient kernel (MLA's
    narrower values), both causal from the bottom right, give the FP32 reference's outputs and gradients to BF16
    rounding, and whole-sequence causal SDPA's once the ranks' chunks are put back in order; compiled too. The keys
    and values come strided, as `context_attention` gathers them."""
    torch.manual_seed(0)
    cp, batch, seq = 2, 2, 1024
    device = torch.device("cuda", 0)
    q = torch.randn(batch, seq, heads, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, seq, kv_heads, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, seq, kv_heads, v_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(batch, seq, heads, v_dim, device=device, dtype=torch.bfloat16)
    attend = torch.compile(attend_chunks, fullgraph=True) if compiled else attend_chunks
    # The layout `context_attention` hands the kernels: the gathered keys and values one tokens-first tensor,
    # seen batch-first and split along the last dim (strided, not contiguous).
    kv = torch.cat([k.transpose(0, 1), v.transpose(0, 1)], dim=-1).transpose(0, 1)
    k_all, v_all = kv[..., :dim], kv[..., dim:]

    def run(fn):
        out = torch.empty(batch, seq, heads, v_dim, device=device, dtype=torch.float32)
        loss = 0.0
        for rank in range(cp):
            group = ContextParallel(None, cp, rank)
            where = group.positions(seq).to(device)
            got = fn(q[:, where], k_all, v_all, group)
            out[:, where] = got.detach().float()
            loss = loss + (got.float() * grad_out[:, where].float()).sum()
        return [out, *torch.autograd.grad(loss, (q, k, v))]

    from megafp8.parallel import context

    kernels = run(attend)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(context, "lower_right_attention", context.lower_right_attention_reference)
        reference = run(attend_chunks)
    whole = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=heads != kv_heads).transpose(1, 2)
    sdpa = [whole.float(), *torch.autograd.grad((whole.float() * grad_out.float()).sum(), (q, k, v))]
    for name, got, ref, other in zip(("out", "dq", "dk", "dv"), kernels, reference, sdpa):
        scale = ref.float().abs().max()
        assert (got.float() - ref.float()).abs().max() <= 0.02 * scale, name
        assert (got.float() - other.float()).abs().max() <= 0.02 * scale, name
