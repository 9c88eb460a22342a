"""The seam between an FP8 layer's GEMMs and a tensor-parallel layer's collectives.

`megafp8.parallel` supplies the tensor-parallel `LinearComm`s, so an FP8 layer can quantize before it communicates
(FP8 bytes cross the wire) while `megafp8.precision` stays free of process groups. This base class is the
identity (a plain linear). Rows are tokens throughout.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class LinearComm:
    """The collectives around one linear's GEMMs; the identity here.

    Subclasses use collectives `torch.compile` can trace (torch.distributed's all-gather, reduce-scatter and
    all-reduce into tensors, which Dynamo turns into functional collectives), so a compiled FP8 layer keeps them in
    its graph; while tracing, none may be asynchronous (`start_reduce_grad_input`)."""

    def gather_input(self, x2d: torch.Tensor) -> torch.Tensor:
        """Forward input (BF16) -> the rows the GEMM needs."""
        return x2d

    def gathers_quantized(self, rows: int) -> bool:
        """Whether an input of `rows` local rows may be quantized before `gather_quantized` (its 1x128 tiles along
        the rows must then not straddle two ranks' rows); otherwise it is gathered in BF16 and quantized after."""
        return True

    def gather_quantized(self, x_fp8: torch.Tensor, x_scale: torch.Tensor, xt_fp8: Optional[torch.Tensor],
                         xt_scale: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        """The same gather for an input quantized both ways (`quantize.quantize_rows_cols` layouts), or along its
        features only (xt_fp8 and xt_scale None: no weight gradient to compute)."""
        return x_fp8, x_scale, xt_fp8, xt_scale

    def reduce_output(self, y2d: torch.Tensor) -> torch.Tensor:
        """The GEMM's output -> the layer's output (e.g. summed over ranks that split K)."""
        return y2d

    def gather_grad_output(self, dy2d: torch.Tensor) -> torch.Tensor:
        """Backward: the layer's output gradient -> the GEMM's output gradient (conjugate of reduce_output)."""
        return dy2d

    def start_reduce_grad_input(self, dx2d: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Backward: start reducing the input gradient (conjugate of gather_input); the returned callable
        waits and gives the result, so the reduction overlaps the wgrad GEMM."""
        return lambda: dx2d


def quantized_input(x2d: torch.Tensor, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
                    comm: LinearComm) -> tuple[torch.Tensor, ...]:
    """`quantize` applied to the GEMM's whole input: on this rank's rows before the gather where that gives the
    same tiles, else after a BF16 gather."""
    if comm.gathers_quantized(x2d.shape[0]):
        return comm.gather_quantized(*quantize(x2d))
    return quantize(comm.gather_input(x2d))
