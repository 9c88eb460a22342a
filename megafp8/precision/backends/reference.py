"""The reference FP8 backend: the definition of every FP8 operation, in plain torch, on any device.

Every FP8 GEMM is written `out = A @ B^T` with both operands contiguous along the contraction dim ("TN", what
FP8 tensor cores take):

    fprop  y  = x    @ w^T : A = x (M, K) 1x128 tiles,     B = w   (N, K) 128x128 blocks  gemm_1x128_128x128
    dgrad  dx = dy   @ w   : A = dy (M, N) 1x128 tiles,    B = w^T (K, N) 128x128 blocks  gemm_1x128_128x128
    wgrad  dw = dy^T @ x   : A = dy^T (N, M) 1x128 tiles,  B = x^T (K, M) 1x128 tiles     gemm_1x128_1x128

A backend supplies the quantizers (plain, and fused into their producers: `megafp8.precision.producers`) and these
GEMMs. This class is the reference every other backend is tested against: it really casts to FP8, then
dequantizes and multiplies in FP32. Subclasses replace the pieces they run faster and register in
`megafp8.precision.backends`.

Shared conventions: activation scales come back column-major (stride (1, rows)); a weight is quantized into a
`QuantizedWeight` whose tensors the backend allocated (`empty_weight`) in the layout its GEMM reads, in place, so
their addresses never change (compiled code and CUDA graphs read them as fixed inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from megafp8.precision import health, producers
from megafp8.precision import quantize as ref
from megafp8.precision.formats import FORMATS, TILE, Fp8Format


@dataclass
class QuantizedWeight:
    """A weight (N, K) (or stacked experts (E, N, K)) in 128x128 blocks, and its transpose for dgrad: 128x128
    blocks are transpose-invariant, so w^T holds the same FP8 values and scales, transposed. Scales are in the
    layout the backend's GEMM reads. A weight quantized without its transpose (`wt_fp8` None) has it made when a
    GEMM needs it (`Fp8Backend.weight_transposed`), for that GEMM only."""

    w_fp8: torch.Tensor  # (N, K)
    w_scale: torch.Tensor  # (N/128, K/128) blocks, in the GEMM's layout
    wt_fp8: Optional[torch.Tensor]  # (K, N), or None: not kept
    wt_scale: Optional[torch.Tensor]  # (K/128, N/128) blocks, in the GEMM's layout, or None

    def tensors(self) -> tuple[Optional[torch.Tensor], ...]:
        return self.w_fp8, self.w_scale, self.wt_fp8, self.wt_scale


@dataclass
class StaleExperts:
    """Which stacked experts' FP8 weights to (re)quantize, decided on the device: those whose `version` (E,) int64
    is not `current` (1,) int64 and, where `used` (E,) is given, whose entry there is nonzero (an expert with rows
    in this micro-batch's layout). The rest keep their bytes: no GEMM of this micro-batch reads them."""

    version: torch.Tensor
    current: torch.Tensor
    used: Optional[torch.Tensor] = None

    def chosen(self) -> torch.Tensor:
        """(E,) bool: the experts to quantize."""
        stale = self.version != self.current
        return stale if self.used is None else stale & (self.used != 0)

    def pick(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """`new` for the chosen experts (the leading dimension), `old` for the others."""
        return torch.where(self.chosen().view(-1, *([1] * (new.dim() - 1))), new, old)

    def mark_current(self) -> None:
        """The chosen experts' versions set to current (after their quantization, in stream order)."""
        self.version.copy_(torch.where(self.chosen(), self.current, self.version))


def _format_of(t: torch.Tensor) -> Fp8Format:
    """The FP8 format whose dtype `t` has."""
    return next(fmt for fmt in FORMATS.values() if fmt.dtype == t.dtype)


def _transposed_fp8(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's last two dims swapped, contiguous (copied as bytes: not every device copies FP8)."""
    return t.view(torch.uint8).transpose(-2, -1).contiguous().view(t.dtype)


class Fp8Backend:
    """The reference backend (see the module docstring); the base class of every backend."""

    name: ClassVar[str] = "reference"
    priority: ClassVar[int] = 0  # `auto` picks the available backend of highest priority
    # Whether the backend takes the weight gradient's input x in 128x128 blocks (`Fp8Recipe.wgrad_input_blocks`): its
    # row + column quantizers write them and its wgrad GEMMs read them.
    wgrad_input_blocks: ClassVar[bool] = True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        """None if this backend can run on `device`, else why not."""
        return None

    # ------------------------------------------------------------------ activations and gradients

    def quantize_rows(self, x: torch.Tensor, fmt: Fp8Format, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, K) -> (x_fp8 (M, K), scales (M, K/128)) in 1x128 tiles along K."""
        q, s = ref.quantize_1x128(x, fmt, power_of_two)
        return q, ref.mn_major(s)

    def quantize_rows_cols(self, x: torch.Tensor, fmt: Fp8Format, power_of_two: bool,
                           cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
        """x (M, K) -> (x_fp8, scales, xt_fp8 (K, M_pad), scales_t): `quantize.quantize_rows_cols` (x^T in 128x128
        blocks with `cols_in_blocks`)."""
        return ref.quantize_rows_cols(x, fmt, power_of_two, cols_in_blocks)

    def gather_quantize_rows_cols(self, source: torch.Tensor, index: torch.Tensor, fmt: Fp8Format,
                                  power_of_two: bool, cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
        """`quantize_rows_cols` of x (M, K), x[i] = source[index[i]] (index (M,); a zero row where index[i] < 0)."""
        gathered = source.index_select(0, index.clamp(min=0))
        x = torch.where((index >= 0).unsqueeze(1), gathered, torch.zeros((), dtype=source.dtype, device=source.device))
        return self.quantize_rows_cols(x, fmt, power_of_two, cols_in_blocks)

    def gather_scale_quantize_rows_cols(self, source: torch.Tensor, index: torch.Tensor, factor: torch.Tensor,
                                        fmt: Fp8Format, power_of_two: bool) -> tuple[torch.Tensor, ...]:
        """`quantize_rows_cols` of x (M, K), x[i] = factor[i] * source[index[i]] computed in FP32 and quantized from
        FP32 (a fused producer: a zero row where index[i] < 0); factor (M,) FP32."""
        gathered = source.index_select(0, index.clamp(min=0)).to(torch.float32) * factor.to(torch.float32)[:, None]
        x = torch.where((index >= 0).unsqueeze(1), gathered, torch.zeros((), dtype=torch.float32,
                                                                         device=source.device))
        return ref.quantize_rows_cols(x, fmt, power_of_two)

    def rmsnorm_quantize(self, h: torch.Tensor, weight: torch.Tensor, eps: float, fmt: Fp8Format,
                         power_of_two: bool, cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
        """RMSNorm quantized from FP32: `producers.rmsnorm_quantize` (the last output is rstd (M,))."""
        return producers.rmsnorm_quantize(h, weight, eps, fmt, power_of_two, cols_in_blocks=cols_in_blocks)

    def swiglu_quantize(self, gu: torch.Tensor, fmt: Fp8Format, power_of_two: bool,
                        row_amax: bool = False) -> tuple[torch.Tensor, ...]:
        """silu(gate) * up quantized from FP32 along its features, and with `row_amax` each tile's max |a| (for a^T
        in blocks in the backward): `producers.swiglu_quantize`."""
        return producers.swiglu_quantize(gu, fmt, power_of_two, row_amax)

    def swiglu_backward_quantize(self, gu: torch.Tensor, da: torch.Tensor, fmt: Fp8Format, grad_fmt: Fp8Format,
                                 power_of_two: bool, a_amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """SwiGLU's input gradient quantized from FP32, and its output's transpose (in 128x128 blocks given the
        forward's tile maxima `a_amax`): `producers.swiglu_backward_quantize`."""
        return producers.swiglu_backward_quantize(gu, da, fmt, grad_fmt, power_of_two, a_amax)

    def rope_backward_quantize(self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, seq_len: int, head_dim: int, fmt: Fp8Format,
                               power_of_two: bool) -> tuple[torch.Tensor, ...]:
        """The QKV projection's output gradient through RoPE's backward, quantized from FP32 both ways:
        `producers.rope_backward_quantize`."""
        return producers.rope_backward_quantize(dq, dk, dv, cos, sin, seq_len, head_dim, fmt, power_of_two)

    def health_sums(self, x2d: torch.Tensor, fmt: Fp8Format, blocks: bool,
                    power_of_two: bool) -> dict[str, torch.Tensor]:
        """The FP8 health monitor's sums over x2d (M, K) quantized in 1x128 tiles (or 128x128 `blocks`):
        `health.chunk_sums`, the definition."""
        return health.chunk_sums(x2d, fmt, blocks, power_of_two)

    # ------------------------------------------------------------------ weights

    def empty_weight(self, shape: torch.Size, fmt: Fp8Format, device: torch.device,
                     transpose: bool = True) -> QuantizedWeight:
        """Tensors for a weight of `shape` (N, K) or (E, N, K), to be filled by `quantize_weight_`; without its
        transpose if not `transpose`."""
        *lead, n, k = shape
        return QuantizedWeight(
            torch.empty(*lead, n, k, dtype=fmt.dtype, device=device),
            torch.empty(*lead, n // TILE, k // TILE, dtype=torch.float32, device=device),
            torch.empty(*lead, k, n, dtype=fmt.dtype, device=device) if transpose else None,
            torch.empty(*lead, k // TILE, n // TILE, dtype=torch.float32, device=device) if transpose else None)

    def block_scales_nk(self, scale: torch.Tensor) -> torch.Tensor:
        """A weight's block scales, as stored by `empty_weight`, viewed as [..., n block, k block] (a view: writing
        through it fills the GEMM's layout)."""
        return scale

    def quantize_weight_(self, w: torch.Tensor, out: QuantizedWeight, fmt: Fp8Format, power_of_two: bool,
                         stale: Optional[StaleExperts] = None) -> None:
        """Quantize w (N, K) or (E, N, K) in 128x128 blocks into `out` (from `empty_weight`), in place. With `stale`
        (stacked experts), only the experts it names are quantized, on the device, and marked current."""
        *lead, n, k = w.shape
        q, s = ref.quantize_128x128(w.reshape(-1, k), fmt, power_of_two)
        q, s = q.view(*lead, n, k), s.view(*lead, n // TILE, k // TILE)
        pick = (lambda new, old: new) if stale is None else stale.pick  # noqa: E731
        if stale is not None:
            # Written as the GPU kernels write (autograd's version counters untouched): a backward still pending
            # (a pipeline's micro-batches in flight) saved this cache and reads only experts that are current
            # already, which stay as they are; a version bump would refuse that backward.
            out = QuantizedWeight(*(t.data if t is not None else None for t in out.tensors()))
        with torch.no_grad():
            out.w_fp8.view(torch.uint8).copy_(pick(q.view(torch.uint8), out.w_fp8.view(torch.uint8)))
            self.block_scales_nk(out.w_scale).copy_(pick(s, self.block_scales_nk(out.w_scale)))
            if out.wt_fp8 is not None:
                out.wt_fp8.view(torch.uint8).copy_(pick(_transposed_fp8(q).view(torch.uint8),
                                                        out.wt_fp8.view(torch.uint8)))
                self.block_scales_nk(out.wt_scale).copy_(pick(s.transpose(-2, -1),
                                                              self.block_scales_nk(out.wt_scale)))
            if stale is not None:
                stale.mark_current()

    def weight_transposed(self, w: QuantizedWeight, experts_used: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w^T FP8, its block scales in the GEMM's layout): the kept transpose, or one made now from w's FP8
        values (the same bits: 128x128 blocks are transpose-invariant) for the caller's GEMM only.

        `experts_used` (E,) on the device, for stacked expert weights made now: a backend may leave the part of an
        expert whose entry is 0 unwritten (a grouped GEMM reads no expert without rows); the MoE benchmark's
        collapsed routing leaves most experts without rows."""
        if w.wt_fp8 is not None:
            return w.wt_fp8, w.wt_scale
        *lead, n, k = w.w_fp8.shape
        out = self.empty_weight(torch.Size((*lead, k, n)), _format_of(w.w_fp8), w.w_fp8.device, transpose=False)
        self._transpose_into(w, out, experts_used)
        return out.w_fp8, out.w_scale

    def transpose_weight(self, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                         experts_used: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w^T FP8, its block scales in the GEMM's layout), made now from w's FP8 values and block scales: what a
        layer that keeps no transpose (`Fp8Recipe.keep_weight_transpose` false) hands its dgrad GEMM
        (`experts_used` as in `weight_transposed`)."""
        return self.weight_transposed(QuantizedWeight(w_fp8, w_scale, None, None), experts_used)

    def _transpose_into(self, w: QuantizedWeight, out: QuantizedWeight,
                        experts_used: Optional[torch.Tensor] = None) -> None:
        """out.w_fp8, out.w_scale = w's FP8 values and block scales, transposed (the definition transposes every
        expert, whatever `experts_used` says)."""
        with torch.no_grad():
            out.w_fp8.view(torch.uint8).copy_(_transposed_fp8(w.w_fp8).view(torch.uint8))
            self.block_scales_nk(out.w_scale).copy_(self.block_scales_nk(w.w_scale).transpose(-2, -1))

    # ------------------------------------------------------------------ GEMMs

    def gemm_1x128_128x128(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
        """A (M, K) in 1x128 tiles @ B (N, K)^T in 128x128 blocks (B and its scales from a `QuantizedWeight`)."""
        a32 = ref.dequantize_1x128(a, a_scale)
        return (a32 @ ref.dequantize_128x128(b, b_scale).t()).to(out_dtype)

    def gemm_1x128_1x128(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
        """A (M, K) @ B (N, K)^T, both in 1x128 tiles along K (the weight gradient's GEMM; B, the input x^T, in
        128x128 blocks where its scales say so: `quantize.scales_in_blocks`)."""
        return (ref.dequantize_1x128(a, a_scale) @ ref.dequantize_along_tokens(b, b_scale).t()).to(out_dtype)

    def gemm_1x128_1x128_accumulate_(self, out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor,
                                     b: torch.Tensor, b_scale: torch.Tensor) -> None:
        """out (M, N) FP32 += A @ B^T as `gemm_1x128_1x128` computes it, added in FP32 (never rounded to BF16):
        a weight gradient accumulated into its `main_grad`. Backends whose GEMM adds in its epilogue override it."""
        out.add_(self.gemm_1x128_1x128(a, a_scale, b, b_scale, torch.float32))

    def grouped_gemm_1x128_128x128(self, a: torch.Tensor, a_scale: torch.Tensor, w: QuantizedWeight, transposed: bool,
                                   rows, out_dtype: torch.dtype) -> torch.Tensor:
        """Per expert e: A[rows of e] @ B[e]^T, with B = w (E, N, K) or, `transposed`, w^T (E, K, N). A in 1x128
        tiles, rows laid out by `rows` (`megafp8.precision.expert_layout.ExpertRows`)."""
        b, b_scale = self.weight_transposed(w, rows.tile_count) if transposed else (w.w_fp8, w.w_scale)
        out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
        # The reference GEMMs by name: expert weights keep plain (E, N/128, K/128) scales on every backend, which a
        # subclass's own dense GEMM may not read.
        for e, lo, hi in rows.segments:
            out[lo:hi] = Fp8Backend.gemm_1x128_128x128(self, a[lo:hi], a_scale[lo:hi], b[e], b_scale[e], out_dtype)
        return out

    def grouped_gemm_1x128_1x128(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                                 b_scale: torch.Tensor, rows, num_experts: int, out_dtype: torch.dtype,
                                 accumulate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per expert e: A[:, rows of e] @ B[:, rows of e]^T -> (E, N, K). A (N, Mp) and B (K, Mp) in 1x128 tiles
        along the padded rows (the experts' weight gradients). `accumulate` (E, N, K) FP32: the FP32 product is
        added into it (never rounded to `out_dtype`), which is returned."""
        out = torch.zeros(num_experts, a.shape[0], b.shape[0], dtype=out_dtype if accumulate is None
                          else torch.float32, device=a.device)
        for e, lo, hi in rows.segments:  # (B's scales, per 1x128 tile or per block, are per 128 rows either way)
            t0, t1 = lo // TILE, hi // TILE
            out[e] = Fp8Backend.gemm_1x128_1x128(self, a[:, lo:hi].contiguous(), a_scale[:, t0:t1],
                                                 b[:, lo:hi].contiguous(), b_scale[:, t0:t1], out.dtype)
        return out if accumulate is None else accumulate.add_(out)
