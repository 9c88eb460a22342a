"""The `hopper` backend (SM90): the cublas backend with the experts' grouped GEMMs on the warp-specialized Gluon
kernel (`megafp8.precision.kernels.ws_gemm`) instead of the Triton TMA one.

Opt-in (`precision.fp8_backend: hopper`): its grouped GEMMs run 5-15% faster than the TMA kernels on issue 19's
shapes (`docs/benchmarks.md`, jobs T and U), but `auto` keeps choosing `cublas` until whole MoE steps show the gain.
"""
from __future__ import annotations

from typing import Optional

import torch

from megafp8.precision.backends.cublas_backend import CublasBackend


class HopperBackend(CublasBackend):
    """cuBLAS for the dense GEMMs, Triton quantizers, warp-specialized grouped GEMMs."""

    name = "hopper"
    priority = 0  # never chosen by `auto` (see the module docstring)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        reason = super().unavailable_reason(device)
        if reason is not None:
            return reason.replace("cublas backend", "hopper backend")
        from megafp8.precision.kernels.gemm import warp_specialized_unavailable
        return warp_specialized_unavailable(device)

    def grouped_gemm_1x128_128x128(self, a, a_scale, w, transposed, rows, out_dtype):
        b, b_scale = self.weight_transposed(w) if transposed else (w.w_fp8, w.w_scale)
        if a.shape[0] == 0:
            return torch.zeros(0, b.shape[1], dtype=out_dtype, device=a.device)
        return self.gemms.grouped_gemm(a, a_scale, b, b_scale, rows.tile_expert, out_dtype, kernel="ws")

    def grouped_gemm_1x128_1x128(self, a, a_scale, b, b_scale, rows, num_experts, out_dtype, accumulate=None):
        if a.shape[1] == 0:
            if accumulate is not None:
                return accumulate
            return torch.zeros(num_experts, a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
        return self.gemms.grouped_wgrad(a, a_scale, b, b_scale, rows.tile_start, rows.tile_count, out_dtype,
                                        kernel="ws", accumulate=accumulate)
