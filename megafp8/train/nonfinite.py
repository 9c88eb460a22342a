"""The non-finite guard: a step whose gradients hold an inf or nan is skipped on every rank, in every recipe.

The global gradient norm (computed for clipping, and summed over every process group, so every rank holds
the same value) is checked on the device before the optimizer runs: a non-finite norm makes the optimizer
leave masters, moments and weights as they are (`DistributedAdamW.step(apply=...)`), on every rank at once,
without the host waiting for the device. FP16 keeps its loss scaler's rule (the host checks every step and
backs the scale off), and its skips feed the same guard.

The host learns of skipped steps at the loop's sync points (logging steps and checkpoints): `check` then
takes them out of the optimizer's step count, logs them, and stops the run with `FloatingPointError` once
`training.max_consecutive_skips` steps in a row were skipped, naming the first of them and the layers whose
gradients were non-finite; the count of skips in a row is saved in checkpoints. Until a sync point, the
learning-rate schedule and Adam's bias correction run one step ahead per skipped step. Under FP16 a skip counts
toward the stop only once the loss scale is at its minimum: before that, skipping is the scaler doing its job.
A step whose FP16 gradients are finite but whose norm is not (the squares overflow FP32) is an overflow for the
scaler like any other (`unscale_or_skip`).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from megafp8.optim import DistributedAdamW
from megafp8.parallel import ParallelDims
from megafp8.precision import DynamicLossScaler

log = logging.getLogger("megafp8")
_NAMED_LAYERS = 8  # layers named in the stop message (then "and N more")


class NonFiniteGuard:
    """Device-side counts of skipped steps for one rank's optimizer; `limit` skips in a row stop the run."""

    def __init__(self, optimizer: DistributedAdamW, limit: int, device: torch.device, dims: ParallelDims) -> None:
        self.optimizer, self.limit, self.dims = optimizer, limit, dims
        # (steps skipped since the last check, skips in a row now, the step that began them)
        self._counts = torch.zeros(3, dtype=torch.int64, device=device)
        self._checked_step = 0

    def record(self, step: int, applied: torch.Tensor, counts: bool = True) -> None:
        """Account for optimizer step `step`, whose update was `applied` (a 0-d bool device tensor); `counts`: a
        skip counts toward the stop (no host sync)."""
        skipped, in_a_row, first = self._counts.unbind()
        grows = torch.logical_not(applied) & counts
        first.copy_(torch.where(grows & (in_a_row == 0), step, first))
        in_a_row.copy_(torch.where(applied, 0, in_a_row + grows.long()))
        skipped += torch.logical_not(applied).long()

    def check(self, step: int) -> None:
        """At a sync point (every rank, after optimizer step `step`): settle the optimizer's step count, log the
        steps skipped since the last check, and raise FloatingPointError after `limit` skips in a row."""
        skipped, in_a_row, first = self._counts.tolist()
        self._counts[0] = 0
        self.optimizer.settle_step_count()
        if skipped and self.dims.rank == 0:
            since = f"step {step}" if self._checked_step + 1 == step else f"steps {self._checked_step + 1}-{step}"
            log.warning("%d of %s skipped: non-finite gradients on some rank (weights and optimizer state unchanged)",
                        skipped, since)
        self._checked_step = step
        if in_a_row >= self.limit:
            raise FloatingPointError(
                f"training stopped at step {step}: {in_a_row} steps in a row from step {first} had non-finite "
                f"gradients (training.max_consecutive_skips={self.limit}); at step {step} in "
                f"{self._describe_layers()}. Weights, optimizer state and every checkpoint since are as before step "
                f"{first}. Lower optimizer.lr, raise optimizer.warmup_steps, or look at the data of those steps")

    def state_dict(self) -> dict[str, int]:
        """The skips in a row so far and the step that began them (a checkpoint's `nonfinite`): part of the run's
        state, so a run preempted 2 skips from its stop stops where the uninterrupted one would. Every save follows a
        `check`, so no skip is left unlogged and the count is below the limit."""
        _, in_a_row, first = self._counts.tolist()
        return {"skips_in_a_row": in_a_row, "first_skipped_step": first, "checked_step": self._checked_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the count of skips in a row (a checkpoint without it, from before it was saved, resumes at 0)."""
        self._counts.copy_(torch.tensor([0, int(state["skips_in_a_row"]), int(state["first_skipped_step"])]))
        self._checked_step = int(state["checked_step"])

    def _describe_layers(self) -> str:
        """The layers whose latest gradients are non-finite on any rank, in words (collective)."""
        names = self.optimizer.nonfinite_params()
        if self.dims.is_distributed:
            every: list[Optional[list[str]]] = [None] * self.dims.world_size
            dist.all_gather_object(every, names)
            names = [n for rank_names in every for n in rank_names or []]
        layers = sorted({name.removesuffix(".weight") for name in names})
        if not layers:
            return "no single gradient: their squares overflow FP32"
        more = f" and {len(layers) - _NAMED_LAYERS} more" if len(layers) > _NAMED_LAYERS else ""
        return ", ".join(layers[:_NAMED_LAYERS]) + more


def unscale_or_skip(optimizer: DistributedAdamW, scaler: DynamicLossScaler, loss_scale: float, step: int,
                    dims: ParallelDims) -> Optional[torch.Tensor]:
    """FP16: unscale the gradients of step `step` (scaled by `loss_scale`), take their global norm (clipping them),
    agree across every rank whether any gradient or the norm is inf/nan, and move the loss scale. Returns the norm,
    or None if the step is to be skipped.

    A norm that is not finite while every gradient is (their squares overflow FP32) is an overflow for the scaler
    too: the step is skipped either way, and counting it as good would grow the scale at the next
    `growth_interval` and keep it out of the backoff that makes a skip count toward the stop."""
    optimizer.scale_grads(1.0 / loss_scale)  # inf and nan stay what they are: the check below sees them
    grad_norm = optimizer.clip_grad_norm()
    found = torch.stack([optimizer.found_nonfinite(), torch.logical_not(torch.isfinite(grad_norm)).float()])
    if dims.is_distributed:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank, so all skip or none does
    nonfinite_grads, nonfinite_norm = (bool(flag) for flag in found.tolist())
    skip = nonfinite_grads or nonfinite_norm
    scaler.update(skip)
    if skip:
        if dims.rank != 0:  # every rank knows (the all-reduce above); one line a skip, not one a rank
            return None
        why = "inf/nan gradients" if nonfinite_grads else "a gradient norm that overflows FP32"
        log.warning("step %d: %s on some rank; step skipped (weights, optimizer and LR schedule unchanged), loss "
                    "scale %g -> %g", step, why, loss_scale, scaler.scale)
        return None
    return grad_norm

