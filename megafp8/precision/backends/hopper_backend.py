"""The `hopper` backend (SM90): the cublas backend with the experts' grouped GEMMs and the dense layers' fprop and
dgrad on the warp-specialized Gluon kernel (`megafp8.precision.kernels.ws_gemm`).

`auto` picks it where it runs (SM90 and Triton's Gluon). Its grouped fprop and dgrad run at 1.64-1.80x BF16's
`torch._grouped_mm` on issue 19's four shapes since their output tiles leave by TMA, its wgrads into `main_grad` at
1.59-1.99x BF16's `_grouped_mm` and add (`docs/benchmarks.md`, twenty-fourth session, job CV). In the MoE step they
paid off only once the experts ran inside the compiled graphs: while they ran eagerly the FP8 step waited on the
host, and faster kernels gained 1-1.4% (jobs T, V and AS). Traced, under CUDA graphs, the FP8 MoE step ran 3.2-3.4%
faster than with the TMA kernels (twenty-second session), and the TMA epilogue took it from 1.132x to 1.170x BF16
within one job (CQ).

Dense layers: fprop and dgrad (1x128 x 128x128) run on the same kernel, faster than cuBLAS's blockwise
`F.scaled_mm` on 22 of the 24 ~1B, 8B-layer and `fp8_linear.py` shapes replayed from CUDA graphs (up to 19%; 3% and
0.5% slower on the other two; job CV); whole FP8 steps +1.1-1.5% (jobs CV, CW). The weight gradient stays on
cuBLASLt, adding into `main_grad` in its epilogue: the warp-specialized kernel was slower on 8 of those 12 linears
(-5% to +7%, job CV), and with 256 x 128 tiles on 8 again (twenty-fifth session, job CZ); with the experts' wgrads
on 256 x 128 tiles the MoE step ran 0.997x (job DA), so those tiles were removed.

The fprop and dgrad (dense and grouped) run the kernel's interleaved-FFMA variant (`ws_gemm(interleave_ffma=True)`,
DeepGEMM's cubin pass): the same bits, dense GEMMs +2.4% on average, grouped ones unchanged, whole FP8 steps +0.6%
(8B-layer) and +0.55% (MoE) in single runs (twenty-sixth session, job DG).
"""
from __future__ import annotations

from typing import Optional

import torch

from megafp8.precision.backends.cublas_backend import CublasBackend


class HopperBackend(CublasBackend):
    """cuBLAS(Lt) for the dense weight gradients, Triton quantizers, warp-specialized fprop, dgrad and grouped
    GEMMs."""

    name = "hopper"
    priority = 3  # `auto` prefers it to `cublas` where both run (see the module docstring)
    grouped_kernel = "ws"
    interleave_ffma = True  # (job DG)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        reason = super().unavailable_reason(device)
        if reason is not None:
            return reason.replace("cublas backend", "hopper backend")
        from megafp8.precision.kernels.gemm import warp_specialized_unavailable
        return warp_specialized_unavailable(device)

    def gemm_1x128_128x128(self, a, a_scale, b, b_scale, out_dtype):
        from megafp8.precision.kernels.ws_gemm import ws_gemm
        c = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
        block_n = _tile_width(b.shape[0])
        return ws_gemm(a, a_scale, b, self.block_scales_nk(b_scale), c, b_blockwise=True, block_n=block_n,
                       interleave_ffma=block_n == 256)


def _tile_width(columns: int) -> int:
    """The warp-specialized kernel's tile width for an output of `columns` columns: 256 (fewer, larger tiles; the
    faster width on every dense fprop and dgrad of job CV) unless one 128-wide tile covers it."""
    return 128 if columns <= 128 else 256
