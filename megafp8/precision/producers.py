"""Producers that quantize their own FP32 result: the pure-torch definitions (twins) of the fused kernels.

An FP8 GEMM's input is usually made by an element-wise producer: RMSNorm before the QKV and gate/up projections,
SwiGLU before the down projection, and SwiGLU's backward before the gate/up projection's dgrad and wgrad. A fused
kernel computes the producer in FP32 and quantizes that FP32 result directly, in both layouts the GEMMs need (see
`quantize.quantize_rows_cols`), so the BF16 tensor between the two is never written or read. The functions here
are the definitions those kernels are tested against (`../shared/DESIGN.md`, section 3): the producer computed
in FP32 as written below, then the reference quantizer. A kernel's own FP32 arithmetic may differ from torch's in
the last bits (its exp, its summation order); its FP8 values stay within one E4M3 ULP of these and its scales
within a few FP32 ULPs. They run on any device: the reference backend uses them for its fused producers.

Layout of the SwiGLU input: `gu` (M, 2F) holds [gate | up] along the features (the fused gate/up projection's
output, per tensor-parallel rank), so both halves' 1x128 tiles are whole.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megafp8.precision.formats import Fp8Format
from megafp8.precision.quantize import mn_major, quantize_1x128, quantize_rows_cols


def rms_inverse(h: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(h^2) + eps) per row, in FP32: (M, K) -> (M,)."""
    h32 = h.float()
    return torch.rsqrt(h32.square().mean(dim=-1) + eps)


