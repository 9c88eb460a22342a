"""Where a weight gradient goes: added into the weight's FP32 `main_grad`, returned, or deferred to a queue.

Micro-batches accumulate weight gradients in FP32: a layer whose weight has a `main_grad` (set by the gradient
buffer) adds its weight gradient into it inside backward (the GEMM itself where it can) and returns no gradient.
Zero-bubble pipeline schedules run the weight-gradient GEMMs later, in their W pass: a layer given a
`WeightGradQueue` pushes the GEMM there.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megafp8.precision.eager import mark_static_address


def accumulate_wgrad(weight: torch.Tensor, dw: torch.Tensor) -> Optional[torch.Tensor]:
    """Add dw into `weight.main_grad` (FP32, across micro-batches) if the weight has one; else return it."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return dw
    main_grad.add_(dw)
    return None


class WeightGradQueue:
    """Weight-gradient GEMMs held back from backward, to run later (the W pass of zero-bubble pipeline
    schedules). A layer given a queue pushes its wgrad (GEMM plus FP32 accumulation into `main_grad`) here
    instead of running it; `take()` hands everything pushed so far over as one callable."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []

    def push(self, run: Callable[[], None]) -> None:
        self._pending.append(run)

    def __len__(self) -> int:
        return len(self._pending)

    def take(self) -> Callable[[], None]:
        pending, self._pending = self._pending, []

        def run_all() -> None:
            with torch.no_grad():  # as inside backward: the deferred GEMMs build no graph
                for run in pending:
                    run()
        return run_all


def weight_grad_or_defer(weight: torch.Tensor, compute: Callable[[], torch.Tensor],
                         queue: Optional[WeightGradQueue],
                         compute_into: Optional[Callable[[torch.Tensor], None]] = None) -> Optional[torch.Tensor]:
    """The weight's gradient now (see `accumulate_wgrad`), or, with a queue and an FP32 `main_grad` to add into,
    None now and the GEMM later. `compute_into(main_grad)`, where given, adds the gradient into an FP32
    `main_grad` itself (a GEMM that accumulates in its epilogue: no rounded copy, no separate add)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return compute()

    def run() -> None:
        if compute_into is not None and main_grad.dtype == torch.float32:
            compute_into(main_grad)
        else:
            accumulate_wgrad(weight, compute())

    if queue is not None:
        queue.push(run)
    else:
        run()
    return None


def main_grad_alias(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """A `fresh_alias` of the weight's FP32 `main_grad`, or None where it has none (a compiled layer then returns
    its weight gradient to autograd)."""
    main_grad = getattr(weight, "main_grad", None)
    return fresh_alias(main_grad) if main_grad is not None and main_grad.dtype == torch.float32 else None


def fresh_alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor over `t`'s memory with a version counter of its own, marked static (for compiled code to add a
    weight gradient into `main_grad` in its backward graph).

    A compiled layer gets it as a forward input and saves it for backward, where the GEMM adds into it. Saved
    tensors are checked against in-place changes: `main_grad` itself (whose counter all its views share) changes
    between one micro-batch's forward and its backward whenever another micro-batch's backward runs in between
    (pipeline schedules), which would fail that check. Each forward's own alias changes only in its own backward.
    Static, so CUDA graphs use its address instead of copying it into a graph-owned buffer (the GEMM would then add
    into the copy)."""
    alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(),
                                                                t.stride())
    mark_static_address(alias)
    return alias
