"""Pipeline parallelism on gloo ranks: every schedule against PP=1, composed with TP, EP and FP8.

Tolerances. In FP32 a pipeline runs the same operations on the same micro-batches as PP=1; only the
order in which micro-batch gradients are added can differ (zero-bubble schedules defer weight
gradients). Losses must agree to 1e-5 relative and every parameter's reduced gradient to 1e-5 of its
largest element (we see about 1e-7). BF16/FP8 runs: 5e-3 on the loss and 3e-2 on the gradient norm, as
for tensor parallelism.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megafp8.checkpoint import find_latest, load_checkpoint
from megafp8.config import ConfigError, load_config, validate_for_world
from megafp8.config.layout import layer_counts, parse_layout
from megafp8.parallel import ParallelDims
from megafp8.parallel.pipeline import build_layout, simulated_bubble
from megafp8.train.main import main
from megafp8.train.trainer import Trainer
from tests.conftest import one_per_key
from tests.distributed import spawn
from tests.parity import FP32_TOL, LOW_PRECISION_TOL

# 3 steps: the first step's gradients are compared, and every step's loss; precision.fp8_start_step=2 still runs
# one FP8 step after the switch.
MODEL = ["model.num_layers=4", "model.vocab_size=512", "training.steps=3", "training.eval_interval=3",
         "optimizer.grad_clip=1.0"]
FP32 = ["precision.recipe=fp32"]
MOE_FP32 = dataclasses.replace(FP32_TOL, grad_norm=1e-4, grads=1e-4)
FP8 = dataclasses.replace(LOW_PRECISION_TOL, grads=2**-6)
SCHEDULES = ["1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]


def _check(parity, extra, layout, world, tol=FP32_TOL, config="tiny_dense"):
    """This module's model with `extra` at a pipeline `layout` against PP=1 (one evaluation, at the end)."""
    return parity.check(MODEL + extra, layout, world, tol, config, evals=1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_matches_pp1(parity, schedule):
    """FP32: 4 micro-batches; interleaved schedules hold 2 stages of one layer each per rank."""
    _check(parity, FP32, ["parallel.pp=2", f"parallel.pp_schedule={schedule}"], 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp4_matches_pp1(parity, schedule):
    """FP32, 8 layers over 4 ranks (8 stages for the interleaved and V schedules), 8 micro-batches."""
    extra = FP32 + ["model.num_layers=8", "training.micro_batch_size=1"]
    _, got = _check(parity, extra, ["parallel.pp=4", f"parallel.pp_schedule={schedule}"], 4)
    if schedule == "1f1b":
        assert got.bubble == pytest.approx(3 / (8 + 3))  # (pp - 1) / (m + pp - 1)


def test_uneven_layout_matches_pp1(parity):
    _check(parity, FP32, ["parallel.pp=2", "parallel.pp_layout=E,t|t*3,L"], 2)


def test_pp2_x_tp2_with_sequence_parallel_matches_one_rank(parity):
    tp_model = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128"]
    _check(parity, FP32 + tp_model, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                     "parallel.pp_schedule=interleaved_1f1b"], 4)


MOE = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
       "model.moe.ffn_hidden_size=128", "model.moe.aux_loss_coeff=0.01"]


def test_pp2_with_moe_and_ep2_matches_one_rank(parity):
    """PP=2 x DP=2 with the experts split over EP=2, sharded optimizer; the sequence balance loss reaches backward
    from both stages and the load statistics cover every MoE layer."""
    ref, got = _check(parity, FP32 + MOE, ["parallel.pp=2", "parallel.ep=2"], 4, MOE_FP32, "tiny_moe_fp8")
    for a, b in zip(ref.train, got.train):
        assert math.isclose(a["moe_load_cv"], b["moe_load_cv"], rel_tol=1e-6)
        assert math.isclose(a["moe_bias_abs_max"], b["moe_bias_abs_max"], rel_tol=1e-6)
        assert b["moe_dropped_tokens"] == 0