def rmsnorm_quantize(h: torch.Tensor, weight: torch.Tensor, eps: float, fmt: Fp8Format, power_of_two: bool,
                     rstd: Optional[torch.Tensor] = None, cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
    """RMSNorm of h (M, K) with `weight` (K,), quantized from FP32: (x_fp8, scales, xt_fp8, scales_t, rstd), x^T
    in 128x128 blocks with `cols_in_blocks` (`quantize_rows_cols`).

    The normalized row is (h * rstd) * weight in FP32, in that order (F.rms_norm's). `rstd` (M,), if given,
    replaces the computed one: a test passes a kernel's own rstd to check the rest of its arithmetic bit for bit."""
    if rstd is None:
        rstd = rms_inverse(h, eps)
    y32 = h.float() * rstd.unsqueeze(-1) * weight.float()
    return (*quantize_rows_cols(y32, fmt, power_of_two, cols_in_blocks), rstd)


def rmsnorm_backward(h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                     dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of y = h * rstd * weight (rstd = rms_inverse(h)) given dy (M, K): (dh in h's dtype, dweight in
    FP32). Plain torch ops, so a compiled block fuses them with what surrounds them."""
    h32, dy32, r = h.float(), dy.float(), rstd.unsqueeze(-1)
    x_hat = h32 * r
    g = dy32 * weight.float()
    dh = r * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    return dh.to(h.dtype), (dy32 * x_hat).sum(dim=0)


def _gate_up(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gu.float().chunk(2, dim=-1)
    return gate, up


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in FP32: (M, 2F) -> (M, F)."""
    gate, up = _gate_up(gu)
    return F.silu(gate) * up


def swiglu_quantize(gu: torch.Tensor, fmt: Fp8Format, power_of_two: bool, row_amax: bool = False
                    ) -> tuple[torch.Tensor, ...]:
    """silu(gate) * up of gu (M, 2F), quantized from FP32 in 1x128 tiles along F: (a_fp8 (M, F), scales), the down
    projection's forward input. Its transpose for the weight gradient comes from `swiglu_backward_quantize`,
    which reads gu anyway: saving it from the forward would keep another byte per element for backward.

    `row_amax` (`Fp8Recipe.wgrad_input_blocks`) adds each 1x128 tile's max |a| (M, F/128) FP32, what the tiles'
    scales were made from: the backward takes a 128x128 block's max of a as the max of its 128 tokens' maxima."""
    a = swiglu(gu)
    q, s = quantize_1x128(a, fmt, power_of_two)
    if not row_amax:
        return q, mn_major(s)
    return q, mn_major(s), tile_maxima(a)


def tile_maxima(a: torch.Tensor) -> torch.Tensor:
    """max |a| over each 1x128 tile along the features (nan if the tile holds one): (M, F) -> (M, F/128) FP32,
    column-major as the tiles' scales (a kernel reads a block's 128 tokens as one run)."""
    m, f = a.shape
    return mn_major(a.float().abs().reshape(m, f // 128, 128).amax(dim=-1))


def swiglu_backward(gu: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """d(gu) (M, 2F) in FP32 given da = d(silu(gate) * up) (M, F): [da * up * silu'(gate) | da * silu(gate)],
    silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g)."""
    gate, up = _gate_up(gu)
    da32 = da.float()
    s = torch.sigmoid(gate)
    d_gate = da32 * up * (s * (1 + gate * (1 - s)))
    d_up = da32 * (gate * s)
    return torch.cat([d_gate, d_up], dim=-1)


def swiglu_backward_quantize(gu: torch.Tensor, da: torch.Tensor, fmt: Fp8Format, grad_fmt: Fp8Format,
                             power_of_two: bool, a_amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """`swiglu_backward` quantized from FP32 in `grad_fmt` both ways, and SwiGLU's output again, its transpose
    quantized in `fmt` for the down projection's weight gradient: (dgu_fp8 (M, 2F), scales, dgut_fp8 (2F, M_pad),
    scales_t, at_fp8 (F, M_pad), at_scales).

    With `a_amax` (the forward's `swiglu_quantize(..., row_amax=True)`; `Fp8Recipe.wgrad_input_blocks`) a^T comes
    in 128x128 blocks, scales (F/128, M_pad/128), as `quantize_rows_cols(cols_in_blocks=True)` makes them. The
    kernels take each block's max from a_amax instead of from a (the same value: the max over a block's tokens of
    their tiles' maxima); this definition takes it from a itself, and checks only a_amax's shape."""
    a = swiglu(gu)
    blocks = a_amax is not None
    if blocks:
        check_tile_maxima(a_amax, a.shape)
    return (*quantize_rows_cols(swiglu_backward(gu, da), grad_fmt, power_of_two),
            *quantize_rows_cols(a, fmt, power_of_two, cols_in_blocks=blocks)[2:])


def check_tile_maxima(a_amax: torch.Tensor, a_shape: tuple[int, int]) -> None:
    """Refuse an `a_amax` that is not laid out as the tile maxima of an (M, F) SwiGLU output: (M, F/128) FP32,
    column-major (`tile_maxima`)."""
    m, f = a_shape
    if a_amax.shape != (m, f // 128) or a_amax.dtype != torch.float32 or a_amax.stride() != (1, m):
        raise ValueError(f"a_amax must be SwiGLU's 1x128 tile maxima, ({m}, {f // 128}) FP32 column-major "
                         f"(swiglu_quantize(row_amax=True)); got {tuple(a_amax.shape)} {a_amax.dtype} strides "
                         f"{a_amax.stride()}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of x (..., head_dim) in FP32, returned in x's dtype: x cos + rot(x) sin with
    rot([x1 | x2]) = [-x2 | x1] (Hugging Face Llama's "rotate half" layout); cos and sin broadcast against x."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos + rotated * sin).type_as(x)


def rope_backward_fusable(widths: tuple[int, int, int], head_dim: int) -> bool:
    """Whether one kernel can quantize [RoPE^T(dq) | RoPE^T(dk) | dv] (`rope_backward_quantize`): query, key and
    value widths each whole 128-wide tiles, and heads a power of two that divides 128 (so each feature's rotation
    partner, head_dim / 2 away in its head, lies in the same tile)."""
    return all(w % 128 == 0 for w in widths) and 2 <= head_dim <= 128 and head_dim & (head_dim - 1) == 0


def rope_backward(d_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_len: int,
                  head_dim: int) -> torch.Tensor:
    """The gradient of RoPE's input in FP32, given the gradient `d_rot` (M, heads x head_dim) of its rotated output
    (`megafp8.model.rope`: y = x cos + rot(x) sin with rot([x1 | x2]) = [-x2 | x1] per head). Rows are tokens,
    row r at position r % seq_len; cos and sin are the (positions, head_dim) FP32 tables. The gradient is
    d cos + rot^T(d sin), rot^T([z1 | z2]) = [z2 | -z1]: what autograd computes through the rotation, in FP32."""
    m, width = d_rot.shape
    pos = torch.arange(m, device=d_rot.device) % seq_len
    d = d_rot.float().reshape(m, width // head_dim, head_dim)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # (M, 1, head_dim)
    z1, z2 = (d * s).chunk(2, dim=-1)
    return (d * c + torch.cat([z2, -z1], dim=-1)).reshape(m, width)


def rope_backward_quantize(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           seq_len: int, head_dim: int, fmt: Fp8Format,
                           power_of_two: bool) -> tuple[torch.Tensor, ...]:
    """The QKV projection's output gradient [rope_backward(dq) | rope_backward(dk) | dv] (M, Nq + Nk + Nv), from the
    attention core's gradients of the rotated queries and keys and of the values, quantized from FP32 both ways:
    (dy_fp8, scales, dyt_fp8, scales_t), as `quantize.quantize_rows_cols` lays them out. The BF16 gradient of the
    projection's output is never written: the fused kernel reads dq, dk, dv once."""
    grad = torch.cat([rope_backward(dq, cos, sin, seq_len, head_dim), rope_backward(dk, cos, sin, seq_len, head_dim),
                      dv.float()], dim=-1)
    return quantize_rows_cols(grad, fmt, power_of_two)
