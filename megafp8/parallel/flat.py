"""All-gather and reduce-scatter of whole flat tensors through the current torch API.

torch 2.13 deprecated `all_gather_into_tensor` and `reduce_scatter_tensor` (FutureWarning on every call) for
`all_gather_single` and `reduce_scatter_single`, which older releases (2.11) lack: these call whichever the
installed torch has, so a run prints no deprecation warning and keeps working on both.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None,
                    async_op: bool = False) -> Optional[Any]:
    """Every rank's `input`, concatenated along dim 0 in rank order, into `output`."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                        group: Optional[Any] = None, async_op: bool = False) -> Optional[Any]:
    """The sum (or `op`) of every rank's `input`, of which this rank keeps its dim-0 slice in `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)
