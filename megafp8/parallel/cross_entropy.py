"""Cross-entropy of (vocab-sharded) logits without an FP32 copy of them.

Per token the loss is log(sum_v exp(x_v)) - x_target and its gradient softmax(x) - one_hot(target). Written as
`F.cross_entropy(logits.float())`, a step casts the BF16 logits to FP32, writes their log-softmax, and in backward
fills an FP32 gradient, writes the log-softmax's FP32 gradient and casts it back: ~36 bytes moved per logit, the
FP32 log-softmax kept from forward to backward, and 12 bytes per logit at once at its peak (6 GiB at 16k tokens and
a 32k vocabulary, `benchmarks/cross_entropy.py`).

Here the forward reads each logit once and keeps three FP32 numbers per token: the row's max, the sum of
exp(x - max) and the target's logit. Under tensor parallelism each rank has them for its vocabulary columns and
two small all-reduces combine them (the max; then the rescaled sums and the target logit). The backward reads the
logits once more and writes the gradient in their dtype. Nothing of vocabulary size is made but that gradient, and
nothing is kept but the logits themselves (the LM head's output, which exists anyway): ~6 bytes moved and 2 made
per BF16 logit. All arithmetic is FP32; the loss is `log(sum) + (max - x_target)`, so a confident prediction keeps
FP32's relative precision in its small loss.

On CUDA GPUs of compute capability 8.0 and up the two passes are Triton kernels (imported lazily: CPU-only installs
never need Triton); elsewhere their pure-torch twins run, in chunks of rows that bound the FP32 temporaries. The
kernels differ from the twins only in summation order and in the exponential's last bits
(`tests/test_cross_entropy.py` on the GPU).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megafp8.parallel.dims import TensorParallel
from megafp8.precision.eager import eager_custom_op
from megafp8.precision.triton_support import triton_runs_on

IGNORE_INDEX = -100  # a target that contributes no loss (e.g. beyond the end of a sample for MTP)
_TWIN_ROWS = 1024  # rows per chunk of the pure-torch twins (bounds their FP32 temporaries)


def _use_triton(logits: torch.Tensor) -> bool:
    return logits.is_cuda and triton_runs_on(logits.device)


def row_stats_reference(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `logits` (N, V): max, sum of exp(x - max) and x[target] (0 where the target is outside [0, V)),
    each FP32 (N,). A row whose max is -inf has a sum of 0 (no term counts)."""
    n, v = logits.shape
    row_max = torch.empty(n, dtype=torch.float32, device=logits.device)
    sum_exp = torch.empty_like(row_max)
    for start in range(0, n, _TWIN_ROWS):
        x = logits[start:start + _TWIN_ROWS].float()
        m = x.amax(dim=-1)
        shift = m.masked_fill(m == float("-inf"), 0.0)  # an all -inf row: exp(-inf) = 0 terms, not nan
        row_max[start:start + _TWIN_ROWS] = m
        sum_exp[start:start + _TWIN_ROWS] = (x - shift.unsqueeze(-1)).exp_().sum(dim=-1)
    inside = (target >= 0) & (target < v)
    picked = logits.gather(-1, target.masked_fill(~inside, 0).unsqueeze(-1)).squeeze(-1).float()
    return row_max, sum_exp, picked.masked_fill(~inside, 0.0)


def logits_grad_reference(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                          dloss: torch.Tensor) -> torch.Tensor:
    """(exp(x - lse) - one_hot(target)) * dloss per row, in FP32, rounded once to the logits' dtype; `target`
    outside [0, V) subtracts nothing (under TP: another rank's column)."""
    n, v = logits.shape
    grad = torch.empty_like(logits)
    inside = (target >= 0) & (target < v)
    for start in range(0, n, _TWIN_ROWS):
        rows = slice(start, start + _TWIN_ROWS)
        p = (logits[rows].float() - lse[rows].unsqueeze(-1)).exp_()
        local = torch.arange(p.shape[0], device=p.device)
        p[local, target[rows].masked_fill(~inside[rows], 0)] -= inside[rows].float()
        grad[rows] = p.mul_(dloss[rows].unsqueeze(-1))
    return grad


@eager_custom_op("megafp8::ce_row_stats", mutates_args=())
def _row_stats_op(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton(logits):
        from megafp8.parallel import cross_entropy_kernels

        return cross_entropy_kernels.row_stats(logits, target)
    return row_stats_reference(logits, target)


@_row_stats_op.register_fake
def _(logits, target):
    n = logits.shape[0]
    return tuple(logits.new_empty(n, dtype=torch.float32) for _ in range(3))


@eager_custom_op("megafp8::ce_logits_grad", mutates_args=())
def _logits_grad_op(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                    dloss: torch.Tensor) -> torch.Tensor:
    if _use_triton(logits):
        from megafp8.parallel import cross_entropy_kernels

        return cross_entropy_kernels.logits_grad(logits, lse, target, dloss)
    return logits_grad_reference(logits, lse, target, dloss)


@_logits_grad_op.register_fake
def _(logits, lse, target, dloss):
    return torch.empty_like(logits)


class _CrossEntropy(torch.autograd.Function):
    """Per-token losses of logits (N, V / tp) against targets (N,) in [0, V); saves the logits and, per token, the
    target's column on this rank and the log-sum-exp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        local = targets - tp.rank * logits.shape[-1] if tp.enabled else targets
        row_max, sum_exp, target_logit = _row_stats_op(logits, local)
        if tp.enabled:
            # combine the ranks' partial sums at the global max; the target's logit lives on one rank (zeros elsewhere)
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp.group)
            shift = global_max.masked_fill(global_max == float("-inf"), 0.0)
            both = torch.stack([sum_exp * (row_max - shift).exp(), target_logit])
            dist.all_reduce(both, group=tp.group)
            row_max, (sum_exp, target_logit) = global_max, both
        log_sum = sum_exp.log()
        ctx.save_for_backward(logits, local, log_sum + row_max)
        return log_sum + (row_max - target_logit)

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        logits, local, lse = ctx.saved_tensors
        return _logits_grad_op(logits, lse, local, dloss), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 tp: Optional[TensorParallel] = None) -> torch.Tensor:
    """Mean token cross-entropy in FP32 whatever the logits' dtype, over targets other than IGNORE_INDEX (0 when
    every target is ignored). logits: (..., V / tp), this rank's vocabulary columns; targets: (...) in [0, V) or
    IGNORE_INDEX (the data loader checks token ids against the vocabulary)."""
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    valid = targets != IGNORE_INDEX
    losses = _CrossEntropy.apply(logits, targets.masked_fill(~valid, 0), tp or TensorParallel.single())
    return losses.masked_fill(~valid, 0.0).sum() / valid.sum().clamp(min=1)
