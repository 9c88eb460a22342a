"""The `hopper` backend (SM90): the cublas backend with the experts' grouped GEMMs on the warp-specialized Gluon
kernel (`megafp8.precision.kernels.ws_gemm`) instead of the Triton TMA one.

Opt-in (`precision.fp8_backend: hopper`): its grouped GEMMs beat the TMA kernels on 10 of issue 19's 12 shapes (up
to 25%) and took 48.7 against 50.8 ms of a compiled MoE step, but the step itself got only 1% faster, within the
noise (`docs/benchmarks.md`, jobs T and V), so `auto` keeps choosing `cublas`. Since then the kernel reads its
scales by TMA (job AM: grouped wgrads 13-19% faster, dgrad 2-10%), and the compiled MoE step with it was 1.4% faster
than with `cublas` (job AS: 93,206 against 91,916 tokens/s, separate runs of one job): still too little, measured
once, to make it the default.
"""
from __future__ import annotations

from typing import Optional

import torch

from megafp8.precision.backends.cublas_backend import CublasBackend


class HopperBackend(CublasBackend):
    """cuBLAS for the dense GEMMs, Triton quantizers, warp-specialized grouped GEMMs."""

    name = "hopper"
    priority = 0  # never chosen by `auto` (see the module docstring)
    grouped_kernel = "ws"

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        reason = super().unavailable_reason(device)
        if reason is not None:
            return reason.replace("cublas backend", "hopper backend")
        from megafp8.precision.kernels.gemm import warp_specialized_unavailable
        return warp_specialized_unavailable(device)
