"""The `hopper` backend (SM90): the cublas backend with the experts' grouped GEMMs on the warp-specialized Gluon
kernel (`megafp8.precision.kernels.ws_gemm`) instead of the Triton TMA one.

`auto` picks it where it runs (SM90 and Triton's Gluon). Its grouped fprop and dgrad run at 1.65-1.82x BF16's
`torch._grouped_mm` on the MoE model's expert shapes since their output tiles leave by TMA, and its wgrads at
1.25-1.40x (`docs/benchmarks.md`, twenty-third session, jobs CQ and CR). In the MoE step they paid off only once the
experts ran inside the compiled graphs: while they ran eagerly the FP8 step waited on the host, and faster kernels
gained 1-1.4% (jobs T, V and AS). Traced, under CUDA graphs, the FP8 MoE step ran 3.2-3.4% faster than with the TMA
kernels (twenty-second session), and the TMA epilogue took it from 1.132x to 1.170x BF16 within one job (CQ).
Dense layers run exactly as under `cublas`.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch

from megafp8.precision.backends.cublas_backend import CublasBackend


class HopperBackend(CublasBackend):
    """cuBLAS for the dense GEMMs, Triton quantizers, warp-specialized grouped GEMMs."""

    name = "hopper"
    priority = 3  # `auto` prefers it to `cublas` where both run (see the module docstring)
    grouped_kernel = "ws"

    # The dense layers' GEMMs on the warp-specialized kernel too (fprop and dgrad: 1x128 x 128x128; the weight
    # gradient added into main_grad); False: cuBLAS's, as under `cublas`.
    dense_blocks_ws: ClassVar[bool] = True
    dense_wgrad_ws: ClassVar[bool] = False  # cuBLASLt's was as fast or faster on 10 of 12 shapes (job CS)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        reason = super().unavailable_reason(device)
        if reason is not None:
            return reason.replace("cublas backend", "hopper backend")
        from megafp8.precision.kernels.gemm import warp_specialized_unavailable
        return warp_specialized_unavailable(device)

    def gemm_1x128_128x128(self, a, a_scale, b, b_scale, out_dtype):
        if not self.dense_blocks_ws:
            return super().gemm_1x128_128x128(a, a_scale, b, b_scale, out_dtype)
        from megafp8.precision.kernels.ws_gemm import ws_gemm
        c = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
        return ws_gemm(a, a_scale, b, self.block_scales_nk(b_scale), c, b_blockwise=True,
                       block_n=_tile_width(b.shape[0]))

    def gemm_1x128_1x128_accumulate_(self, out, a, a_scale, b, b_scale):
        if not self.dense_wgrad_ws:
            return super().gemm_1x128_1x128_accumulate_(out, a, a_scale, b, b_scale)
        from megafp8.precision.kernels.ws_gemm import ws_gemm
        ws_gemm(a, a_scale, b, b_scale, out, b_blockwise=False, accumulate=True, block_n=_tile_width(b.shape[0]))


def _tile_width(columns: int) -> int:
    """The warp-specialized kernel's tile width for an output of `columns` columns: 256 (fewer, larger tiles) unless
    one 128-wide tile covers it."""
    return 128 if columns <= 128 else 256
