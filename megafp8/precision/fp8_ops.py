"""The backends' FP8 kernels as `torch.library` custom ops, so `torch.compile` traces FP8 layers without a graph break.

The FP8 autograd functions (`fp8_linear`, `fp8_mlp`, the experts' grouped MLP in `grouped`) call their kernels through
`kernels(backend, traced)`: eagerly, the backend object itself; while compiling, `TracedKernels`, whose methods are
these ops. Dynamo and AOTAutograd keep each op in the graph as one opaque node (its body is the backend's method, the
same kernel, the same bits), and Inductor compiles everything between them. Every op's outputs are new tensors, laid
out as the eager methods lay them out (scales column-major; weight scales in the backend's GEMM layout).
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from megafp8.precision.backends import Fp8Backend, QuantizedWeight, StaleExperts, backend_by_name
from megafp8.precision.eager import eager_custom_op
from megafp8.precision.expert_layout import ExpertRows
from megafp8.precision.formats import FORMATS, TILE, Fp8Format


@functools.cache
def _backend(name: str) -> Fp8Backend:
    """The backend `name`, made once (backends hold no state; the choice was checked when the layer was built)."""
    return backend_by_name(name)


def _fake_scales(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(cols, rows, dtype=torch.float32).t()


def _fake_rows_cols(m: int, k: int, fmt: str, like: torch.Tensor, cols_in_blocks: bool = False
                    ) -> tuple[torch.Tensor, ...]:
    m_pad = -(-m // TILE) * TILE
    dtype = FORMATS[fmt].dtype
    return (like.new_empty(m, k, dtype=dtype), _fake_scales(m, k // TILE, like), like.new_empty(k, m_pad, dtype=dtype),
            _fake_scales(k // TILE if cols_in_blocks else k, m_pad // TILE, like))


@eager_custom_op("megafp8::quantize_rows", mutates_args=())
def quantize_rows(x: torch.Tensor, fmt: str, pow2: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _backend(backend).quantize_rows(x, FORMATS[fmt], pow2)


@quantize_rows.register_fake
def _(x, fmt, pow2, backend):
    m, k = x.shape
    return x.new_empty(m, k, dtype=FORMATS[fmt].dtype), _fake_scales(m, k // TILE, x)


@eager_custom_op("megafp8::quantize_rows_cols", mutates_args=())
def quantize_rows_cols(x: torch.Tensor, fmt: str, pow2: bool, backend: str, cols_in_blocks: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backend(backend).quantize_rows_cols(x, FORMATS[fmt], pow2, cols_in_blocks)


@quantize_rows_cols.register_fake
def _(x, fmt, pow2, backend, cols_in_blocks=False):
    return _fake_rows_cols(*x.shape, fmt, x, cols_in_blocks)


@eager_custom_op("megafp8::rmsnorm_quantize", mutates_args=())
def rmsnorm_quantize(h: torch.Tensor, weight: torch.Tensor, eps: float, fmt: str, pow2: bool, backend: str,
                     cols_in_blocks: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backend(backend).rmsnorm_quantize(h, weight, eps, FORMATS[fmt], pow2, cols_in_blocks)


@rmsnorm_quantize.register_fake
def _(h, weight, eps, fmt, pow2, backend, cols_in_blocks=False):
    return (*_fake_rows_cols(*h.shape, fmt, h, cols_in_blocks), h.new_empty(h.shape[0], dtype=torch.float32))


@eager_custom_op("megafp8::swiglu_quantize", mutates_args=())
def swiglu_quantize(gu: torch.Tensor, fmt: str, pow2: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _backend(backend).swiglu_quantize(gu, FORMATS[fmt], pow2)


@swiglu_quantize.register_fake
def _(gu, fmt, pow2, backend):
    return _fake_rows_cols(gu.shape[0], gu.shape[1] // 2, fmt, gu)[:2]


# With each tile's max |a| for the backward's a^T in 128x128 blocks (`Fp8Recipe.wgrad_input_blocks`).
@eager_custom_op("megafp8::swiglu_quantize_amax", mutates_args=())
def swiglu_quantize_amax(gu: torch.Tensor, fmt: str, pow2: bool, backend: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backend(backend).swiglu_quantize(gu, FORMATS[fmt], pow2, row_amax=True)


@swiglu_quantize_amax.register_fake
def _(gu, fmt, pow2, backend):
    m, f = gu.shape[0], gu.shape[1] // 2
    return (*_fake_rows_cols(m, f, fmt, gu)[:2], _fake_scales(m, f // TILE, gu))


@eager_custom_op("megafp8::swiglu_backward_quantize", mutates_args=())
def swiglu_backward_quantize(gu: torch.Tensor, da: torch.Tensor, fmt: str, grad_fmt: str, pow2: bool, backend: str,
                             a_amax: Optional[torch.Tensor] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor]:
    return _backend(backend).swiglu_backward_quantize(gu, da, FORMATS[fmt], FORMATS[grad_fmt], pow2, a_amax)


@swiglu_backward_quantize.register_fake
def _(gu, da, fmt, grad_fmt, pow2, backend, a_amax=None):
    return (*_fake_rows_cols(*gu.shape, grad_fmt, gu),
            *_fake_rows_cols(*da.shape, fmt, gu, cols_in_blocks=a_amax is not None)[2:])


@eager_custom_op("megafp8::rope_backward_quantize", mutates_args=())
def rope_backward_quantize(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           seq_len: int, head_dim: int, fmt: str, pow2: bool, backend: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backend(backend).rope_backward_quantize(dq, dk, dv, cos, sin, seq_len, head_dim, FORMATS[fmt], pow2)


@rope_backward_quantize.register_fake
def _(dq, dk, dv, cos, sin, seq_len, head_dim, fmt, pow2, backend):
    return _fake_rows_cols(dq.shape[0], dq.shape[1] + dk.shape[1] + dv.shape[1], fmt, dq)


@eager_custom_op("megafp8::quantize_weight", mutates_args=())
def quantize_weight(weight: torch.Tensor, fmt: str, pow2: bool, backend: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b = _backend(backend)
    out = b.empty_weight(weight.shape, FORMATS[fmt], weight.device)
    b.quantize_weight_(weight, out, FORMATS[fmt], pow2)
    return out.tensors()


@quantize_weight.register_fake
def _(weight, fmt, pow2, backend):
    return _backend(backend).empty_weight(weight.shape, FORMATS[fmt], weight.device).tensors()


@eager_custom_op("megafp8::quantize_stale_experts", mutates_args=())
def quantize_stale_experts(weight: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, version: torch.Tensor,
                           current: torch.Tensor, used: torch.Tensor, fmt: str, pow2: bool, backend: str
                           ) -> torch.Tensor:
    """The stacked experts with rows (`used` (E,) nonzero) whose FP8 weight is older than `current` quantized into
    the cache's tensors, and their `version` set to current (`megafp8.precision.weight_cache.Fp8WeightCache`,
    `per_expert`). Returns the block scales after it (a copy of `w_scale`, its layout): the GEMMs read those.

    It writes `w_fp8`, `w_scale` and `version` in place without declaring it. Declared, functionalization gives
    every later reader of `w_fp8` the op's functional result instead of the cache itself, a forward value: the
    dgrad's w^T, made from it in the backward, then had to be saved from the forward (the partitioner made the
    transposes there), every MoE layer's at once: on the GPU the FP8 MoE step held 2.5 GiB more (`docs/benchmarks.md`,
    job HX). Undeclared, later readers read the cache itself (a graph input), as without lazy quantization; they
    are ordered after the write by the returned scales, which every GEMM of these weights reads (the cache's
    tensors are static inputs, never reused by Inductor's memory planning; the write is idempotent, so a second run
    of it changes nothing)."""
    _backend(backend).quantize_weight_(weight, QuantizedWeight(w_fp8, w_scale, None, None), FORMATS[fmt], pow2,
                                       StaleExperts(version, current, used))
    return w_scale.clone()


@quantize_stale_experts.register_fake
def _(weight, w_fp8, w_scale, version, current, used, fmt, pow2, backend) -> torch.Tensor:
    return torch.empty_like(w_scale)


@eager_custom_op("megafp8::transpose_weight", mutates_args=())
def transpose_weight(w_fp8: torch.Tensor, w_scale: torch.Tensor, backend: str,
                     experts_used: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _backend(backend).transpose_weight(w_fp8, w_scale, experts_used)


@transpose_weight.register_fake
def _(w_fp8, w_scale, backend, experts_used=None):
    *lead, n, k = w_fp8.shape
    fmt = next(f for f in FORMATS.values() if f.dtype == w_fp8.dtype)
    out = _backend(backend).empty_weight(torch.Size((*lead, k, n)), fmt, w_fp8.device, transpose=False)
    return out.w_fp8, out.w_scale


def _gemm_op(variant: str):
    """The backend's GEMM `variant` (`gemm_1x128_128x128` or `gemm_1x128_1x128`) as the op megafp8::`variant`."""

    @eager_custom_op(f"megafp8::{variant}", mutates_args=())
    def op(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
           backend: str) -> torch.Tensor:
        return getattr(_backend(backend), variant)(a, a_scale, b, b_scale, out_dtype)

    @op.register_fake
    def _(a, a_scale, b, b_scale, out_dtype, backend):
        return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)
    return op


