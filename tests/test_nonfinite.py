"""Nothing silently wrong: a step with non-finite gradients is skipped on every rank in every recipe, never saved,
and a run of them stops the run with a message naming the first bad step and the layers."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megafp8.checkpoint import find_latest, load_checkpoint
from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from tests.distributed import spawn

NAN = float("nan")


def _trainer(overrides, dims=None) -> Trainer:
    cfg = load_config("tiny_dense", overrides)
    return Trainer(cfg, dims or ParallelDims.single(), torch.device("cpu"))


def _poison_from(trainer: Trainer, step: int, param_name: str, value: float = NAN,
                 steps: tuple[int, ...] = ()) -> None:
    """From optimizer step `step` on (or at the `steps` given), this rank's gradient of `param_name` gets `value`
    before the data-parallel reduction (as a bad batch or a flipped bit would give it)."""
    grad = dict(trainer.model.named_parameters())[param_name].main_grad
    finish = trainer.grad_buckets.finish

    def poisoned_finish():
        if trainer.step + 1 in steps if steps else trainer.step + 1 >= step:
            grad.view(-1)[7] = value
        finish()
    trainer.grad_buckets.finish = poisoned_finish


def _state(trainer: Trainer) -> list[torch.Tensor]:
    return ([p.detach().clone() for p in trainer.model.parameters()]
            + [getattr(s, k).clone() for s in trainer.optimizer.shards for k in ("master", "exp_avg", "exp_avg_sq")])


def _nan_on_one_rank_worker(rank, world, overrides):
    trainer = _trainer(overrides, ParallelDims.build())
    trainer.train_step()
    before = _state(trainer)
    if rank == 1:  # only rank 1 sees the NaN
        _poison_from(trainer, 2, "layers.0.mlp.down_proj.weight")
    loss, grad_norm = trainer.train_step()
    assert math.isnan(grad_norm.item())  # every rank, from the all-reduced norm
    assert all(torch.equal(a, b) for a, b in zip(_state(trainer), before))  # masters, moments, weights untouched
    trainer.save()  # step 2: the state of step 1
    assert trainer.optimizer.step_count == 1  # the LR schedule did not move either
    trainer.grad_buckets.__dict__.pop("finish", None)  # the NaN was one step's
    loss, grad_norm = trainer.train_step()  # training goes on
    assert math.isfinite(grad_norm.item()) and trainer.optimizer.step_count == 2
    if rank == 0:
        saved = load_checkpoint(find_latest(trainer.checkpoint_dir))
        masters = saved["optimizer"]["masters"]
        assert saved["step"] == 2 and saved["optimizer"]["step"] == 1
        assert all(torch.isfinite(t).all() for t in masters.values())


def test_a_nan_gradient_on_one_rank_is_skipped_on_all_ranks_and_never_saved(tiny_overrides, tmp_path):
    """0800a78 applied it (BF16 has no loss scaler), saved NaN masters and noticed only at the next logged loss."""
    spawn(2, _nan_on_one_rank_worker, tiny_overrides + [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.resume=none",
                                                        "optimizer.overlap_grad_reduce=false"])


def _nan_in_replicated_grad_worker(rank, world, overrides):
    trainer = _trainer(overrides, ParallelDims.from_config(load_config("tiny_dense", overrides).parallel))
    assert trainer.tp.size == 2 and not trainer.tp.sp  # without SP nothing sums the norm weights' grads over TP
    trainer.train_step()
    before = _state(trainer)
    if rank == 1:  # one TP rank's copy of a replicated (norm) weight's gradient, as a flipped bit would leave it
        _poison_from(trainer, 2, "layers.0.mlp_norm.weight")
    loss, grad_norm = trainer.train_step()
    assert math.isnan(grad_norm.item())  # TP rank 0's norm too: skipped on both
    assert all(torch.equal(a, b) for a, b in zip(_state(trainer), before))


def test_a_nan_in_a_tp_replicated_gradient_on_another_tp_rank_is_skipped(tiny_overrides):
    """The global norm counts a TP-replicated parameter on TP rank 0 only: a nan in TP rank 1's copy of its gradient
    left the norm finite, and rank 1 applied it (nan master and weight there, which the next forward spread)."""
    spawn(2, _nan_in_replicated_grad_worker, tiny_overrides + [
        "parallel.tp=2", "model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
        "model.vocab_size=512", "optimizer.overlap_grad_reduce=false", "training.eval_interval=0"])


def test_skips_in_a_row_stop_the_run_naming_the_first_step_and_the_layer(tiny_overrides, tmp_path):
    ckpt = tmp_path / "ck"
    trainer = _trainer(tiny_overrides + ["precision.recipe=fp8", "training.max_consecutive_skips=2",
                                         f"checkpoint.dir={ckpt}", "checkpoint.interval=1", "checkpoint.keep_last=1",
                                         "checkpoint.resume=none", "training.eval_interval=0"])
    _poison_from(trainer, 3, "layers.1.mlp.down_proj.weight")
    with pytest.raises(FloatingPointError, match=r"training stopped at step 4: 2 steps in a row from step 3 had "
                                                 r"non-finite gradients .*; at step 4 in layers.1.mlp.down_proj\. "
                                                 r"Weights, optimizer state and every checkpoint since are as before "
                                                 r"step 3"):
        trainer.fit()
    newest = load_checkpoint(find_latest(ckpt))  # step 3: saved after the first skip, with step 2's state
    assert newest["step"] == 3 and newest["optimizer"]["step"] == 2
    assert all(torch.isfinite(t).all() for t in newest["optimizer"]["masters"].values())
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "latest", "step_00000003"]


def test_fp16_overflow_skipped_by_the_scaler_does_not_end_the_run(tiny_overrides):
    """0800a78 averaged the skipped step's inf loss into the logged loss and stopped: 'training diverged'."""
    trainer = _trainer(tiny_overrides + ["precision.recipe=fp16", "logging.log_interval=3", "training.eval_interval=0",
                                         "precision.loss_scale_initial=1024", "precision.loss_scale_hysteresis=1"])
    loss_terms = trainer.model.loss_terms

    def overflowing_loss_terms(tokens, targets):
        terms = loss_terms(tokens, targets)  # step 2 overflows in its forward pass
        return terms._replace(total=terms.total * math.inf) if trainer.step == 1 else terms
    trainer.model.loss_terms = overflowing_loss_terms
    records = [r for r in trainer.fit() if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in records] == [1, 0]
    assert all(math.isfinite(r["loss"]) for r in records) and records[-1]["loss_scale"] == 512.0
    assert trainer.optimizer.step_count == 5


