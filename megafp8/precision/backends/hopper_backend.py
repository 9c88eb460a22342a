"""The `hopper` backend (SM90): the cublas backend with the experts' grouped GEMMs on the warp-specialized Gluon
kernel (`megafp8.precision.kernels.ws_gemm`) instead of the Triton TMA one.

`auto` picks it where it runs (SM90 and Triton's Gluon). Its grouped GEMMs beat the TMA kernels on 10 of issue 19's
12 shapes alone (up to 25%; job AM: the wgrads 13-19% faster since its scales arrive by TMA). In the MoE step they
paid off only once the experts ran inside the compiled graphs: while they ran eagerly the FP8 step waited on the
host, and the faster kernels gained 1-1.4% (jobs T, V and AS). Traced, under CUDA graphs, the FP8 MoE step's
grouped GEMMs take 44.0 ms against the TMA kernels' 51.0 and the step runs 3.2-3.4% faster (102,883 and 103,054
against 99,713 tokens/s; `docs/benchmarks.md`, twenty-second session). Dense layers run exactly as under `cublas`.
"""
from __future__ import annotations

from typing import Optional

import torch

from megafp8.precision.backends.cublas_backend import CublasBackend


class HopperBackend(CublasBackend):
    """cuBLAS for the dense GEMMs, Triton quantizers, warp-specialized grouped GEMMs."""

    name = "hopper"
    priority = 3  # `auto` prefers it to `cublas` where both run (see the module docstring)
    grouped_kernel = "ws"

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        reason = super().unavailable_reason(device)
        if reason is not None:
            return reason.replace("cublas backend", "hopper backend")
        from megafp8.precision.kernels.gemm import warp_specialized_unavailable
        return warp_specialized_unavailable(device)