gemm_1x128_128x128 = _gemm_op("gemm_1x128_128x128")
gemm_1x128_1x128 = _gemm_op("gemm_1x128_1x128")


# The one op that writes into a tensor it was given: a weight gradient added into (a private alias of) the weight's
# FP32 `main_grad` (`Fp8WeightCache.main_grad_alias`). Declaring the mutation keeps the op in the graph and in order.
@eager_custom_op("megafp8::gemm_1x128_1x128_accumulate_", mutates_args=("out",))
def gemm_1x128_1x128_accumulate_(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                                 b_scale: torch.Tensor, backend: str) -> None:
    _backend(backend).gemm_1x128_1x128_accumulate_(out, a, a_scale, b, b_scale)


@gemm_1x128_1x128_accumulate_.register_fake
def _(out, a, a_scale, b, b_scale, backend):
    return None


@eager_custom_op("megafp8::gather_quantize_rows_cols", mutates_args=())
def gather_quantize_rows_cols(source: torch.Tensor, index: torch.Tensor, fmt: str, pow2: bool, backend: str,
                              cols_in_blocks: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backend(backend).gather_quantize_rows_cols(source, index, FORMATS[fmt], pow2, cols_in_blocks)


@gather_quantize_rows_cols.register_fake
def _(source, index, fmt, pow2, backend, cols_in_blocks=False):
    return _fake_rows_cols(index.shape[0], source.shape[1], fmt, source, cols_in_blocks)


@eager_custom_op("megafp8::gather_scale_quantize_rows_cols", mutates_args=())
def gather_scale_quantize_rows_cols(source: torch.Tensor, index: torch.Tensor, factor: torch.Tensor, fmt: str,
                                    pow2: bool, backend: str
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backend(backend).gather_scale_quantize_rows_cols(source, index, factor, FORMATS[fmt], pow2)


@gather_scale_quantize_rows_cols.register_fake
def _(source, index, factor, fmt, pow2, backend):
    return _fake_rows_cols(index.shape[0], source.shape[1], fmt, source)


def _expert_tiles(rows: int, tile_expert: Optional[torch.Tensor], tile_start: torch.Tensor,
                  tile_count: torch.Tensor) -> ExpertRows:
    """The padded expert layout as the grouped GEMMs read it, rebuilt from a graph's tensors."""
    return ExpertRows.of_tiles(rows, tile_expert, tile_start, tile_count)


@eager_custom_op("megafp8::grouped_gemm_1x128_128x128", mutates_args=())
def grouped_gemm_1x128_128x128(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                               tile_expert: torch.Tensor, tile_start: torch.Tensor, tile_count: torch.Tensor,
                               out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    rows = _expert_tiles(a.shape[0], tile_expert, tile_start, tile_count)
    return _backend(backend).grouped_gemm_1x128_128x128(a, a_scale, QuantizedWeight(b, b_scale, None, None), False,
                                                         rows, out_dtype)


@grouped_gemm_1x128_128x128.register_fake
def _(a, a_scale, b, b_scale, tile_expert, tile_start, tile_count, out_dtype, backend):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@eager_custom_op("megafp8::grouped_gemm_1x128_1x128", mutates_args=())
def grouped_gemm_1x128_1x128(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                             tile_start: torch.Tensor, tile_count: torch.Tensor, out_dtype: torch.dtype,
                             backend: str) -> torch.Tensor:
    rows = _expert_tiles(a.shape[1], None, tile_start, tile_count)
    return _backend(backend).grouped_gemm_1x128_1x128(a, a_scale, b, b_scale, rows, tile_start.shape[0], out_dtype)


@grouped_gemm_1x128_1x128.register_fake
def _(a, a_scale, b, b_scale, tile_start, tile_count, out_dtype, backend):
    return a.new_empty(tile_start.shape[0], a.shape[0], b.shape[0], dtype=out_dtype)


# The experts' weight gradients added into (an alias of) their FP32 `main_grad`, as `gemm_1x128_1x128_accumulate_`.
@eager_custom_op("megafp8::grouped_gemm_1x128_1x128_accumulate_", mutates_args=("out",))
def grouped_gemm_1x128_1x128_accumulate_(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                                         b_scale: torch.Tensor, tile_start: torch.Tensor, tile_count: torch.Tensor,
                                         backend: str) -> None:
    rows = _expert_tiles(a.shape[1], None, tile_start, tile_count)
    _backend(backend).grouped_gemm_1x128_1x128(a, a_scale, b, b_scale, rows, out.shape[0], torch.float32,
                                               accumulate=out)


@grouped_gemm_1x128_1x128_accumulate_.register_fake
def _(out, a, a_scale, b, b_scale, tile_start, tile_count, backend):
    return None


class TracedKernels:
    """A backend's kernels as the custom ops above: the same methods (those the FP8 autograd functions call)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def quantize_rows(self, x: torch.Tensor, fmt: Fp8Format, pow2: bool):
        return quantize_rows(x, fmt.name, pow2, self.backend)

    def quantize_rows_cols(self, x: torch.Tensor, fmt: Fp8Format, pow2: bool, cols_in_blocks: bool = False):
        return quantize_rows_cols(x, fmt.name, pow2, self.backend, cols_in_blocks)

    def rmsnorm_quantize(self, h: torch.Tensor, weight: torch.Tensor, eps: float, fmt: Fp8Format, pow2: bool,
                         cols_in_blocks: bool = False):
        return rmsnorm_quantize(h, weight, eps, fmt.name, pow2, self.backend, cols_in_blocks)

    def swiglu_quantize(self, gu: torch.Tensor, fmt: Fp8Format, pow2: bool, row_amax: bool = False):
        if row_amax:
            return swiglu_quantize_amax(gu, fmt.name, pow2, self.backend)
        return swiglu_quantize(gu, fmt.name, pow2, self.backend)

    def swiglu_backward_quantize(self, gu: torch.Tensor, da: torch.Tensor, fmt: Fp8Format, grad_fmt: Fp8Format,
                                 pow2: bool, a_amax: Optional[torch.Tensor] = None):
        return swiglu_backward_quantize(gu, da, fmt.name, grad_fmt.name, pow2, self.backend, a_amax)

    def rope_backward_quantize(self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, seq_len: int, head_dim: int, fmt: Fp8Format, pow2: bool):
        return rope_backward_quantize(dq, dk, dv, cos, sin, seq_len, head_dim, fmt.name, pow2, self.backend)

    def quantize_stale_experts(self, weight: torch.Tensor, entry: QuantizedWeight, stale: StaleExperts,
                               used: torch.Tensor, fmt: Fp8Format, pow2: bool) -> QuantizedWeight:
        """`entry` with the experts with rows brought up to date, the block scales those of after the write."""
        scale = quantize_stale_experts(weight, entry.w_fp8, entry.w_scale, stale.version, stale.current, used,
                                       fmt.name, pow2, self.backend)
        return QuantizedWeight(entry.w_fp8, scale, None, None)

    def transpose_weight(self, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                         experts_used: Optional[torch.Tensor] = None):
        return transpose_weight(w_fp8, w_scale, self.backend, experts_used)

    def gemm_1x128_128x128(self, a, a_scale, b, b_scale, out_dtype: torch.dtype):
        return gemm_1x128_128x128(a, a_scale, b, b_scale, out_dtype, self.backend)

    def gemm_1x128_1x128(self, a, a_scale, b, b_scale, out_dtype: torch.dtype):
        return gemm_1x128_1x128(a, a_scale, b, b_scale, out_dtype, self.backend)

    def gemm_1x128_1x128_accumulate_(self, out, a, a_scale, b, b_scale) -> None:
        gemm_1x128_1x128_accumulate_(out, a, a_scale, b, b_scale, self.backend)

    def gather_quantize_rows_cols(self, source: torch.Tensor, index: torch.Tensor, fmt: Fp8Format, pow2: bool,
                                  cols_in_blocks: bool = False):
        return gather_quantize_rows_cols(source, index, fmt.name, pow2, self.backend, cols_in_blocks)

    def gather_scale_quantize_rows_cols(self, source: torch.Tensor, index: torch.Tensor, factor: torch.Tensor,
                                        fmt: Fp8Format, pow2: bool):
        return gather_scale_quantize_rows_cols(source, index, factor, fmt.name, pow2, self.backend)

    def grouped_gemm_1x128_128x128(self, a, a_scale, w: QuantizedWeight, transposed: bool, rows,
                                   out_dtype: torch.dtype):
        if not transposed:
            b, b_scale = w.w_fp8, w.w_scale
        elif w.wt_fp8 is not None:
            b, b_scale = w.wt_fp8, w.wt_scale
        else:
            b, b_scale = self.transpose_weight(w.w_fp8, w.w_scale, rows.tile_count)
        return grouped_gemm_1x128_128x128(a, a_scale, b, b_scale, rows.tile_expert, rows.tile_start, rows.tile_count,
                                          out_dtype, self.backend)

    def grouped_gemm_1x128_1x128(self, a, a_scale, b, b_scale, rows, num_experts: int, out_dtype: torch.dtype,
                                 accumulate: Optional[torch.Tensor] = None):
        if accumulate is None:
            return grouped_gemm_1x128_1x128(a, a_scale, b, b_scale, rows.tile_start, rows.tile_count, out_dtype,
                                            self.backend)
        grouped_gemm_1x128_1x128_accumulate_(accumulate, a, a_scale, b, b_scale, rows.tile_start, rows.tile_count,
                                             self.backend)
        return accumulate


def kernels(backend: Union[Fp8Backend, str], traced: bool) -> Union[Fp8Backend, TracedKernels]:
    """The FP8 kernels to call: eagerly the backend object itself; in a graph being traced, the custom ops of the
    backend of that name (what the graph records: a name, not an object)."""
    return TracedKernels(backend) if traced else backend


def backend_arg(backend: Fp8Backend, traced: bool) -> Union[Fp8Backend, str]:
    """What an FP8 autograd function is given to reach `backend` (see `kernels`)."""
    return backend.name if traced else backend


def quantized_weight_in_graph(weight: torch.Tensor, fmt: Fp8Format, pow2: bool, backend: str) -> QuantizedWeight:
    """The weight quantized by an op of the graph (a compiled layer whose cache was not prepared eagerly)."""
    return QuantizedWeight(*quantize_weight(weight.detach(), fmt.name, pow2, backend))
