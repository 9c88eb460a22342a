"""Losses over every rank: the held-out loss of an evaluation, and the training loss of a logging window.

Only the rank holding the last pipeline stage computes a loss (the others hold 0), tensor-parallel ranks hold
the same loss, and data-parallel replicas hold the losses of different batches: both functions sum over the
pipeline group and average over the data-parallel replicas (collective).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megafp8.config import TrainingConfig
from megafp8.data import PackedDataset, lockstep_validation_batches, validation_micro_batches
from megafp8.model import Transformer
from megafp8.parallel import ParallelDims
from megafp8.train.pipelined import PipelineRunner
from megafp8.train.runtime import host_to_device


@torch.no_grad()
def evaluate(model: Transformer, pipeline: Optional[PipelineRunner], valid_set: PackedDataset,
             training: TrainingConfig, dims: ParallelDims, device: torch.device) -> float:
    """Mean language-modelling loss over the fixed held-out micro-batches (`training.eval_iters` of them, or the
    whole split, split across ranks): the main head's cross-entropy alone, without the weighted MTP loss that the
    training loss adds (`model.mtp_depth`)."""
    model.eval()
    num_micro = validation_micro_batches(training.eval_iters, training.micro_batch_size, len(valid_set))
    # A context-parallel group evaluates one replica's micro-batches, each rank its tokens of them.
    batches, counted = lockstep_validation_batches(valid_set, training.micro_batch_size, num_micro, dims.replica_rank,
                                                   dims.replicas)
    if pipeline is not None:
        total = pipeline.evaluate(batches, counted)
        dist.all_reduce(total, group=dims.pp_group)  # only the last stage's rank holds the loss
    else:
        total = torch.zeros(2, device=device)  # (sum of micro-batch losses, count)
        for (tokens, targets), counts in zip(batches, counted):
            loss = model(host_to_device(tokens, device), host_to_device(targets, device), with_mtp=False)
            if counts:
                total[0] += loss
                total[1] += 1
    if dims.dp_group is not None:
        dist.all_reduce(total, group=dims.dp_group)
    return (total[0] / total[1]).item()


def replica_mean(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Mean over data-parallel replicas of a loss held by the last pipeline stage (tensor-parallel ranks
    already hold the same loss; other stages hold 0)."""
    value = value.detach().float().clone()
    if dims.pp_group is not None:
        dist.all_reduce(value, group=dims.pp_group)
    if dims.dp_group is None:
        return value
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dims.dp_group)
    return value / dims.dp_size
