"""The `cublas` backend (SM90): cuBLASLt's blockwise-scaled FP8 GEMMs through `torch.nn.functional.scaled_mm`, fed
by the Triton quantizers, which write scales straight into the layouts cuBLAS reads; weight gradients that go into
an FP32 `main_grad` through cuBLASLt directly (`megafp8.precision.kernels.cublaslt`), added in its epilogue."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megafp8.precision.backends.reference import QuantizedWeight
from megafp8.precision.backends.triton_backend import TritonBackend, cuda_fp8_unavailable_reason
from megafp8.precision.formats import TILE, Fp8Format
from megafp8.precision.quantize import mn_major

# cuBLASLt rejects (CUBLAS_STATUS_NOT_SUPPORTED) 1x128-scaled operands whose row count is not a multiple of 4.
_ROW_MULTIPLE = 4


def _block_scales(n_blocks: int, k_blocks: int, device: torch.device) -> torch.Tensor:
    """Zeroed (K/128 padded to a multiple of 4, N/128) block scales of a (N, K) operand, K-major: the layout
    cuBLAS reads for a 128x128-scaled B. Entry (n, k) lives at storage offset n * padded_k + k."""
    padded_k = -(-k_blocks // 4) * 4
    return torch.zeros(n_blocks, padded_k, dtype=torch.float32, device=device).t()


class CublasBackend(TritonBackend):
    """cuBLAS GEMMs for the dense layers (the fastest blockwise GEMMs on Hopper, `docs/benchmarks.md`), Triton
    quantizers and grouped GEMMs."""

    name = "cublas"
    priority = 2

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        reason = cuda_fp8_unavailable_reason(cls.name, device)
        if reason is not None:
            return reason
        if torch.cuda.get_device_capability(device) < (9, 0):
            return "the cublas backend needs an SM90 (Hopper) GPU for blockwise-scaled FP8 GEMMs"
        if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
            return f"the cublas backend needs torch.nn.functional.scaled_mm (torch {torch.__version__} lacks it)"
        return None

    def empty_weight(self, shape, fmt: Fp8Format, device: torch.device, transpose: bool = True) -> QuantizedWeight:
        if len(shape) != 2:  # stacked experts: the Triton grouped GEMMs read plain scales
            return super().empty_weight(shape, fmt, device, transpose)
        n, k = shape
        return QuantizedWeight(
            torch.empty(n, k, dtype=fmt.dtype, device=device), _block_scales(n // TILE, k // TILE, device),
            torch.empty(k, n, dtype=fmt.dtype, device=device) if transpose else None,
            _block_scales(k // TILE, n // TILE, device) if transpose else None)

    def block_scales_nk(self, scale):
        return scale.t() if scale.dim() == 2 else scale

    def _scaled_mm(self, a, a_scale, b, b_scale, b_recipe, out_dtype):
        rows = a.shape[0]
        if rows % _ROW_MULTIPLE:  # pad with zero rows (scale 1), which add nothing, and drop them
            pad = _ROW_MULTIPLE - rows % _ROW_MULTIPLE
            a = torch.cat([a.view(torch.uint8), a.new_zeros(pad, a.shape[1], dtype=torch.uint8)]).view(a.dtype)
            a_scale = torch.cat([a_scale, a_scale.new_ones(pad, a_scale.shape[1])])
            return self._scaled_mm(a, a_scale, b, b_scale, b_recipe, out_dtype)[:rows]
        return F.scaled_mm(a, b.t(), mn_major(a_scale), F.ScalingType.BlockWise1x128, b_scale, b_recipe,
                           output_dtype=out_dtype)

    def gemm_1x128_128x128(self, a, a_scale, b, b_scale, out_dtype):
        return self._scaled_mm(a, a_scale, b, b_scale, F.ScalingType.BlockWise128x128, out_dtype)

    def gemm_1x128_1x128(self, a, a_scale, b, b_scale, out_dtype):
        self._x_in_blocks(b, b_scale)
        return self._scaled_mm(a, a_scale, b, mn_major(b_scale), F.ScalingType.BlockWise1x128, out_dtype)

    def gemm_1x128_1x128_accumulate_(self, out, a, a_scale, b, b_scale):
        self._x_in_blocks(b, b_scale)
        from megafp8.precision.kernels import cublaslt
        if cublaslt.cached_unavailable_reason(out.device) is None:
            try:
                cublaslt.gemm_accumulate_(out, a, mn_major(a_scale), b, mn_major(b_scale))
                return
            except ValueError:  # a shape or alignment cuBLASLt does not take: the GEMM, then the add
                pass
        super().gemm_1x128_1x128_accumulate_(out, a, a_scale, b, b_scale)
