"""The `deepgemm` backend (SM90, opt-in): `hopper` with the dense layers' fprop and dgrad on DeepSeek's DeepGEMM.

DeepGEMM (github.com/deepseek-ai/DeepGEMM) is the public library of DeepSeek-V3's blockwise FP8 GEMMs. Its SM90
1x128 x 128x128 kernel (`deep_gemm.fp8_gemm_nt`) runs 256 x 128 tiles in clusters of two CTAs that share the A
tile by TMA multicast, which our Gluon kernel cannot issue (Triton 3.6); on the 8B-layer's linears it ran 5-9%
faster than ours, 8% at the same power-capped clock (`benchmarks/dense_gemm.py`'s DeepGEMM column, job GV in
docs/benchmarks.md).
The numerics are the recipe's: the same operands and scales, each 128-deep product promoted into FP32 (only the
order of the FP32 additions differs, as between any two GEMM kernels).

It is opt-in (`precision.fp8_backend: deepgemm`; `auto` never picks it) because DeepGEMM is an optional dependency
with needs of its own: it is built from source against the installed torch and JIT-compiles each GEMM shape with the
CUDA toolkit's nvcc at first use (seconds per shape), and on the machine we measured on its JIT crashed unless the
compiler's libstdc++ was preloaded (`benchmarks/gpu_lib.sh` `install_deepgemm`). The weight gradients, the experts'
grouped GEMMs and every quantizer stay on the hopper backend's kernels.
"""
from __future__ import annotations

from typing import Optional

import torch

from megafp8.precision.backends.hopper_backend import HopperBackend
from megafp8.precision.formats import TILE
from megafp8.precision.quantize import mn_major


class DeepGemmBackend(HopperBackend):
    """`hopper`, with the dense 1x128 x 128x128 GEMMs (fprop, dgrad) on DeepGEMM's `fp8_gemm_nt`."""

    name = "deepgemm"
    priority = -1  # never chosen by `auto`: an optional dependency, asked for by name

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        reason = super().unavailable_reason(device)
        if reason is not None:
            return reason.replace("hopper backend", "deepgemm backend")
        try:
            import deep_gemm  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any failure to load it is a reason not to use it
            return (f"the deepgemm backend needs DeepGEMM (github.com/deepseek-ai/DeepGEMM) built and importable "
                    f"({type(exc).__name__}: {exc})")
        return None

    def gemm_1x128_128x128(self, a, a_scale, b, b_scale, out_dtype):
        if out_dtype != torch.bfloat16:  # DeepGEMM's 1x128 x 128x128 kernel writes BF16 only
            return super().gemm_1x128_128x128(a, a_scale, b, b_scale, out_dtype)
        import deep_gemm
        out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
        deep_gemm.fp8_gemm_nt((a, mn_major(a_scale)), (b, _row_major_blocks(self.block_scales_nk(b_scale), b)), out)
        return out


def _row_major_blocks(blocks: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B's block scales as DeepGEMM's SM90 kernel reads them: (N/128, K/128) with strides exactly (K/128, 1). The
    cublas layout pads K/128 to a multiple of four, and torch calls a one-row view of it contiguous whatever its row
    stride, which DeepGEMM refuses (job GW: N = 128); either way a copy, a few bytes."""
    n_blocks, k_blocks = b.shape[0] // TILE, b.shape[1] // TILE
    blocks = blocks[:, :k_blocks]
    if blocks.stride() == (k_blocks, 1):
        return blocks
    return torch.empty(n_blocks, k_blocks, dtype=blocks.dtype, device=blocks.device).copy_(blocks)