def test_balance_loss_gradient_is_not_lost_through_stages(parity):
    """The router weights' gradients come only from the balance loss and the gate; a lost balance gradient on
    either stage moves them far beyond tolerance (checked by switching the loss off)."""
    ref_with = parity.reference(MODEL + FP32 + MOE, "tiny_moe_fp8")
    ref_without = parity.reference(MODEL + FP32 + MOE[:-1] + ["model.moe.aux_loss_coeff=0"], "tiny_moe_fp8")
    router = [n for n in ref_with.grads if n.endswith("router.weight")]
    assert len(router) >= 2
    moved = max((ref_with.grads[n] - ref_without.grads[n]).abs().max().item() for n in router)
    assert moved > 1e-3 * max(ref_with.grads[n].abs().max().item() for n in router)
    _check(parity, FP32 + MOE, ["parallel.pp=2", "parallel.pp_schedule=zbv"], 2, MOE_FP32, "tiny_moe_fp8")


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_fp8_pipeline_matches_pp1(parity, schedule):
    """FP8 (reference backend): zero-bubble schedules defer the FP8 weight-gradient GEMMs to the W pass. Under
    `zbv` the heads are such that the QKV projection takes RoPE's backward quantizer (`megafp8.precision.fp8_qkv`),
    whose weight gradient is deferred too; under `1f1b` it runs unfused."""
    heads = ["model.num_heads=2", "model.attention.num_kv_heads=2"] if schedule == "zbv" else []
    _check(parity, ["precision.recipe=fp8", *heads], ["parallel.pp=2", f"parallel.pp_schedule={schedule}"], 2, FP8)


@pytest.mark.parametrize("extra", [
    ["precision.recipe=fp8", "precision.fp8_layers=[layers.0.*, layers.3.mlp.*]", "precision.fp8_start_step=2"],
    ["precision.recipe=fp16", "precision.loss_scale_initial=1024"],
], ids=["fp8_globs_and_switch", "fp16_loss_scaling"])
def test_precision_schedules_work_per_stage(parity, extra):
    """FP8 layer globs naming layers of one stage only, a BF16-to-FP8 switch at step 2, and FP16 with dynamic loss
    scaling (the scaled loss back-propagates from the last stage) give PP=1's run."""
    _check(parity, extra, ["parallel.pp=2", "parallel.pp_schedule=zbv"], 2, FP8)


def test_recomputation_inside_pipeline_stages_matches_pp1(parity):
    """Recomputed blocks in a zero-bubble schedule (recompute during I, deferred weight GEMMs at W), MoE with EP=2."""
    _check(parity, FP32 + MOE, ["parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=zbv",
                                "training.recompute=full"], 4, MOE_FP32, "tiny_moe_fp8")


@pytest.mark.parametrize("recompute", [[], ["training.recompute=full", "training.recompute_layers=2"]],
                         ids=["plain", "first_two_blocks_recomputed"])
def test_mtp_on_the_last_stage_of_a_v_schedule_matches_pp1(parity, recompute):
    """V schedules put the first and last stage on rank 0, so the MTP module shares the embedding there. With
    `recompute_layers=2` rank 0 recomputes its two layers (stages 0 and 3) and not its MTP block, rank 1 both of its
    layers. The loss's LM and MTP parts, which only the last stage sees, are logged as at PP=1."""
    _, got = _check(parity, FP32 + ["model.mtp_depth=1"], ["parallel.pp=2", "parallel.pp_schedule=zbv", *recompute],
                    2)
    assert all(r["lm_loss"] < r["loss"] < r["lm_loss"] + r["mtp_loss"] for r in got.train)


def _save_worker(rank, world, overrides):
    cfg = load_config("tiny_dense", overrides)
    Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu")).fit()


