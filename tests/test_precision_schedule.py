"""FP16 loss scaling (agreed skips across ranks, backoff, hysteresis, growth), `auto` recipe selection,
and the BF16-to-FP8 schedule."""
from __future__ import annotations

import math

import pytest
import torch

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.precision import DynamicLossScaler, choose_recipe
from megafp8.train import Trainer
from tests.distributed import spawn


def scaler(**overrides):
    args = dict(initial_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2,
                min_scale=256.0)
    args.update(overrides)
    return DynamicLossScaler(**args)


def test_scaler_hysteresis_backoff_min_and_growth():
    s = scaler()
    s.update(True)
    assert s.scale == 1024.0  # first overflow tolerated by hysteresis=2 (the step is still skipped)
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0  # hysteresis stays spent until the next growth
    s.update(True)
    assert s.scale == 256.0  # floor
    for _ in range(3):
        s.update(False)
    assert s.scale == 512.0  # grew after growth_interval good steps, hysteresis refilled
    s.update(True)
    assert s.scale == 512.0
    state = s.state_dict()
    t = scaler()
    t.load_state_dict(state)
    assert t.state_dict() == state


def test_scaler_growth_counter_resets_on_overflow():
    s = scaler(hysteresis=1)
    s.update(False)
    s.update(False)
    s.update(True)
    assert s.scale == 512.0
    s.update(False)
    s.update(False)
    assert s.scale == 512.0  # only two good steps since the overflow
    s.update(False)
    assert s.scale == 1024.0


@pytest.mark.parametrize("capability, expected", [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"),
                                                  ((8, 9), "bf16"), ((9, 0), "fp8"), ((10, 0), "fp8"),
                                                  (None, "fp32")])
def test_auto_recipe_follows_the_hardware(capability, expected):
    recipe, reason = choose_recipe(capability, cpu_recipe="fp32")
    assert recipe == expected and reason


def test_auto_on_cpu_uses_the_configured_recipe_and_logs_it(tiny_overrides, caplog):
    cfg = load_config("tiny_dense", tiny_overrides + ["precision.recipe=auto", "precision.auto_cpu_recipe=fp8"])
    with caplog.at_level("INFO", logger="megafp8"):
        trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    assert trainer.recipe.name == "fp8" and trainer.cfg.precision.recipe == "fp8"
    assert "precision: fp8 (no GPU: precision.auto_cpu_recipe=fp8)" in caplog.text



@pytest.mark.parametrize("cpu_recipe, given, inert", [
    ("bf16", "precision.fp8_layers=[layers.*.mlp.*]",
     'precision.fp8_layers=["layers.*.mlp.*"] has no effect with precision.recipe=bf16 (only fp8 reads it)'),
    ("fp8", "precision.loss_scale_min=2",
     "precision.loss_scale_min=2.0 has no effect with precision.recipe=fp8 (only fp16 reads it)"),
    ("fp8", "precision.fp8_layers=[layers.*.mlp.*]", None),
])
def test_settings_the_recipe_auto_chose_does_not_read_are_warned_of_at_start_up(tiny_overrides, caplog, cpu_recipe,
                                                                                given, inert):
    """`auto` is not judged at load time (it may resolve to any recipe); once resolved, a setting its recipe does not
    read is warned of, as under a configured recipe (before, `precision.fp8_layers` on a GPU where `auto` chose BF16
    was dropped without a word)."""
    cfg = load_config("tiny_dense", tiny_overrides + ["precision.recipe=auto",
                                                      f"precision.auto_cpu_recipe={cpu_recipe}", given])
    with caplog.at_level("WARNING", logger="megafp8"):
        Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    warned = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert warned == ([] if inert is None else [f"{inert}, which precision.recipe=auto chose here"])

