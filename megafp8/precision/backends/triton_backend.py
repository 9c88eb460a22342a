"""The `triton` backend (CUDA GPUs with FP8 tensor cores): our Triton quantizers, fused producers and GEMMs."""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from megafp8.precision import quantize as ref
from megafp8.precision.backends.reference import Fp8Backend, QuantizedWeight, StaleExperts
from megafp8.precision.formats import Fp8Format
from megafp8.precision.producers import rope_backward_fusable


def cuda_fp8_unavailable_reason(name: str, device: torch.device) -> Optional[str]:
    """Why backend `name` (Triton kernels on FP8 tensor cores) cannot run on `device`, or None."""
    if device.type != "cuda":
        return f"the {name} backend needs a CUDA GPU, but this run is on {device.type}"
    if importlib.util.find_spec("triton") is None:
        return f"the {name} backend needs Triton (pip install triton)"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"the {name} backend needs FP8 tensor cores (compute capability 8.9 or newer)"
    return None


class TritonBackend(Fp8Backend):
    """Triton kernels for everything: quantizers (bit-exact with the reference), fused producers, and blockwise
    GEMMs (the dense one at about two thirds of cuBLAS; kept for GEMMs cuBLAS does not take and as a check)."""

    name = "triton"
    priority = 1
    grouped_kernel: Optional[str] = None  # the grouped GEMMs' kernel (`megafp8.precision.kernels.gemm`); None: default
    grouped_interleave_ffma = False  # the warp-specialized grouped fprop and dgrad's FFMAs interleaved (`ws_gemm`)
    wgrad_input_blocks = False  # its wgrad GEMMs read x^T in 1x128 tiles only (the hopper backend: blocks too)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        return cuda_fp8_unavailable_reason(cls.name, device)

    def __init__(self) -> None:
        # Imported here: CPU-only installs never need Triton.
        from megafp8.precision.kernels import gemm, health, producers, quantize

        self.quantizers, self.producers, self.gemms, self.health = quantize, producers, gemm, health

    def quantize_rows(self, x, fmt, power_of_two):
        return self.quantizers.quantize_rows(x, fmt, power_of_two)

    def quantize_rows_cols(self, x, fmt, power_of_two, cols_in_blocks=False):
        return self.quantizers.quantize_rows_cols(x, fmt, power_of_two, cols_in_blocks)

    def gather_quantize_rows_cols(self, source, index, fmt, power_of_two, cols_in_blocks=False):
        return self.quantizers.gather_quantize_rows_cols(source, index, fmt, power_of_two, cols_in_blocks)

    def gather_scale_quantize_rows_cols(self, source, index, factor, fmt, power_of_two):
        return self.quantizers.gather_scale_quantize_rows_cols(source, index, factor, fmt, power_of_two)

    def rmsnorm_quantize(self, h, weight, eps, fmt, power_of_two, cols_in_blocks=False):
        return self.producers.rmsnorm_quantize(h, weight, eps, fmt, power_of_two, cols_in_blocks)

    def swiglu_quantize(self, gu, fmt, power_of_two, row_amax=False):
        return self.producers.swiglu_quantize(gu, fmt, power_of_two, row_amax)

    def swiglu_backward_quantize(self, gu, da, fmt, grad_fmt, power_of_two, a_amax=None):
        return self.producers.swiglu_backward_quantize(gu, da, fmt, grad_fmt, power_of_two, a_amax)

    def health_sums(self, x2d, fmt, blocks, power_of_two):
        return self.health.health_sums(x2d, fmt, blocks, power_of_two)

    def rope_backward_quantize(self, dq, dk, dv, cos, sin, seq_len, head_dim, fmt, power_of_two):
        if not rope_backward_fusable((dq.shape[1], dk.shape[1], dv.shape[1]), head_dim):
            return super().rope_backward_quantize(dq, dk, dv, cos, sin, seq_len, head_dim, fmt, power_of_two)
        dq, dk, dv = (t if t.stride(1) == 1 else t.contiguous() for t in (dq, dk, dv))
        return self.producers.rope_backward_quantize(dq, dk, dv, cos, sin, seq_len, head_dim, fmt, power_of_two)

    def quantize_weight_(self, w: torch.Tensor, out: QuantizedWeight, fmt: Fp8Format, power_of_two: bool,
                         stale: Optional[StaleExperts] = None) -> None:
        kept = out.wt_fp8 is not None
        self.quantizers.quantize_weight_(w, out.w_fp8, self.block_scales_nk(out.w_scale), out.wt_fp8 if kept else None,
                                         self.block_scales_nk(out.wt_scale) if kept else None, fmt, power_of_two,
                                         None if stale is None else (stale.version, stale.current, stale.used))

    def _transpose_into(self, w: QuantizedWeight, out: QuantizedWeight,
                        experts_used: Optional[torch.Tensor] = None) -> None:
        self.quantizers.transpose_blocks(w.w_fp8, self.block_scales_nk(w.w_scale), out.w_fp8,
                                         self.block_scales_nk(out.w_scale), experts_used)

    def gemm_1x128_128x128(self, a, a_scale, b, b_scale, out_dtype):
        return self.gemms.gemm(a, a_scale, b, b_scale, True, out_dtype)

    def gemm_1x128_1x128(self, a, a_scale, b, b_scale, out_dtype):
        self._x_in_blocks(b, b_scale)
        return self.gemms.gemm(a, a_scale, b, b_scale, False, out_dtype)

    def _x_in_blocks(self, b, b_scale) -> bool:
        """Whether a wgrad's B (x^T) comes in 128x128 blocks (`Fp8Recipe.wgrad_input_blocks`, told by its scales'
        shape); refused by a backend whose wgrad GEMMs read 1x128 tiles only (`wgrad_input_blocks` false)."""
        blocks = ref.scales_in_blocks(b, b_scale)
        if blocks and not self.wgrad_input_blocks:
            raise ValueError(f"the {self.name} backend's weight-gradient GEMMs read x^T in 1x128 tiles only; "
                             "precision.fp8_wgrad_input_blocks needs the hopper backend (SM90) or reference")
        return blocks

    def grouped_gemm_1x128_128x128(self, a, a_scale, w, transposed, rows, out_dtype):
        b, b_scale = self.weight_transposed(w, rows.tile_count) if transposed else (w.w_fp8, w.w_scale)
        if a.shape[0] == 0:
            return torch.zeros(0, b.shape[1], dtype=out_dtype, device=a.device)
        return self.gemms.grouped_gemm(a, a_scale, b, b_scale, rows.tile_expert, out_dtype, kernel=self.grouped_kernel,
                                       interleave_ffma=self.grouped_interleave_ffma)

    def grouped_gemm_1x128_1x128(self, a, a_scale, b, b_scale, rows, num_experts, out_dtype, accumulate=None):
        b_blocks = self._x_in_blocks(b, b_scale)
        if a.shape[1] == 0:
            if accumulate is not None:
                return accumulate
            return torch.zeros(num_experts, a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
        return self.gemms.grouped_wgrad(a, a_scale, b, b_scale, rows.tile_start, rows.tile_count, out_dtype,
                                        kernel=self.grouped_kernel, accumulate=accumulate,
                                        b_blocks=b_blocks)