def test_a_checkpoint_of_non_finite_state_is_never_written(tiny_overrides, tmp_path):
    ckpt = tmp_path / "ck"
    trainer = _trainer(tiny_overrides + [f"checkpoint.dir={ckpt}", "checkpoint.resume=none"])
    trainer.train_step()
    trainer.save()
    trainer.train_step()
    trainer.optimizer.shards[0].exp_avg_sq[3] = math.inf  # a fault no gradient check can see
    with pytest.raises(FloatingPointError, match=r"step 2: optim/exp_avg_sq/\S+ holds inf or nan: not saving"):
        trainer.save()
    assert find_latest(ckpt).name == "step_00000001"
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "latest", "step_00000001"]


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_skips_in_a_row_carry_over_a_resume(tiny_overrides, tmp_path, form):
    """A run 2 skips from its stop and preempted stops where the uninterrupted one does: the count of skips in a row
    (and the step that began them) is saved with the run's state. A checkpoint without it (older) resumes at 0."""
    settings = tiny_overrides + ["training.max_consecutive_skips=3", "training.steps=8", "training.eval_interval=0",
                                 f"checkpoint.format={form}", "checkpoint.keep_last=1", "checkpoint.interval=100"]
    stop = r"training stopped at step {}: 3 steps in a row from step {} had non-finite gradients"

    def resumed_after_step_4(name: str, older: bool = False) -> Trainer:
        run = [f"checkpoint.dir={tmp_path / name}", f"run_name={name}"]
        first = _trainer(settings + run + ["checkpoint.resume=none"])
        _poison_from(first, 3, "layers.1.mlp.down_proj.weight")
        for _ in range(4):  # steps 3 and 4 skipped, then preempted after step 4's checkpoint
            first.train_step()
        if older:  # as a checkpoint written before the count was saved
            first.checkpointer.parts.pop("nonfinite")
        first.save()
        resumed = _trainer(settings + run)
        assert resumed.step == 4
        _poison_from(resumed, 3, "layers.1.mlp.down_proj.weight")  # the same bad data from step 3 on
        return resumed

    straight = _trainer(settings + [f"checkpoint.dir={tmp_path / 'straight'}", "checkpoint.resume=none"])
    _poison_from(straight, 3, "layers.1.mlp.down_proj.weight")
    with pytest.raises(FloatingPointError, match=stop.format(5, 3)):
        straight.fit()
    with pytest.raises(FloatingPointError, match=stop.format(5, 3)):
        resumed_after_step_4("resumed").fit()
    with pytest.raises(FloatingPointError, match=stop.format(7, 5)):
        resumed_after_step_4("older", older=True).fit()


