"""The `hopper` backend (SM90): the cublas backend with the experts' grouped GEMMs and the dense layers' fprop and
dgrad on the warp-specialized Gluon kernel (`megafp8.precision.kernels.ws_gemm`).

`auto` picks it where it runs (SM90 and Triton's Gluon). The warp-specialized grouped GEMMs pay off once the
experts run inside the compiled graphs (eagerly, the FP8 MoE step waits on the host instead). The dense fprop and
dgrad (1x128 x 128x128) run on the same kernel; the dense weight gradient stays on cuBLASLt, adding into
`main_grad` in its epilogue, which is faster there than the warp-specialized kernel. The dense fprop and dgrad
use the kernel's interleaved-FFMA variant (`ws_gemm(interleave_ffma=True)`, the same bits); the grouped ones the
plain kernel, which was 13% faster on three of four MoE-step shapes and no slower in the step (job GL). The
measurements behind each choice are in `docs/performance.md` and `docs/benchmarks.md`.

With `precision.fp8_wgrad_input_blocks` (x^T in 128x128 blocks, `Fp8Recipe.wgrad_input_blocks`) the weight
gradients whose input arrives that way run on the warp-specialized kernel too, promoted as fprop is (1.19-1.46x
cuBLASLt's 1x128 x 1x128 wgrad on our dense linears).
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
    interleave_ffma = True  # the dense fprop and dgrad (mean +2.4%, jobs DG-DK)
    grouped_interleave_ffma = False  # the plain grouped fprop/dgrad: 1,101-1,252 TFLOP/s against 1,082-1,105 (GL)
    wgrad_input_blocks = True  # x^T in 128x128 blocks: its wgrads on the warp-specialized kernel

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
                       interleave_ffma=self.interleave_ffma and block_n == 256)

    def gemm_1x128_1x128(self, a, a_scale, b, b_scale, out_dtype):
        if not self._x_in_blocks(b, b_scale):
            return super().gemm_1x128_1x128(a, a_scale, b, b_scale, out_dtype)
        from megafp8.precision.kernels.gemm import wgrad
        return wgrad(a, a_scale, b, b_scale, out_dtype, b_blocks=True)

    def gemm_1x128_1x128_accumulate_(self, out, a, a_scale, b, b_scale):
        if not self._x_in_blocks(b, b_scale):
            super().gemm_1x128_1x128_accumulate_(out, a, a_scale, b, b_scale)
            return
        from megafp8.precision.kernels.gemm import wgrad
        wgrad(a, a_scale, b, b_scale, torch.float32, accumulate=out, b_blocks=True)


def _tile_width(columns: int) -> int:
    """The warp-specialized kernel's tile width for an output of `columns` columns: 256 (fewer, larger tiles, the
    faster width on our dense fprop and dgrad) unless one 128-wide tile covers it."""
    return 128 if columns <= 128 else 256
