"""What a training record says: the loss and its parts under multi-token prediction, the busiest rank's memory."""
from __future__ import annotations

import pytest
import torch

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from megafp8.train import metrics
from tests.distributed import spawn

# Two steps of four micro-batches each (gradient accumulation), logged as one window.
SHORT = ["training.steps=2", "logging.log_interval=2", "training.eval_interval=0", "optimizer.warmup_steps=1",
         "precision.recipe=fp32"]


def _train_records(overrides: list[str]) -> list[dict]:
    torch.manual_seed(0)
    trainer = Trainer(load_config("tiny_dense", overrides), ParallelDims.single(), torch.device("cpu"))
    return [r for r in trainer.fit() if r["kind"] == "train"]


def test_with_mtp_the_record_splits_the_loss_into_its_lm_and_mtp_parts(tiny_overrides):
    """The logged `loss` of an MTP run held the weighted MTP cross-entropy, and nothing held the language-modelling
    loss alone: no training curve to set beside a run without MTP. `lm_loss` is that loss: at the first step (the
    same weights and data) it is the loss of the same run without MTP, bit for bit."""
    [with_mtp] = _train_records(tiny_overrides + SHORT + ["model.mtp_depth=1", "model.mtp_loss_weight=0.3",
                                                          "training.steps=1", "logging.log_interval=1"])
    [without] = _train_records(tiny_overrides + SHORT + ["training.steps=1", "logging.log_interval=1",
                                                         "run_name=without"])
    assert with_mtp["lm_loss"] == without["loss"] == without["lm_loss"]
    assert "mtp_loss" not in without
    assert with_mtp["loss"] == pytest.approx(with_mtp["lm_loss"] + 0.3 * with_mtp["mtp_loss"], rel=1e-6)
    assert with_mtp["mtp_loss"] > with_mtp["lm_loss"]  # a token further ahead is harder to predict


def test_the_loss_parts_are_means_over_the_window_and_its_micro_batches(tiny_overrides):
    """A window of two steps of four micro-batches: each part is averaged like the loss, so the parts still add up."""
    [record] = _train_records(tiny_overrides + SHORT + ["model.mtp_depth=2", "model.mtp_loss_weight=0.5"])
    assert record["loss"] == pytest.approx(record["lm_loss"] + 0.5 * record["mtp_loss"], rel=1e-6)
    assert record["lm_loss"] < record["loss"]


def _peak_memory_worker(rank, world, overrides):
    # This rank's allocator high-water mark, as a GPU's would be: rank 1 the busiest (a later pipeline stage, the
    # ranks holding the most-used experts). CPU tensors have no such counter.
    metrics.device_peak_bytes = lambda device: (1 + 2 * rank) * 2**29  # 0.5 GiB on rank 0, 1.5 GiB on rank 1
    cfg = load_config("tiny_dense", overrides)
    records = Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu")).fit()
    if rank == 0:
        assert [(r["peak_memory_gib"], r["peak_memory_rank"]) for r in records if r["kind"] == "train"] == [(1.5, 1)]


def test_peak_memory_is_the_busiest_rank_s_and_names_it(tiny_overrides):
    """`peak_memory_gib` was rank 0's own high-water mark: under pipeline or expert parallelism another rank's is
    usually higher, and the record hid it."""
    spawn(2, _peak_memory_worker, tiny_overrides + ["training.steps=1", "training.eval_interval=0",
                                                   "optimizer.warmup_steps=1"])