def _inject_inf_worker(rank, world, overrides):
    cfg = load_config("tiny_dense", overrides + ["precision.recipe=fp16", "precision.loss_scale_hysteresis=1",
                                                 "precision.loss_scale_initial=1024", "training.eval_interval=0"])
    trainer = Trainer(cfg, ParallelDims.build(), torch.device("cpu"))
    assert all(p.dtype == torch.float16 for p in trainer.model.parameters())
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    steps_before = trainer.optimizer.step_count
    exp_avg_before = [s.exp_avg.clone() for s in trainer.optimizer.shards]
    # A norm's weight: its gradient comes back through autograd (linears add theirs into main_grad in backward)
    weight = trainer.model.layers[0].mlp_norm.weight
    if rank == 1:  # only rank 1 sees an inf gradient
        handle = weight.register_hook(lambda g: g * float("inf"))
    loss, grad_norm = trainer.train_step()
    if rank == 1:
        handle.remove()
    assert math.isnan(grad_norm.item())
    assert trainer.optimizer.step_count == steps_before  # skipped on every rank, so the LR schedule did not move
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))
    assert all(torch.equal(s.exp_avg, e) for s, e in zip(trainer.optimizer.shards, exp_avg_before))
    assert trainer.loss_scaler.scale == 512.0
    loss, grad_norm = trainer.train_step()  # training continues
    assert math.isfinite(loss.item()) and math.isfinite(grad_norm.item())
    assert trainer.optimizer.step_count == steps_before + 1
    assert not all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))


def test_fp16_inf_on_one_rank_skips_the_step_everywhere(tiny_overrides):
    spawn(2, _inject_inf_worker, tiny_overrides)


def test_bf16_to_fp8_schedule_switches_at_the_configured_step(tiny_overrides):
    cfg = load_config("tiny_dense", tiny_overrides + ["precision.recipe=fp8", "precision.fp8_start_step=3",
                                                      "training.steps=8", "training.eval_interval=0"])
    scheduled = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    bf16 = Trainer(load_config("tiny_dense", tiny_overrides + ["training.steps=8", "training.eval_interval=0",
                                                               "run_name=bf16"]),
                   ParallelDims.single(), torch.device("cpu"))
    layer = scheduled.model.layers[1].attn.qkv_proj
    losses, reference = [], []
    for step in range(8):  # step s (0-based) is optimizer step s + 1
        losses.append(scheduled.train_step()[0].item())
        reference.append(bf16.train_step()[0].item())
        assert layer.runs_fp8 == (step >= 3), step
    assert losses[:3] == reference[:3]  # steps 0-2 ran BF16, bit for bit the BF16 run
    assert losses[3] != reference[3]  # step 3 is the first FP8 one
    assert losses[-1] < losses[0] - 1.0
    assert max(abs(a - b) / b for a, b in zip(losses, reference)) < 0.02


def _overflowing_norm_worker(rank, world, overrides):
    """Step 3's reduced gradients are finite FP16-scaled values whose squares overflow FP32 (on rank 1 only when
    distributed): the scaler saw finite gradients, the norm is not finite."""
    cfg = load_config("tiny_dense", overrides + [
        "precision.recipe=fp16", "precision.loss_scale_initial=1024", "precision.loss_scale_hysteresis=1",
        "precision.loss_scale_growth_interval=3", "precision.loss_scale_min=1", "training.max_consecutive_skips=1",
        "training.eval_interval=0", "optimizer.overlap_grad_reduce=false"])  # the poison is reduced with the rest
    trainer = Trainer(cfg, ParallelDims.build() if world > 1 else ParallelDims.single(), torch.device("cpu"))
    grad = trainer.model.layers[0].mlp.down_proj.weight.main_grad
    finish = trainer.grad_buckets.finish

    def huge_finish():
        if trainer.step + 1 == 3 and rank == world - 1:
            grad.view(-1)[7] = 1e30 * trainer.loss_scaler.scale  # 1e30 unscaled: its square is inf in FP32
        finish()
    trainer.grad_buckets.finish = huge_finish
    for _ in range(2):
        trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    loss, grad_norm = trainer.train_step()  # step 3: its good-step count would have grown the scale to 2048
    assert not math.isfinite(grad_norm.item())
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))  # skipped
    assert trainer.loss_scaler.scale == 512.0  # an overflow for the scaler: backed off, growth count reset
    assert trainer.loss_scaler.state_dict()["good_steps"] == 0
    trainer.guard.check(trainer.step)  # the scale could still back off: not a skip toward the stop (limit 1)
    trainer.train_step()
    assert trainer.loss_scaler.scale == 512.0 and trainer.optimizer.step_count == 3


@pytest.mark.parametrize("world", [1, 2])
def test_fp16_a_gradient_norm_overflowing_fp32_backs_the_scale_off_and_is_not_a_stop_skip(tiny_overrides, world):
    """The scaler counted such a step as good (it saw only finite gradients) and grew the scale, while the
    non-finite guard skipped it and counted it toward training.max_consecutive_skips at any scale."""
    if world == 1:
        _overflowing_norm_worker(0, 1, tiny_overrides)
    else:
        spawn(2, _overflowing_norm_worker, tiny_overrides)