def test_pp2_checkpoint_holds_every_stage_and_resumes_at_pp1_and_pp2(tiny_overrides, tmp_path):
    base = tiny_overrides + MODEL + ["training.steps=3", "checkpoint.interval=3", f"checkpoint.dir={tmp_path}/ck",
                                     "training.eval_interval=0"]
    spawn(2, _save_worker, base + ["parallel.pp=2"])
    saved = load_checkpoint(find_latest(tmp_path / "ck"))
    # a fresh one-rank model for its names, in a run directory of its own (one directory holds one run)
    one = Trainer(load_config("tiny_dense", base + ["checkpoint.resume=none", f"checkpoint.dir={tmp_path}/fresh",
                                                    "run_name=fresh"]), ParallelDims.single(), torch.device("cpu"))
    assert saved["model"].keys() == one.model.state_dict().keys()
    assert saved["optimizer"]["masters"].keys() == {n for n, _ in one.model.named_parameters()}
    resumed = Trainer(load_config("tiny_dense", base + ["training.steps=4"]), ParallelDims.single(),
                      torch.device("cpu"))
    assert resumed.step == 3
    state = resumed.model.state_dict()
    assert all(torch.equal(state[k], saved["model"][k]) for k in saved["model"])
    for trainer in (one, resumed):  # this process is done with the run directory: another run may take it
        trainer.run_lock.release()
    spawn(2, _save_worker, base + ["parallel.pp=2", "parallel.pp_schedule=zbv", "training.steps=4"])
    assert load_checkpoint(find_latest(tmp_path / "ck"))["step"] == 4


# ------------------------------------------------------------------------------------ layouts

def test_layout_strings_and_even_splits():
    assert parse_layout("E,t*3|t*5|t*5|t*3,L", 16, 4) == [3, 5, 5, 3]
    assert parse_layout("E|t,t|t*2,L", 4, 3) == [0, 2, 2]
    assert parse_layout("E,t|t|L", 2, 3) == [1, 1, 0]
    assert layer_counts(10, 4, "1f1b", 2, None) == [3, 3, 2, 2]
    assert layer_counts(8, 2, "zbv", 3, None) == [2, 2, 2, 2]  # V schedules: two stages per rank
    assert layer_counts(12, 2, "interleaved_1f1b", 3, None) == [2] * 6


def test_stage_placement_looped_and_v():
    looped = build_layout(8, 2, "interleaved_1f1b", 2)
    assert [s.index for s in looped.local_stages(0)] == [0, 2] and [s.index for s in looped.local_stages(1)] == [1, 3]
    v = build_layout(8, 2, "zbv", 2)
    assert [s.index for s in v.local_stages(0)] == [0, 3] and [s.index for s in v.local_stages(1)] == [1, 2]
    first, last = v.local_stages(0)
    assert first.first and last.last and first.layers == (0, 1) and last.layers == (6, 7)


