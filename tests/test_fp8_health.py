"""FP8 health statistics on constructed tensors, and the sampled monitor in a training run."""
from __future__ import annotations

import json

import pytest
import torch

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.precision import E4M3
from megafp8.precision.health import fp8_stats
from megafp8.train import Trainer


def test_stats_of_a_constructed_tensor():
    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (2, 256), generator=g) * 2 - 1
    # |x| in [0.3, 0.45] with a 1.0 heading every tile: nothing underflows, and only that 1.0 reaches the
    # maximum (0.45 / 1.0 * 448 = 201.6 rounds far below 448).
    x = signs * (0.3 + 0.15 * torch.rand(2, 256, generator=g))
    x[:, ::128] = 1.0
    x[0, :128] = 1e-3  # tile (0, 0): a 1e6 outlier flushes its 127 neighbours (1e-3 / (1e6 / 448) < 2^-10)
    x[0, 0] = 1e6
    x[1, 128:] = 3.0  # tile (1, 1): all equal, so all 128 sit at the maximum
    stats = {k: v.item() for k, v in fp8_stats(x, E4M3).items()}
    assert stats["amax"] == 1e6
    assert stats["underflow"] == pytest.approx(127 / 512)
    # One element at the maximum in each of the three other tiles (their max-abs), 128 in the constant tile.
    assert stats["at_max"] == pytest.approx((3 + 128) / 512)
    x_clean = signs * (0.3 + 0.15 * torch.rand(2, 256, generator=g))
    clean = fp8_stats(x_clean, E4M3)
    assert clean["underflow"].item() == 0.0
    assert 28 < clean["snr_db"].item() < 40  # 3 mantissa bits: ~30 dB
    zeros = fp8_stats(torch.zeros(2, 128), E4M3)
    assert zeros["underflow"].item() == 0.0 and zeros["at_max"].item() == 0.0


def test_weight_stats_use_blocks():
    w = torch.full((128, 256), 2.0)
    w[:, 128:] = 1.0
    assert fp8_stats(w, E4M3, blocks=True)["at_max"].item() == 1.0  # every block is constant
    assert fp8_stats(w, E4M3, blocks=True)["snr_db"].item() > 100


def test_monitor_samples_every_n_steps_and_warns(tiny_overrides, caplog):
    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["training.steps=4", "training.eval_interval=0",
                                                          "logging.fp8_health_interval=2", "logging.fp8_at_max_warn=0.0"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    with caplog.at_level("WARNING", logger="megafp8"):
        trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    health = [r for r in records if r["kind"] == "fp8_health"]
    assert [r["step"] for r in health] == [1, 3]
    layers = health[0]["layers"]
    assert set(layers) == {n for n, m in trainer.model.named_modules() if getattr(m, "runs_fp8", False)}
    assert "lm_head" not in layers
    for kinds in layers.values():
        assert set(kinds) == {"input", "weight", "grad"}
        assert all(0 <= s["underflow"] <= 1 and s["snr_db"] > 20 for s in kinds.values())
    assert "fp8 health of layers.0.attn.qkv_proj input" in caplog.text
    assert not any(m._forward_hooks for m in trainer.model.modules())  # hooks removed after the sampled step
    unmonitored = Trainer(load_config("tiny_dense_fp8", tiny_overrides + [
        "training.steps=4", "training.eval_interval=0", "logging.fp8_health_interval=0", "run_name=plain"]),
        ParallelDims.single(), torch.device("cpu"))
    plain = [r["loss"] for r in unmonitored.fit() if r["kind"] == "train"]
    assert plain == [r["loss"] for r in records if r["kind"] == "train"]  # watching changes nothing


def test_monitor_covers_grouped_expert_linears(tiny_overrides):
    cfg = load_config("tiny_moe_fp8", tiny_overrides + ["training.steps=2", "training.eval_interval=0",
                                                        "logging.fp8_health_interval=1", "model.moe.ffn_hidden_size=128"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    layers = next(r for r in records if r["kind"] == "fp8_health")["layers"]
    experts = layers["layers.1.mlp.experts.gate_up_proj"]
    assert set(experts) == {"input", "weight", "grad"} and experts["weight"]["snr_db"] > 20


def test_a_sampled_step_keeps_no_more_for_backward_than_a_recomputed_one(tiny_overrides):
    """The sampled step runs compiled blocks uncompiled, where element-wise ops keep their intermediates, so it would
    set a compiled run's peak memory; they run recomputed instead, keeping for backward what `training.recompute:
    full` keeps (the blocks' inputs; the SwiGLU hooks hold the MLP inputs besides), less than an unsampled step.
    (Dynamo's eager backend stands in for Inductor: what is kept is the question, not the kernels.)"""
    from megafp8.model import Transformer, apply_compile, apply_recompute, init_weights
    from megafp8.precision import PrecisionRecipe
    from megafp8.train.fp8_health import Fp8HealthMonitor
    from tests.test_recompute import kept_for_backward

    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["model.num_layers=4", "model.vocab_size=512",
                                                          "precision.fp8_backend=reference"])
    model = Transformer(cfg.model, PrecisionRecipe.from_config(cfg.precision), 64)
    init_weights(model, cfg.model, 0)
    assert apply_compile(model, backend="eager") == 4
    tokens = torch.randint(0, 512, (4, 64))

    def saved_bytes() -> int:
        kept, loss = kept_for_backward(model, tokens)
        loss.backward()  # (the recomputation in backward keeps its tensors only while it runs)
        return kept

    plain = saved_bytes()
    monitor = Fp8HealthMonitor(model, 1, 1.0, 1.0)
    assert monitor.arm(0)
    sampled = saved_bytes()
    layers = monitor.collect(0)
    assert set(layers) == {n for n, m in model.named_modules() if getattr(m, "runs_fp8", False)}
    assert all(set(kinds) == {"input", "weight", "grad"} for kinds in layers.values())
    assert apply_recompute(model, "full") == 4
    recomputed = saved_bytes()
    assert sampled == recomputed < 0.8 * plain, (sampled, recomputed, plain)
