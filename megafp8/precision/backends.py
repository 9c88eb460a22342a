"""FP8 GEMM backends behind one narrow seam, and their selection.

Every FP8 GEMM of the linear layer is written as `out = A @ B^T` with both operands laid out
contraction-dim-contiguous ("TN", what FP8 tensor cores take):

    fprop  y  = x    @ w^T : A = x (M, K) 1x128 tiles,     B = w   (N, K) 128x128 blocks
    dgrad  dx = dy   @ w   : A = dy (M, N) 1x128 tiles,    B = w^T (K, N) 128x128 blocks
    wgrad  dw = dy^T @ x   : A = dy^T (N, M) 1x128 tiles,  B = x^T (K, M) 1x128 tiles

A backend supplies the quantizers and that one GEMM:
- `reference`: any device. The pure-torch quantizers, then dequantize and multiply in FP32.
- `cublas`: SM90 GPUs. `torch.nn.functional.scaled_mm` with BlockWise1x128 / BlockWise128x128
  scaling (cuBLASLt), fed by the Triton quantizers (scales written in cuBLAS's layout).
- `triton`: CUDA GPUs with Triton. The Triton quantizers and our own blockwise-scaled GEMM.
`auto` picks `cublas` where it can run, else `triton`, else `reference`.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F

from megafp8.precision import quantize as ref
from megafp8.precision.formats import TILE, Fp8Format

BACKENDS = ("auto", "reference", "cublas", "triton")


class Fp8Backend:
    """Reference semantics; subclasses replace the pieces they run faster."""

    name = "reference"

    def quantize_tiles(self, x: torch.Tensor, fmt: Fp8Format, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, K) -> 1x128 tiles along K."""
        return ref.quantize_1x128(x, fmt, pow2)

    def quantize_tiles_transposed(self, x: torch.Tensor, fmt: Fp8Format, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, K) -> x^T (K, M) in 1x128 tiles along M."""
        return ref.quantize_1x128_transposed(x, fmt, pow2)

    def quantize_tiles_both(self, x: torch.Tensor, fmt: Fp8Format, pow2: bool) -> tuple[torch.Tensor, ...]:
        """x (M, K) -> (1x128 tiles along K, scales; x^T (K, M_pad) in 1x128 tiles along M, scales), M_pad = M
        rounded up to 128 with zero rows: the output gradient's two quantizations (dgrad and wgrad)."""
        q, s = self.quantize_tiles(x, fmt, pow2)
        return (q, s, *self.quantize_tiles_transposed(ref.pad_rows(x, -x.shape[0] % TILE, 0.0), fmt, pow2))

    def retile_transposed(self, q: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
                          pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 x (M, K) in 1x128 tiles along K -> x^T (K, M) in 1x128 tiles along M."""
        return ref.retile_1x128_transposed(q, scale, fmt, pow2)

    def quantize_blocks(self, w: torch.Tensor, fmt: Fp8Format, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """w (N, K) -> (w_fp8 (N, K), scales (N/128, K/128)) in 128x128 blocks."""
        return ref.quantize_128x128(w, fmt, pow2)

    def quantize_blocks_with_transpose(self, w: torch.Tensor, fmt: Fp8Format, pow2: bool) -> tuple[torch.Tensor, ...]:
        """w (N, K) -> (w_fp8 (N, K), scales (N/128, K/128), w^T fp8 (K, N), scales^T (K/128, N/128)).

        128x128 blocks are transpose-invariant: w^T's quantization is w's, transposed."""
        q, s = ref.quantize_128x128(w, fmt, pow2)
        return q, s, q.t().contiguous(), s.t().contiguous()

    def block_scales_for_gemm(self, scale: torch.Tensor) -> torch.Tensor:
        """A weight's (N/128, K/128) block scales in the layout this backend's GEMM reads (made once per step)."""
        return scale

    def gemm(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             b_blockwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
        """A (M, K) @ B (N, K)^T; A in 1x128 tiles, B in 128x128 blocks (b_blockwise: scales from
        `block_scales_for_gemm`) or 1x128 tiles."""
        a32 = ref.dequantize_1x128(a, a_scale)
        b32 = ref.dequantize_128x128(b, b_scale) if b_blockwise else ref.dequantize_1x128(b, b_scale)
        return (a32 @ b32.t()).to(out_dtype)

    def grouped_gemm(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     rows, out_dtype: torch.dtype) -> torch.Tensor:
        """Per expert e: A[rows of e] @ B[e]^T. A (Mp, K) in 1x128 tiles, rows laid out by `rows`
        (`megafp8.precision.grouped.ExpertRows`); B (E, N, K) in 128x128 blocks, scales (E, N/128, K/128)."""
        out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
        for e, lo, hi in rows.segments:
            out[lo:hi] = self.gemm(a[lo:hi], a_scale[lo:hi], b[e], self.block_scales_for_gemm(b_scale[e]), True,
                                   out_dtype)
        return out

    def grouped_wgrad(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                      rows, num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
        """Per expert e: A[:, rows of e] @ B[:, rows of e]^T -> (E, N, K). A (N, Mp) and B (K, Mp) in 1x128
        tiles along the padded rows."""
        out = torch.zeros(num_experts, a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
        for e, lo, hi in rows.segments:
            t0, t1 = lo // 128, hi // 128
            out[e] = self.gemm(a[:, lo:hi].contiguous(), a_scale[:, t0:t1], b[:, lo:hi].contiguous(),
                               b_scale[:, t0:t1], False, out_dtype)
        return out


class TritonBackend(Fp8Backend):
    name = "triton"

    def __init__(self) -> None:
        from megafp8.precision import triton_kernels

        self.kernels = triton_kernels

    def quantize_tiles(self, x, fmt, pow2):
        return self.kernels.quantize_rows(x, fmt, pow2)

    def quantize_tiles_transposed(self, x, fmt, pow2):
        return self.kernels.quantize_cols(x, fmt, pow2)

    def retile_transposed(self, q, scale, fmt, pow2):
        return self.kernels.quantize_cols(q, fmt, pow2, in_scale=scale)

    # quantize_tiles_both: the base class's two kernels (rows, then columns), not the fused `quantize_both` kernel.
    # Profiles of the compiled ~1B FP8 step on the H200 put the fused kernel at 23.5-25.3 ms per step (commits
    # 9ca829b, 1d01d8a) against ~18 ms for the output gradient's share of the separate kernels (commit 1336a3e):
    # it saves a read of dy but is arithmetic-bound at ~1 TB/s. benchmarks/fused_quantize.py times both.

    def quantize_blocks(self, w, fmt, pow2):
        return self.kernels.quantize_blocks(w, fmt, pow2, transpose=False)

    def quantize_blocks_with_transpose(self, w, fmt, pow2):
        return self.kernels.quantize_blocks(w, fmt, pow2)

    def gemm(self, a, a_scale, b, b_scale, b_blockwise, out_dtype):
        return self.kernels.gemm(a, a_scale, b, b_scale, b_blockwise, out_dtype)

    def grouped_gemm(self, a, a_scale, b, b_scale, rows, out_dtype):
        if a.shape[0] == 0:
            return torch.zeros(0, b.shape[1], dtype=out_dtype, device=a.device)
        return self.kernels.grouped_gemm(a, a_scale, b, b_scale, rows.tile_expert, out_dtype)

    def grouped_wgrad(self, a, a_scale, b, b_scale, rows, num_experts, out_dtype):
        if a.shape[1] == 0:
            return torch.zeros(num_experts, a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
        return self.kernels.grouped_wgrad(a, a_scale, b, b_scale, rows.tile_start, rows.tile_count, out_dtype)


def _mn_major(scale: torch.Tensor) -> torch.Tensor:
    """The same (rows, K/128) scales stored column-major (stride (1, rows)), the layout cuBLAS reads
    (a row slice of such a tensor keeps the parent's row stride, so it is copied too)."""
    if scale.stride(0) == 1 and scale.stride(1) == scale.shape[0]:  # checked strictly, even for one column
        return scale
    return scale.t().contiguous().t()


_CUBLAS_ROW_MULTIPLE = 4


class CublasBackend(TritonBackend):
    name = "cublas"

    def block_scales_for_gemm(self, scale):
        # cuBLAS reads (K/128, N/128) block scales K-major, with K/128 padded to a multiple of 4.
        n_blocks, k_blocks = scale.shape
        padded = torch.zeros(n_blocks, -(-k_blocks // 4) * 4, dtype=torch.float32, device=scale.device)
        padded[:, :k_blocks] = scale
        return padded.t()

    def gemm(self, a, a_scale, b, b_scale, b_blockwise, out_dtype):
        rows = a.shape[0]
        if rows % _CUBLAS_ROW_MULTIPLE:
            # cuBLASLt rejects (CUBLAS_STATUS_NOT_SUPPORTED) 1x128-scaled operands whose row count is not a multiple
            # of 4 (measured on H200, M = 1..129): pad with zero rows (scale 1), which add nothing, and drop them.
            pad = _CUBLAS_ROW_MULTIPLE - rows % _CUBLAS_ROW_MULTIPLE
            zeros = torch.zeros(pad, a.shape[1], dtype=torch.uint8, device=a.device)
            a = torch.cat([a.view(torch.uint8), zeros]).view(a.dtype)
            a_scale = torch.cat([a_scale, a_scale.new_ones(pad, a_scale.shape[1])])
            return self.gemm(a, a_scale, b, b_scale, b_blockwise, out_dtype)[:rows]
        if b_blockwise:
            b_s, recipe_b = b_scale, F.ScalingType.BlockWise128x128
        else:
            b_s, recipe_b = _mn_major(b_scale), F.ScalingType.BlockWise1x128
        return F.scaled_mm(a, b.t(), _mn_major(a_scale), F.ScalingType.BlockWise1x128, b_s, recipe_b,
                           output_dtype=out_dtype)


def _cuda_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)


def why_unavailable(name: str, device: torch.device) -> Optional[str]:
    """None if backend `name` can run on `device`, else the reason."""
    if name == "reference":
        return None
    if device.type != "cuda":
        return f"the {name} backend needs a CUDA GPU, but this run is on {device.type}"
    if importlib.util.find_spec("triton") is None:
        return f"the {name} backend needs Triton (pip install triton)"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"the {name} backend needs FP8 tensor cores (compute capability 8.9 or newer)"
    if name == "cublas":
        if not _cuda_sm90(device):
            return "the cublas backend needs an SM90 (Hopper) GPU for blockwise-scaled FP8 GEMMs"
        if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
            return f"the cublas backend needs torch.nn.functional.scaled_mm (torch {torch.__version__} lacks it)"
    return None


_CLASSES = {"reference": Fp8Backend, "triton": TritonBackend, "cublas": CublasBackend}


def backend_by_name(name: str) -> Fp8Backend:
    """A new backend object of the concrete backend `name` (`reference`, `cublas` or `triton`), unchecked: for code
    that runs a backend `select_backend` already chose (the traced FP8 ops carry its name, not the object)."""
    return _CLASSES[name]()


def select_backend(name: str, device: torch.device) -> Fp8Backend:
    """The backend `name` for `device` (`auto`: the fastest that can run); an error says why one cannot."""
    if name not in BACKENDS:
        raise ValueError(f"unknown FP8 backend '{name}'; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = next(n for n in ("cublas", "triton", "reference") if why_unavailable(n, device) is None)
    reason = why_unavailable(name, device)
    if reason is not None:
        raise RuntimeError(f"{reason}: set precision.fp8_backend=auto or reference")
    return backend_by_name(name)