@pytest.mark.parametrize("layout, message", [
    ("E,t*2|t*3,L", "places 5 transformer layer"),
    ("E,t|t*2,L", "places 3 transformer layer"),
    ("E,t*2|t*2|L", "has 3 stage"),
    ("t,E,t|t*2,L", "'E' must be the first item of the first stage"),
    ("E,t*2,L|t*2", "'L' must be the last item of the last stage"),
    ("E,t*2|x*2,L", "unknown item 'x\\*2'"),
])
def test_bad_layouts_are_rejected_with_the_fix(tiny_overrides, layout, message):
    cfg = load_config("tiny_dense", tiny_overrides + MODEL + ["parallel.pp=2", f"parallel.pp_layout={layout}"])
    with pytest.raises(ConfigError, match=message):
        validate_for_world(cfg, 2)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.pp=2", "model.mtp_depth=1"], 2, "set parallel.pp_schedule to zbv or dualpipev"),
    (["parallel.pp=2", "parallel.pp_schedule=dualpipev", "training.micro_batch_size=4"], 2,
     "dualpipev needs at least 2 x parallel.pp = 4"),
    (["parallel.pp=4", "model.num_layers=4", "training.micro_batch_size=4"], 4, "needs at least parallel.pp = 4"),
    (["parallel.pp=3"], 4, "cannot be split into tp=1 x pp=3"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "model.num_layers=3"], 2,
     "model.num_layers=3 cannot fill 4 pipeline stages"),
])
def test_bad_pipeline_configs_give_one_clear_error(tiny_overrides, overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_for_world(load_config("tiny_dense", tiny_overrides + MODEL + overrides), world)


def test_launch_with_a_bad_layout_fails_with_one_clear_error(tiny_overrides, capsys):
    assert main(["--config", "tiny_dense", *one_per_key(tiny_overrides, MODEL), "parallel.pp_layout=E,t*4,L"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.pp_layout is set but parallel.pp=1" in err[0], err


class _Act:
    """A stand-in for torch's schedule action (stage, type, micro-batch)."""

    def __init__(self, text):
        self.stage_index, kind, mb = int(text[0]), text[1], int(text[2:])
        self.computation_type = type("T", (), {"value": kind})()
        self.microbatch_index, self.sub_actions = mb, None


def test_simulated_bubble_of_hand_written_schedules():
    # 2 stages, 2 micro-batches, GPipe-like order: rank 0 F0 F1 . . B0 B1 waits on rank 1's backward.
    order = {0: [_Act(a) for a in ("0F0", "0F1", "0B0", "0B1")], 1: [_Act(a) for a in ("1F0", "1B0", "1F1", "1B1")]}
    # rank 1: F0 at 1-2, B0 2-4, F1 4-5, B1 5-7; rank 0: F0 0-1, F1 1-2, B0 4-6, B1 7-9. Busy 6 + 6 of 2 x 9.
    assert simulated_bubble(order, 2) == pytest.approx(1 - 12 / 18)
    deadlock = {0: [_Act("0B0")], 1: [_Act("1F0")]}
    assert simulated_bubble(deadlock, 2) is None


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_weight_gradients_wait_in_the_queue_until_the_w_pass(recipe):
    """A layer with a WeightGradQueue gives the input gradient at once and its FP32 weight gradient only when the
    queue runs (the zero-bubble W action), equal to the immediate one."""
    from megafp8.parallel import ColumnParallelLinear, ExpertLinear, ExpertParallel
    from megafp8.precision import PrecisionRecipe, WeightGradQueue

    rec = PrecisionRecipe.from_name(recipe)
    x = torch.randn(96, 128, generator=torch.Generator().manual_seed(0)).to(rec.param_dtype)
    dense = ColumnParallelLinear(128, 256, rec)
    experts = ExpertLinear(2, 128, 128, rec, ExpertParallel.single())
    for layer in (dense, experts):
        torch.nn.init.normal_(layer.weight, std=0.05)
        grads = []
        for queue in (None, WeightGradQueue()):
            layer.weight.main_grad, layer.weight.grad = torch.zeros(layer.weight.shape), None
            layer.wgrad_queue = queue
            inp = x.clone().requires_grad_()
            y = layer(inp) if layer is dense else layer(inp, [40, 56])
            y.float().square().sum().backward()
            assert inp.grad is not None
            if queue is not None:
                assert len(queue) == 1 and layer.weight.main_grad.abs().max() == 0 and layer.weight.grad is None
                queue.take()()
                assert len(queue) == 0
            # Without a queue, a BF16 F.linear leaves its gradient in .grad (the bucket hook moves it in training).
            immediate = layer.weight.grad.float() if layer.weight.grad is not None else 0.0
            grads.append(layer.weight.main_grad + immediate)
        assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1]), type(layer).__name__


def _bytes_per_param_worker(rank, world, overrides):
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("megafp8")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    cfg = load_config("tiny_dense", overrides)
    Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu")).fit()
    if rank == 0:
        line = next(line for line in lines if line.startswith("memory per rank: "))
        assert "(bytes/param: 2.00 + 4.00 + 4.00 + 8.00)" in line, line


def test_the_bytes_a_parameter_logged_at_start_up_are_the_rank_s_own_under_pipelining(tiny_overrides):
    """The start-up line divided this rank's bytes by the whole model's parameters: under PP=2 (or TP, EP) a BF16
    weight read as ~1 byte a parameter. It is the rank's bytes over the parameters it holds (replicated optimizer:
    2 + 4 + 4 + 8)."""
    spawn(2, _bytes_per_param_worker, tiny_overrides + MODEL + ["parallel.pp=2", "optimizer.sharded=false",
                                                                "training.steps=1", "optimizer.warmup_steps=0",
                                                                "training.eval_interval=0"])
