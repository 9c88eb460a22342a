"""The MoE router's group-limited top-k choice (DeepSeek-V3's node-limited routing, on one rank's tokens).

Per token, from the scores the choice is made on (FP32, bias included): with `n_group > 1` each group of
consecutive experts scores the sum of its two best (its best where a group holds one expert), the token keeps its
`topk_group` best groups, and its `top_k` best experts among those groups' are chosen, best first. The pure-torch
definition is `group_limited_topk_reference` (three `torch.topk` calls and the masking between them); on CUDA
GPUs of compute capability 8.0 and up one Triton kernel (`routing_kernels`) makes the same choice in one pass. The
two agree wherever the scores have no ties; between equal scores the kernel takes the lower expert (or group) index
(+0.0 counting above -0.0), while `torch.topk` leaves the order of equal values unspecified, and the kernel ranks an
expert of a dropped group below every score, -inf included, where the twin's -inf fill ties with a real -inf. Either
way a token's experts are distinct and in range, nan counting as the largest score (as `torch.topk` ranks it).
"""
from __future__ import annotations

import torch

from megafp8.precision.eager import eager_custom_op
from megafp8.precision.triton_support import triton_runs_on

MAX_KERNEL_EXPERTS = 1024  # the kernel holds a token's scores in registers


def group_limited_topk_reference(choice: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """(N, E) scores -> (N, top_k) chosen experts (int64, best first), group-limited where n_group > 1."""
    if n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, choice.shape[1] // n_group)  # (N, groups, experts each)
        best = min(2, grouped.shape[-1])
        group_score = grouped.topk(best, dim=-1).values.sum(dim=-1)  # (N, groups)
        keep = group_score.topk(topk_group, dim=-1).indices
        mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view_as(choice)
    return choice.topk(top_k, dim=-1).indices


def kernel_fits(choice: torch.Tensor, n_group: int) -> bool:
    """Whether the Triton kernel takes these scores: CUDA FP32 with unit column stride on a GPU it runs on, a power
    of two of experts (up to `MAX_KERNEL_EXPERTS`) in groups of a power of two (`triton_support`)."""
    e = choice.shape[-1]
    return (choice.is_cuda and choice.dtype == torch.float32 and choice.dim() == 2 and choice.stride(-1) == 1
            and e <= MAX_KERNEL_EXPERTS and _power_of_two(e) and e % n_group == 0 and _power_of_two(e // n_group)
            and triton_runs_on(choice.device))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@eager_custom_op("megafp8::group_limited_topk", mutates_args=())
def _group_limited_topk_op(choice: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    if kernel_fits(choice, n_group):
        from megafp8.parallel import routing_kernels

        return routing_kernels.group_limited_topk(choice, n_group, topk_group, top_k)
    return group_limited_topk_reference(choice, n_group, topk_group, top_k)


@_group_limited_topk_op.register_fake
def _(choice, n_group, topk_group, top_k):
    return choice.new_empty(choice.shape[0], top_k, dtype=torch.int64)


def group_limited_topk(choice: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """(N, E) FP32 scores (no gradient flows through the choice) -> (N, top_k) chosen experts, int64, best first:
    the Triton kernel where `kernel_fits`, else `group_limited_topk_reference`."""
    return _group_limited_topk_op(choice.detach(), n_group, topk_group, top_k)