def _fp16_trainer(overrides, extra, inf_steps=(), dims=None) -> Trainer:
    """An FP16 run whose forward pass overflows (an inf loss) at the optimizer steps `inf_steps`."""
    cfg = load_config("tiny_dense", overrides + [
        "precision.recipe=fp16", "precision.loss_scale_initial=1024", "precision.loss_scale_growth_interval=2",
        "precision.loss_scale_hysteresis=2", "training.eval_interval=0", "checkpoint.interval=100"] + extra)
    trainer = Trainer(cfg, dims or ParallelDims.single(), torch.device("cpu"))
    loss_terms = trainer.model.loss_terms

    def overflowing_loss_terms(tokens, targets):
        terms = loss_terms(tokens, targets)
        return terms._replace(total=terms.total * math.inf) if trainer.step + 1 in inf_steps else terms
    trainer.model.loss_terms = overflowing_loss_terms
    return trainer


def _fp16_steps(trainer: Trainer, n: int) -> list[tuple[float, dict, list[torch.Tensor]]]:
    """Each step's loss, the scaler's state after it, and the FP16 weights after it."""
    out = []
    for _ in range(n):
        loss = trainer.train_step()[0].item()
        out.append((loss, trainer.loss_scaler.state_dict(), [p.detach().clone() for p in trainer.model.parameters()]))
    return out


def _assert_same_steps(a, b):
    for (loss_a, scaler_a, weights_a), (loss_b, scaler_b, weights_b) in zip(a, b, strict=True):
        assert (loss_a, scaler_a) == (loss_b, scaler_b) or (math.isnan(loss_a) and math.isnan(loss_b)
                                                            and scaler_a == scaler_b)
        assert all(torch.equal(x, y) for x, y in zip(weights_a, weights_b, strict=True))


def test_fp16_resume_is_bit_identical_through_overflows_backoff_and_growth(tiny_overrides, tmp_path):
    """Coverage of the FP16 state a resume must carry: the scale, the good steps towards growth and the hysteresis
    left (overflows at steps 2-3 spend it and back off, steps 4-5 grow it); the FP16 weights after a skipped step
    and after the resume are the masters' cast, so every later loss and weight is the straight run's, bit for bit."""
    inf = (2, 3)
    straight = _fp16_steps(_fp16_trainer(tiny_overrides, ["checkpoint.resume=none", "run_name=a",
                                                          f"checkpoint.dir={tmp_path / 'a'}"], inf), 6)
    ckpt = ["run_name=b", f"checkpoint.dir={tmp_path / 'b'}"]
    first = _fp16_trainer(tiny_overrides, ckpt + ["checkpoint.resume=none"], inf)
    resumed_steps = _fp16_steps(first, 3)
    first.save()
    resumed = _fp16_trainer(tiny_overrides, ckpt, inf)
    assert resumed.step == 3 and resumed.loss_scaler.state_dict() == straight[2][1]
    masters = torch.cat([s.master for s in resumed.optimizer.shards])
    weights = torch.cat([s.bucket.params_flat[s.start:s.end] for s in resumed.optimizer.shards])
    assert torch.equal(weights.float(), masters.half().float())  # the FP16 weights are the masters' cast
    resumed_steps += _fp16_steps(resumed, 3)
    _assert_same_steps(straight, resumed_steps)
    assert [s[1]["scale"] for s in straight] == [1024.0, 1024.0, 512.0, 512.0, 1024.0, 1024.0]


@pytest.mark.parametrize("micro_batch_size", [8, 2])
def test_fp16_gradients_are_scaled_and_unscaled_once(tiny_overrides, micro_batch_size):
    """Coverage: the reported (unscaled) gradient norm does not depend on the loss scale, with one micro-batch or four
    accumulated (a scale applied per micro-batch, or a loss divided twice, would move it by the scale or by 4)."""
    def first_norm(scale: float) -> float:
        trainer = _fp16_trainer(tiny_overrides, [f"precision.loss_scale_initial={scale}", "checkpoint.resume=none",
                                                 f"training.micro_batch_size={micro_batch_size}",
                                                 f"run_name=s{scale:g}"])
        return trainer.train_step()[1].item()

    reference = _fp16_trainer(tiny_overrides, ["precision.recipe=fp32", "checkpoint.resume=none", "run_name=fp32"])
    fp32_norm = reference.train_step()[1].item()
    for scale in (1.0, 1024.0, 65536.0):
        assert first_norm(scale) == pytest.approx(fp32_norm, rel=0.02), scale
