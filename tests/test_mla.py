"""Multi-head latent attention: shapes, causality, the FP8 plan around its unaligned kv_a, TP=2 against TP=1
(gloo), and a tiny MLA + MoE model that trains.

Tolerances as in test_tensor_parallel.py: FP32 layers agree with their unsharded selves to 1e-5 of the
largest magnitude, BF16/FP8 to 2^-6."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megafp8.config import ConfigError, MlaConfig, ModelConfig, load_config, validate_for_world
from megafp8.data import validation_batches
from megafp8.model import Transformer, init_weights
from megafp8.model.mla import MultiHeadLatentAttention
from megafp8.model.rope import RotaryEmbedding
from megafp8.parallel import ParallelDims, TensorParallel
from megafp8.precision import PrecisionRecipe
from megafp8.train.trainer import Trainer
from tests.distributed import spawn
from tests.parity import assert_close, grad_pairs

MLA = ModelConfig(hidden_size=256, num_layers=2, num_heads=4, ffn_hidden_size=256, vocab_size=384,
                  attention=MlaConfig(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
                                      v_head_dim=64))
MLA_OVERRIDES = ["model.attention.kind=mla", "model.attention.q_lora_rank=128", "model.attention.kv_lora_rank=128",
                 "model.attention.qk_nope_head_dim=64", "model.attention.qk_rope_head_dim=64",
                 "model.attention.v_head_dim=64"]


@pytest.mark.parametrize("q_lora_rank", [128, None])
def test_shapes_and_causality(q_lora_rank):
    cfg = dataclasses.replace(MLA, attention=dataclasses.replace(MLA.attention, q_lora_rank=q_lora_rank))
    model = Transformer(cfg, PrecisionRecipe.from_name("fp32"), max_seq_len=32)
    init_weights(model, cfg, seed=0)
    tokens = torch.randint(0, 384, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 384)
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 384  # the future must not leak into positions < 20
    torch.testing.assert_close(model(changed)[:, :20], logits[:, :20])
    assert not torch.allclose(model(changed)[:, 20:], logits[:, 20:])


def test_fp8_plan_keeps_the_unaligned_kv_down_projection_in_bf16():
    cfg = load_config("tiny_dense", MLA_OVERRIDES + ["precision.recipe=fp8", "model.vocab_size=384"])
    from megafp8.train.build import build_model

    model = build_model(cfg, cfg.model, PrecisionRecipe.from_config(cfg.precision), torch.device("cpu"))
    attn = model.layers[0].attn
    assert attn.kv_a_proj.weight.shape == (128 + 64, 256) and not attn.kv_a_proj.runs_fp8  # 192 rows
    assert attn.q_a_proj.runs_fp8 and attn.q_b_proj.runs_fp8 and attn.kv_b_proj.runs_fp8 and attn.out_proj.runs_fp8


def _layer_worker(rank, world, recipe_name, sp):
    tp = TensorParallel(dist.group.WORLD, world, rank, sp)
    recipe = PrecisionRecipe.from_name(recipe_name)
    rope = RotaryEmbedding(64, 16, 10000.0)
    ref, par = MultiHeadLatentAttention(MLA, recipe, TensorParallel.single()), MultiHeadLatentAttention(MLA, recipe, tp)
    init_weights(ref, MLA, seed=1)
    init_weights(par, MLA, seed=1, tp=tp)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3 * 16, 256, generator=g).to(recipe.param_dtype)
    dy = torch.randn(3 * 16, 256, generator=g).to(recipe.param_dtype)
    mine = (lambda t: t.chunk(world)[rank]) if sp else (lambda t: t)
    x_ref, x_par = x.clone().requires_grad_(True), mine(x).clone().requires_grad_(True)
    y_ref = ref(x_ref, rope, 3, 16)
    y_ref.backward(dy)
    y = par(x_par, rope, 3, 16)
    y.backward(mine(dy))
    frac = 1e-5 if recipe_name == "fp32" else 2**-6
    assert_close(y, mine(y_ref), "output", frac)
    assert_close(x_par.grad, mine(x_ref.grad), "input gradient", frac)
    # Under SP replicated weights saw this rank's tokens only.
    for name, grad, expected in grad_pairs(par, ref, tp, tokens_split_over=dist.group.WORLD if sp else None):
        if recipe.fp8 is not None and name.startswith("q_a_proj"):
            # q_a's output gradient is q_b's input gradient, summed over TP in BF16 (TP=1: one FP32 GEMM), and q_a
            # quantizes it to FP8 for its wgrad, where one flipped rounding moves a value by 6%: compare as a whole.
            # Under SP each rank's wgrad also tiles only its own tokens (1x128 along tokens), unlike TP=1.
            bound = 2**-4 if sp else 2**-6
            err = (grad.float() - expected.float()).norm() / expected.float().norm()
            assert err <= bound, f"{name}: relative error {err:.3g} > {bound:.3g}"
        else:
            assert_close(grad, expected, name, frac)


@pytest.mark.parametrize("recipe", ["fp32", "fp8"])
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_tp2_matches_tp1(recipe, sp):
    spawn(2, _layer_worker, recipe, sp)


def test_tiny_mla_moe_mtp_model_trains(tiny_overrides):
    """configs/tiny_mla_moe_mtp_fp8.yaml (made smaller): MLA + MoE + one MTP depth, FP8 (reference backend); the
    (LM + weighted MTP + balance) loss falls."""
    gqa_free = [o for o in tiny_overrides if not o.startswith("model.attention.")]  # the tiny model's kv heads
    cfg = load_config("tiny_mla_moe_mtp_fp8", gqa_free + ["training.steps=12", "training.eval_interval=0",
                                                           "optimizer.warmup_steps=2"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    assert len(trainer.model.mtp) == 1 and len(trainer.expert_balance.routers) == 2  # the MTP block is an MoE block too
    losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 1.0, losses


def test_the_validation_loss_with_mtp_is_the_language_modelling_loss_alone(tiny_overrides):
    """`val_loss` was the training loss, LM + mtp_loss_weight x the MTP cross-entropy (here ~30% above the LM loss
    of the same weights): not comparable with a run without MTP, and its `val_ppl` no perplexity. It is the main
    head's cross-entropy alone, as the model's logits give it, on the same held-out micro-batches."""
    cfg = load_config("tiny_dense", tiny_overrides + ["model.mtp_depth=1", "precision.recipe=fp32", "training.steps=2",
                                                      "training.eval_interval=2", "optimizer.warmup_steps=1"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    record = [r for r in trainer.fit() if r["kind"] == "eval"][-1]
    model, lm, training_loss = trainer.model.eval(), [], []
    with torch.no_grad():
        for tokens, targets in validation_batches(trainer.valid_set, 2, cfg.training.eval_iters, 0, 1):
            lm.append(F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).item())
            training_loss.append(model(tokens, targets).item())
    lm_loss = sum(lm) / len(lm)
    assert sum(training_loss) / len(training_loss) > 1.1 * lm_loss  # the MTP term shows
    assert record["val_loss"] == pytest.approx(lm_loss, rel=1e-5)
    assert record["val_ppl"] == pytest.approx(math.exp(lm_loss), rel=1e-5)


def test_mtp_inputs_and_targets_look_further_ahead():
    from megafp8.model.mtp import shifted_inputs
    from megafp8.parallel import IGNORE_INDEX

    stream = torch.arange(10)
    targets = stream[1:7].view(1, 6)  # the sample's tokens are t_0..t_5
    inputs, ahead = shifted_inputs(targets, 2)
    assert inputs.tolist() == [[2, 3, 4, 5, 6, 6]]  # t_{i+2}; the last position has none in the sample: filler
    assert ahead.tolist() == [[3, 4, 5, 6, IGNORE_INDEX, IGNORE_INDEX]]  # t_{i+3}; beyond the sample: ignored


def test_tp_layout_checks_use_the_mla_widths():
    with pytest.raises(ConfigError, match=r"MLA output features\) = 128 splits into 64 per rank"):
        validate_for_world(load_config("tiny_dense", MLA_OVERRIDES + ["model.num_heads=2", "parallel.tp=2"]), 2)
    with pytest.raises(ConfigError, match=r"FP8 tile, but model.attention.kv_lora_rank = 192: change "
                                          r"model.attention.kv_lora_rank \(e.g. to make it 256\)"):
        load_config("tiny_dense_fp8", MLA_OVERRIDES + ["model.attention.kv_lora_rank=192"])