class _OverflowedOptimizer:
    """What unscale_or_skip asks of the optimizer, for a step whose gradients overflowed."""
    def scale_grads(self, factor: float) -> None:
        pass

    def clip_grad_norm(self) -> torch.Tensor:
        return torch.tensor(math.inf)

    def found_nonfinite(self) -> torch.Tensor:
        return torch.tensor(1.0)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_fp16_skip_is_logged_by_rank_0_alone_and_skipped_on_every_rank(rank, caplog):
    """Ranks other than 0 log warnings too (runtime.setup_logging), so the skip's warning came once a rank: 1,024
    lines for one skip on 1,024 GPUs. Every rank still skips and moves its loss scale."""
    from types import SimpleNamespace

    from megafp8.precision.loss_scale import DynamicLossScaler
    from megafp8.train.nonfinite import unscale_or_skip

    scaler = DynamicLossScaler(initial_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000,
                               hysteresis=1, min_scale=1.0)
    dims = SimpleNamespace(rank=rank, is_distributed=False)
    with caplog.at_level("WARNING"):
        assert unscale_or_skip(_OverflowedOptimizer(), scaler, 1024.0, 7, dims) is None
    assert scaler.scale < 1024.0
    warned = [r.getMessage() for r in caplog.records if "step skipped" in r.getMessage()]
    assert warned == (["step 7: inf/nan gradients on some rank; step skipped (weights, optimizer and LR schedule "
                       f"unchanged), loss scale 1024 -> {scaler.scale:g}"] if rank == 0 else [])



def test_the_window_of_the_skips_that_stop_the_run_is_recorded(tiny_overrides):
    """The stop is raised at a logging step; the record of that window (its skipped steps, the loss of the others) is
    written first. It was not: the metrics ended at the window before, with no sign of the skips."""
    trainer = _trainer(tiny_overrides + ["training.max_consecutive_skips=2", "logging.log_interval=4",
                                         "training.eval_interval=0"])
    _poison_from(trainer, 3, "layers.1.mlp.down_proj.weight")
    with pytest.raises(FloatingPointError, match="training stopped at step 4"):
        trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    [record] = [r for r in records if r["kind"] == "train"]
    assert record["step"] == 4 and record["skipped_steps"] == 2 and math.isfinite(record["loss"])
    assert record["grad_norm"] is None  # the last step's, not finite


def test_the_logged_lr_is_the_one_the_last_applied_update_ran_at(tiny_overrides):
    """Until the host learns of a skip (at the window's logging step), the schedule runs one step ahead per skipped
    step; the record then took the lr from the settled step count, one schedule step behind the one the window's
    last update ran at wherever a step before it was skipped (step 2 here). A skip at the window's end (step 6) left
    it right, and still does: a skipped step ran no update."""
    trainer = _trainer(tiny_overrides + ["training.steps=6", "logging.log_interval=3", "optimizer.warmup_steps=6",
                                         "training.eval_interval=0", "training.max_consecutive_skips=2"])
    _poison_from(trainer, 0, "layers.1.mlp.down_proj.weight", steps=(2, 6))
    used, step = [], trainer.optimizer.step

    def recording_step(lr, apply=None):
        used.append(lr)
        step(lr, apply)
    trainer.optimizer.step = recording_step
    records = [r for r in trainer.fit() if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in records] == [1, 1]
    assert [r["lr"] for r in records] == [used[2], used[4]]  # steps 3 and 5: the windows' last applied updates
    assert used[2] != used[1]  # (the warmup's lr grows every step: a step behind is another lr)
