"""Training and evaluation steps under pipeline parallelism: this rank's stages, their schedule, the loss.

The trainer hands over a step's micro-batches; the schedule (`torch.distributed.pipelining`) splits the
concatenated batch back into the same micro-batches, runs the stages, and back-propagates
`loss x loss_scale / micro-batches` from the last stage, so gradients are those of a PP=1 step.
Only the rank holding the last stage sees the loss (and its LM and MTP parts); the trainer sums them over the
pipeline group when it logs.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megafp8.config.layout import ZERO_BUBBLE
from megafp8.model import LossTerms, PipelineChunk, Transformer
from megafp8.parallel import ParallelDims
from megafp8.parallel.pipeline import (
    PipelineLayout,
    attach_wgrad_queue,
    bubble_fraction,
    build_schedule,
    forward_only,
)
from megafp8.train.runtime import host_to_device
from megafp8.precision import WeightGradQueue


class PipelineRunner:
    """Runs this rank's pipeline stages of `model` (which holds only those stages' parts)."""

    def __init__(self, model: Transformer, layout: PipelineLayout, dims: ParallelDims, n_micro: int,
                 micro_batch_size: int, seq_len: int, device: torch.device) -> None:
        self.model, self.layout, self.dims, self.n_micro, self.device = model, layout, dims, n_micro, device
        self.specs = layout.local_stages(dims.pp_rank)
        self.chunks = [PipelineChunk(model, spec.layers, spec.first, spec.last) for spec in self.specs]
        self.holds_first = any(spec.first for spec in self.specs)
        self.holds_last = any(spec.last for spec in self.specs)
        tp = model.tp
        rows = micro_batch_size * seq_len // (tp.size if tp.sp else 1)
        dtype = next(model.parameters()).dtype
        self.hidden_shape = (rows, model.cfg.hidden_size)
        self.hidden_dtype = dtype
        hidden_meta = torch.empty(self.hidden_shape, dtype=dtype, device="meta", requires_grad=True)  # gets a grad
        tokens_meta = torch.empty(micro_batch_size, seq_len, dtype=torch.long, device="meta")
        dw_builders = None
        if layout.schedule in ZERO_BUBBLE:  # weight gradients wait for the schedule's W actions
            queues = [WeightGradQueue() for _ in self.chunks]
            for chunk, queue in zip(self.chunks, queues):
                attach_wgrad_queue(chunk, queue)
            dw_builders = [queue.take for queue in queues]
        self._losses: list[torch.Tensor] = []
        self._loss_factor = 1.0
        self.schedule = build_schedule(
            self.chunks, self.specs, layout, dims.pp_group, device,
            lambda spec: tokens_meta if spec.first else hidden_meta, hidden_meta, n_micro, self._loss_fn, dw_builders)
        self.bubble = bubble_fraction(self.schedule, layout.num_stages, layout.pp, n_micro)

    def _loss_fn(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        terms = self.model.head_terms(hidden, targets)
        self._losses.append(torch.stack(terms).detach())
        return terms.total * self._loss_factor

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_scale: float
                   ) -> torch.Tensor:
        """Forward and backward of every micro-batch (gradients accumulate as at PP=1). Returns the mean loss terms
        (total, LM, MTP: `megafp8.model.mtp.LossTerms`) on the rank holding the last stage, zeros elsewhere."""
        self._loss_factor = loss_scale / self.n_micro
        self._losses = []
        args = (host_to_device(torch.cat([t for t, _ in micro_batches]), self.device),) if self.holds_first else ()
        kwargs = ({"target": host_to_device(torch.cat([t for _, t in micro_batches]), self.device)}
                  if self.holds_last else {})
        self.schedule.step(*args, **kwargs)
        if not self.holds_last:
            return torch.zeros(len(LossTerms._fields), device=self.device)
        return torch.stack(self._losses).sum(dim=0) / self.n_micro

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], counted: Sequence[bool]
                 ) -> torch.Tensor:
        """(sum of the counted micro-batches' losses, their count) on the rank holding the last stage, zeros
        elsewhere. Every micro-batch runs: the uncounted ones keep this rank in step with its peers' collectives."""
        total = torch.zeros(2, device=self.device)
        hidden_like = torch.empty(self.hidden_shape, dtype=self.hidden_dtype, device=self.device)
        for (tokens, targets), counts in zip(batches, counted):
            first_input = host_to_device(tokens, self.device) if self.holds_first else None
            out = forward_only(self.chunks, self.specs, self.layout, self.dims.pp_rank, self.dims.pp_group,
                               first_input, hidden_like)
            if out is not None:
                loss = self.model.head_loss(out, host_to_device(targets, self.device), with_mtp=False)
                if counts:
                    total[0] += loss
                    total[1] += 1
        return total
