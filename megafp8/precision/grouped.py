"""The grouped linear of MoE experts: rows sorted by expert, one stacked weight, any precision.

    y[rows of e] = x[rows of e] @ w[e]^T     x (M, K), w (E, N, K), counts[e] rows per expert

One autograd function computes all experts. Under FP8 each expert's rows are first laid out
from a 128-row boundary (zero rows fill each expert's last tile: `ExpertRows`), so every 1x128
tile along the rows belongs to one expert. Then every tensor is quantized once for all experts
(x and dy along their features and, from the same read, along their rows for wgrad; the stacked weight in
128x128 blocks once per weight version) and each GEMM is one grouped call over all experts: the
Triton grouped kernels on GPU, a loop of the reference GEMM for the reference backend. The FP8
operands are exactly those of one FP8 linear per expert; results differ only by summation order. The weight
gradient is one stacked (E, N, K) tensor; when the weight has an FP32 `main_grad`, the wgrad GEMM adds its FP32
result into it directly (in the kernel's epilogue on GPUs: no BF16 copy, no separate add).

BF16 (no FP8 recipe) runs each GEMM as one `torch._grouped_mm` over all experts (rows unpadded, int32 offsets
= cumulative row counts): fprop x @ w^T, dgrad dy @ w, and wgrad dy^T @ x with the offsets along the contracted
tokens, giving (E, N, K). Where `_grouped_mm` cannot take the problem in one call without a host sync
(`grouped_mm_unsupported_reason`), a loop of one matmul per expert gives the same result.

Under `torch.compile` both forms are traced into the graph, as the dense layers are: the FP8 experts' fused MLP
(`grouped_fp8_swiglu_mlp`) through custom ops (`megafp8.precision.fp8_ops`) reading the weights their block quantized
eagerly, BF16's grouped linear through `torch._grouped_mm`; each adds its weight gradients into an alias of the
weight's FP32 `main_grad`. Every shape is fixed (the padded layout is sized by its upper bound) and nothing syncs
with the host, so CUDA graphs capture the experts too. A weight-gradient queue, the unfused FP8 path (FP8-health
sampling) and the per-expert loop run eagerly inside the graph.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megafp8.precision.backends import Fp8Backend, QuantizedWeight
from megafp8.precision.bf16_linear import MainGradSlot
from megafp8.precision.eager import eager_custom_op, run_eagerly
from megafp8.precision.expert_layout import ExpertRows, counts_on, expert_rows
from megafp8.precision.fp8_linear import current_weight, route_weight_gradient, traced_main_grad
from megafp8.precision.fp8_ops import backend_arg, kernels
from megafp8.precision.recipe import Fp8Recipe
from megafp8.precision.triton_support import triton_runs_on
from megafp8.precision.weight_cache import Fp8WeightCache
from megafp8.precision.wgrad import WeightGradQueue, weight_grad_or_defer


def _to_padded_layout(x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    # index_copy_ is a plain row copy; `padded[index] = x` goes through index_put, much slower on GPUs.
    return x.new_zeros(rows.total, x.shape[1]).index_copy_(0, rows.index, x)


def _from_padded_layout(padded: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    return padded.index_select(0, rows.index)


# What `torch._grouped_mm` runs where (read in torch's aten/src/ATen/native/cuda/GroupedBlas.cpp, GroupMM.cu and
# GroupedMMUtils.h, and tried on torch 2.13's CPU build):
# - CUDA: a CUTLASS grouped kernel, no host sync, only for BF16 operands and output on compute capability 9.x or
#   10.x, fewer than 1024 groups. Anything else (FP16, FP32, SM80, SM120, ROCm without CK) goes to a fallback that
#   copies the offsets to the host (a sync) and runs one mm per group: no better than our loop, so we loop.
# - elsewhere (CPU): the device-generic (CompositeExplicitAutograd) kernel where torch registers one (torch 2.13's
#   CPU build does), one mm per group, BF16, FP16 and FP32.
# - every operand's row stride (K for x and w, N for dy) a multiple of 16 bytes ("strides should be multiple of
#   16 bytes"), and on CUDA every data pointer 16-byte aligned.
# - group sizes: any, zero included, in the layouts used here (GroupMMCommon.cuh): fprop and dgrad with a row-major
#   A, wgrad with dy^T a column-major view and x row-major (the layout of torch's own wgrad; with others CUTLASS
#   asserts on empty groups or unaligned group sizes). An empty expert's weight gradient is still zeroed here:
#   SM100's kernel leaves garbage there (pytorch/pytorch#172439).
# - the wgrad form rejects a zero-length contracted dim (no rows at all: "strides should be multiple of 16 bytes"
#   on CUDA), so no rows means the loop.
_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GROUPED_MM_MAX_GROUPS = 1023  # CUTLASS path: "Can't process more than 1024 groups"


def _has_generic_grouped_mm() -> bool:
    """Whether this torch has `_grouped_mm` with its device-generic (CompositeExplicitAutograd) kernel."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_grouped_mm", "CompositeExplicitAutograd")
    except RuntimeError:
        return False


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
_HAS_GENERIC_GROUPED_MM = _has_generic_grouped_mm()


def grouped_mm_unsupported_reason(device_type: str, capability: Optional[tuple[int, int]], dtype: torch.dtype,
                                  rows: int, experts: int, k: int, n: int, *, hip: bool = False,
                                  has_grouped_mm: bool = _HAS_GROUPED_MM,
                                  has_generic_kernel: bool = _HAS_GENERIC_GROUPED_MM) -> Optional[str]:
    """None if `torch._grouped_mm` computes the three GEMMs of a grouped linear (x (rows, k), w (experts, n, k),
    all contiguous and 16-byte aligned) in one call each with no host sync; else why the per-expert loop runs.
    `capability` is the CUDA compute capability (None off CUDA)."""
    if not has_grouped_mm:
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in _GROUPED_MM_DTYPES:
        return f"torch._grouped_mm takes BF16, FP16 or FP32, not {dtype}"
    if rows == 0:
        return "no rows: the weight-gradient form rejects a zero-length contracted dim"
    align = 16 // dtype.itemsize
    if k % align or n % align:
        return f"torch._grouped_mm needs in and out features in multiples of 16 bytes ({align} elements), got {k}, {n}"
    if device_type == "cuda":
        if hip:
            return "on ROCm torch._grouped_mm may run its fallback, which syncs with the host"
        if capability is None or capability[0] not in (9, 10) or dtype != torch.bfloat16:
            return (f"torch._grouped_mm's grouped kernel needs BF16 on compute capability 9.x or 10.x (got {dtype} on "
                    f"{capability}); its fallback syncs with the host")
        if experts > _GROUPED_MM_MAX_GROUPS:
            return f"torch._grouped_mm's grouped kernel takes at most {_GROUPED_MM_MAX_GROUPS} experts, got {experts}"
        return None
    if not has_generic_kernel:
        return f"torch {torch.__version__} has no torch._grouped_mm for {device_type}"
    return None


def _device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """The CUDA compute capability (None off CUDA); what traced code asks (Dynamo folds it to a constant)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


_capability = functools.lru_cache(maxsize=None)(_device_capability)  # eagerly, asked once per device


def _aligned(*tensors: torch.Tensor) -> bool:
    """Contiguous, and (on CUDA, where `_grouped_mm` checks it) starting on a 16-byte boundary."""
    return all(t.is_contiguous() and (t.device.type != "cuda" or t.data_ptr() % 16 == 0) for t in tensors)


def _use_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    experts, n, k = weight.shape
    return (x.dtype == weight.dtype and _aligned(x, weight) and grouped_mm_unsupported_reason(
        x.device.type, _capability(x.device), x.dtype, x.shape[0], experts, k, n, hip=torch.version.hip is not None)
        is None)


@dataclass
class _GroupOffsets:
    offs: torch.Tensor  # (E,) int32: end row of each expert (the cumulative row counts)
    empty: Optional[torch.Tensor]  # indices of the experts with no rows to zero, None if none (or none need it)


def _kernel_zeroes_empty_experts(device: torch.device, capability=_capability) -> bool:
    """Whether `_grouped_mm`'s wgrad writes exact zeros for an expert with no rows on `device`: SM90's CUTLASS
    kernel runs the empty group's epilogue on a zero accumulator (tests/test_fp8_gpu.py checks it); SM100's leaves
    garbage (pytorch/pytorch#172439). Elsewhere the empty experts are found on the host and zeroed here."""
    return device.type == "cuda" and capability(device)[0] == 9


def _group_offsets(counts: torch.Tensor) -> _GroupOffsets:
    """`_grouped_mm`'s offsets, computed on the counts' device (no host sync where the kernel zeroes empty
    experts itself; elsewhere the counts are read on the host to find them)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    if _kernel_zeroes_empty_experts(counts.device):
        return _GroupOffsets(offs, None)
    empty = [e for e, c in enumerate(counts.tolist()) if c == 0]
    return _GroupOffsets(offs, torch.tensor(empty, device=counts.device) if empty else None)


def _segments(counts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows (reads the counts on the host)."""
    counts = counts.tolist()
    starts = [0, *itertools.accumulate(counts)]
    return [(e, starts[e], starts[e + 1]) for e, c in enumerate(counts) if c]


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, cache: Optional[Fp8WeightCache], recipe: Optional[Fp8Recipe],
                backend: Optional[Fp8Backend], queue: Optional[WeightGradQueue]):
        ctx.recipe, ctx.backend, ctx.queue = recipe, backend, queue
        if recipe is None:
            ctx.counts = counts
            ctx.offsets = _group_offsets(counts) if _use_grouped_mm(x, weight) else None
            ctx.save_for_backward(x, weight)
            if ctx.offsets is not None:  # (M, K) @ (E, K, N) -> (M, N)
                return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ctx.offsets.offs)
            y = x.new_empty(x.shape[0], weight.shape[1])
            for e, lo, hi in _segments(counts):
                torch.matmul(x[lo:hi], weight[e].t(), out=y[lo:hi])
            return y
        rows = expert_rows(counts, x.device, x.shape[0])
        entry = cache.get(weight, backend, recipe.fmt, recipe.power_of_two_scales)
        # One launch for all experts; the rows' transpose (for wgrad) comes from the same read of x.
        xp_fp8, xp_scale, xt_fp8, xt_scale = backend.quantize_rows_cols(_to_padded_layout(x, rows), recipe.fmt,
                                                                        recipe.power_of_two_scales,
                                                                        recipe.wgrad_input_blocks)
        yp = backend.grouped_gemm_1x128_128x128(xp_fp8, xp_scale, entry, False, rows, x.dtype)
        ctx.rows, ctx.entry = rows, entry
        ctx.save_for_backward(xt_fp8, xt_scale, weight)
        return _from_padded_layout(yp, rows)

    @staticmethod
    def backward(ctx, dy):
        recipe, backend = ctx.recipe, ctx.backend
        *saved, weight = ctx.saved_tensors
        dy = dy.contiguous()
        if recipe is None:
            (x,) = saved
            offsets = ctx.offsets if dy.dtype == x.dtype and _aligned(dy) else None
            if offsets is not None:
                dx = torch._grouped_mm(dy, weight, offs=offsets.offs)  # (M, N) @ (E, N, K) -> (M, K)

                def plain_wgrad() -> torch.Tensor:  # (N, M) @ (M, K), groups along the tokens -> (E, N, K)
                    dw = torch._grouped_mm(dy.t(), x, offs=offsets.offs)
                    if offsets.empty is not None:  # experts without rows get exactly zero
                        dw.index_put_((offsets.empty,), dw.new_zeros(()))
                    return dw

                def plain_wgrad_into(main_grad: torch.Tensor) -> None:  # the experts with rows only, on CUDA
                    add_experts_with_rows_into_(main_grad, plain_wgrad(), offsets.offs)
            else:
                segments = _segments(ctx.counts)
                dx = torch.zeros(dy.shape[0], weight.shape[2], dtype=dy.dtype, device=dy.device)
                for e, lo, hi in segments:
                    dx[lo:hi] = dy[lo:hi] @ weight[e]

                def plain_wgrad() -> torch.Tensor:
                    dw = torch.zeros(weight.shape, dtype=dy.dtype, device=dy.device)
                    for e, lo, hi in segments:
                        dw[e] = dy[lo:hi].t() @ x[lo:hi]
                    return dw
                plain_wgrad_into = None  # the plain add of weight_grad_or_defer
            return (dx, weight_grad_or_defer(weight, plain_wgrad, ctx.queue, plain_wgrad_into), None, None, None,
                    None, None)
        xt_fp8, xt_scale = saved
        rows, entry = ctx.rows, ctx.entry
        dy_fp8, dy_scale, dyt_fp8, dyt_scale = backend.quantize_rows_cols(
            _to_padded_layout(dy, rows), recipe.grad_fmt, recipe.power_of_two_scales)
        dx = _from_padded_layout(backend.grouped_gemm_1x128_128x128(dy_fp8, dy_scale, entry, True, rows, dy.dtype),
                                 rows)

        def fp8_wgrad(into: Optional[torch.Tensor] = None) -> torch.Tensor:
            # wgrad contracts over each expert's rows: both operands in 1x128 tiles along the (padded) rows.
            return backend.grouped_gemm_1x128_1x128(dyt_fp8, dyt_scale, xt_fp8, xt_scale, rows, weight.shape[0],
                                                    dy.dtype, accumulate=into)
        return dx, weight_grad_or_defer(weight, fp8_wgrad, ctx.queue, fp8_wgrad), None, None, None, None, None


@eager_custom_op("megafp8::add_experts_with_rows_into_", mutates_args=("out",))
def add_experts_with_rows_into_(out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> None:
    """out += x: the BF16 experts' stacked weight gradient added into (an alias of) the weight's FP32 `main_grad`
    (declared as a mutation, so a compiled graph keeps it, in order). x is exactly zero for an expert without rows
    (offs: `_grouped_mm`'s cumulative row counts), so on CUDA a Triton kernel adds only the experts with rows
    (`megafp8.precision.kernels.experts_add`: the others' 10 bytes a parameter are never moved; the same bits);
    elsewhere (where `triton_runs_on` says no), the whole add."""
    if out.is_cuda and triton_runs_on(out.device) and out.dtype == torch.float32 and x.shape == out.shape \
            and out.is_contiguous() and x.is_contiguous():
        from megafp8.precision.kernels.experts_add import add_experts_with_rows_
        add_experts_with_rows_(out, x, offs)
    else:
        out.add_(x)


@add_experts_with_rows_into_.register_fake
def _(out, x, offs) -> None:
    return None


class _TracedGroupedMmFn(torch.autograd.Function):
    """High-precision experts inside a compiled graph: `torch._grouped_mm` for fprop, dgrad and wgrad (offsets on
    the device), the weight gradient added into the main_grad slot's alias, or returned without one."""

    @staticmethod
    def forward(ctx, x, weight, offs, empty, main_grad):
        ctx.save_for_backward(x, weight, offs, empty, main_grad)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offs, empty, main_grad = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, weight, offs=offs)
        dw = torch._grouped_mm(dy.t(), x, offs=offs)
        if empty is not None:  # experts without rows get exactly zero, found on the device
            dw = torch.where(empty[:, None, None], torch.zeros((), dtype=dw.dtype, device=dw.device), dw)
        if main_grad is None:
            return dx, dw, None, None, None
        add_experts_with_rows_into_(main_grad, dw, offs)
        return dx, None, None, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts, cache: Optional[Fp8WeightCache],
                   recipe: Optional[Fp8Recipe], backend: Optional[Fp8Backend],
                   wgrad_queue: Optional[WeightGradQueue] = None,
                   main_grad_slot: Optional[MainGradSlot] = None) -> torch.Tensor:
    """x (M, K) rows sorted by expert, `counts[e]` of them for expert e (a list, or a tensor: on the device, it
    is never read on the host where BF16's grouped kernel or the FP8 path runs); weight (E, N, K) -> (M, N).
    `recipe` None: BF16/FP32 matmuls; else FP8 per-tile GEMMs through `backend` with the weight cached in `cache`.
    `wgrad_queue` defers the weight-gradient GEMMs (zero-bubble pipelines).

    Under `torch.compile` the high-precision form is traced where `torch._grouped_mm` takes it, adding its weight
    gradient into `main_grad_slot`'s alias (`megafp8.precision.MainGradSlot`, refreshed eagerly before the compiled
    block); the FP8 form (the experts' unfused path, which FP8-health sampling runs uncompiled), a queue, or a
    per-expert loop run eagerly inside the graph."""
    if not torch.compiler.is_compiling():
        return eager_grouped_linear(x, weight, counts, cache, recipe, backend, wgrad_queue)
    counts = counts_on(counts, x.device)
    if (recipe is None and wgrad_queue is None and counts.shape == (weight.shape[0],) and x.dtype == weight.dtype
            and x.shape[0] > 0 and weight.is_contiguous()
            and grouped_mm_unsupported_reason(x.device.type, _device_capability(x.device), x.dtype, x.shape[0],
                                              weight.shape[0], weight.shape[2], weight.shape[1],
                                              hip=torch.version.hip is not None) is None):
        empty = None if _kernel_zeroes_empty_experts(x.device, _device_capability) else counts == 0
        alias = main_grad_slot.alias if main_grad_slot is not None and torch.is_grad_enabled() else None
        return _TracedGroupedMmFn.apply(x.contiguous(), weight, torch.cumsum(counts, 0).to(torch.int32), empty,
                                        alias)
    return eager_grouped_linear(x, weight, counts, cache, recipe, backend, wgrad_queue)


@run_eagerly  # like the eager FP8 linear: a cached weight, our own kernels; compiled code runs around it
def eager_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts, cache: Optional[Fp8WeightCache],
                         recipe: Optional[Fp8Recipe], backend: Optional[Fp8Backend],
                         wgrad_queue: Optional[WeightGradQueue] = None) -> torch.Tensor:
    """`grouped_linear` run eagerly, also inside compiled code (expert parallelism, FP8, queues, the loop)."""
    counts = counts_on(counts, x.device)
    # The rows' sum is checked where it costs no sync with the GPU.
    if counts.shape != (weight.shape[0],) or (not counts.is_cuda and int(counts.sum()) != x.shape[0]):
        raise ValueError(f"{counts.shape[0]} expert row counts for {x.shape[0]} rows and {weight.shape[0]} experts "
                         f"(counts: {counts.tolist()})")
    if x.shape[0] == 0:  # no rows reached this rank's experts: nothing to quantize (the plain path handles it)
        recipe = None
    return _GroupedLinearFn.apply(x, weight, counts, cache, recipe, backend, wgrad_queue)


@dataclass
class ExpertProjection:
    """One stacked projection of the fused expert MLP: its weight (E, N, K), weight cache and wgrad queue."""

    weight: torch.Tensor
    cache: Fp8WeightCache
    queue: Optional[WeightGradQueue] = None


@dataclass
class GatheredInput:
    """The fused expert MLP's input, read straight into the padded expert layout: padded row i is
    `source[index[i]]` (a zero row where index[i] < 0). `source_grad(d_padded, grad_index)` maps the gradient of
    the padded rows (Mp, K) to the source's (S, K): the caller owns the permutation (`megafp8.parallel.permute`).
    A plain function and a tensor, not a closure, so a compiled graph can hold them."""

    source: torch.Tensor  # (S, K)
    index: torch.Tensor  # (Mp,) int64
    source_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_index: torch.Tensor


@dataclass
class CombinedOutput:
    """The experts' output combined per token inside the fused expert MLP: out[t] = sum_j weights[t, j] *
    y[pos[t, j]] (N, hidden), so that backward quantizes the padded output gradient straight from the combined one
    (row p = pos[t, j] of it is weights[t, j] * dout[t]) instead of reading a BF16 copy the combine wrote. The
    caller owns the permutation: `combine(y, pos, weights)` and `weights_grad(dout, y, pos)` (FP32 (N, k)) are its
    kernels (`megafp8.parallel.permute`), plain functions a compiled graph can hold."""

    pos: torch.Tensor  # (N, k) int64: the padded row of each (token, slot), distinct
    weights: torch.Tensor  # (N, k) FP32 routing weights
    combine: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    weights_grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def padded_source_index(layout: ExpertRows, row_to_source: torch.Tensor) -> torch.Tensor:
    """(Mp,) the source row of each padded row, -1 for padding; row i of the rows sorted by expert is
    `source[row_to_source[i]]`."""
    return torch.full((layout.total,), -1, dtype=torch.int64, device=row_to_source.device).index_copy_(
        0, layout.index, row_to_source)


class _GroupedFp8SwiGLUFn(torch.autograd.Function):
    """The experts' SwiGLU MLP in FP8 with every tensor in the padded expert layout from the first GEMM to the last,
    each producer quantizing its own FP32 output (as `megafp8.precision.fp8_mlp` does for the dense MLP):

        forward   x gathered from its source into the padded layout and quantized both ways, in one pass;
                  gu = grouped(x, w_gate_up) (Mp, 2F) BF16, kept;  a = silu(gate) * up -> FP8 along F (SwiGLU's
                  kernel);  y = grouped(a, w_down), returned padded (the combine reads it through an index), or,
                  with a `CombinedOutput`, combined per token here
        backward  dy (padded; zero in padding rows) quantized both ways (with a `CombinedOutput`, from the combined
                  output's gradient: row p of dy is w[t, j] * dout[t], quantized from FP32 by the gathering
                  quantizer, never written in BF16);  da = grouped dgrad through w_down (Mp, F);
                  d(gu) both ways and a^T again (SwiGLU's backward kernel);  the two wgrads;  dx padded -> the
                  source's gradient through `GatheredInput.source_grad`

    Against two grouped linears around an eager SwiGLU, this skips the copies into and out of the padded layout,
    the eager SwiGLU and its backward, and two quantization passes; SwiGLU's output and its input gradient are
    quantized from FP32 rather than from BF16 (`megafp8.precision.producers`). Padding rows stay zero throughout."""

    @staticmethod
    def forward(ctx, source, w_gate_up, w_down, gate_up_fp8, gate_up_scale, down_fp8, down_scale, index, tile_expert,
                tile_start, tile_count, grad_index, main_grad_gate_up, main_grad_down, pos, weights, source_grad,
                combine_fns, recipe: Fp8Recipe, backend, traced: bool, queues: tuple):
        k = kernels(backend, traced)
        fmt, pow2 = recipe.fmt, recipe.power_of_two_scales
        layout = ExpertRows.of_tiles(index.shape[0], tile_expert, tile_start, tile_count)
        gate_up = QuantizedWeight(gate_up_fp8, gate_up_scale, None, None)
        down = QuantizedWeight(down_fp8, down_scale, None, None)
        x_fp8, x_scale, xt_fp8, xt_scale = k.gather_quantize_rows_cols(source, index, fmt, pow2,
                                                                       recipe.wgrad_input_blocks)
        gu = k.grouped_gemm_1x128_128x128(x_fp8, x_scale, gate_up, False, layout, source.dtype)
        # a^T (the down projections' wgrad input) keeps its tiles under `recipe.wgrad_input_blocks`, unlike the
        # dense MLP's: in blocks the MoE step did not get faster (0.99x, docs/benchmarks.md jobs EU and EW).
        a_fp8, a_scale = k.swiglu_quantize(gu, fmt, pow2)
        y = k.grouped_gemm_1x128_128x128(a_fp8, a_scale, down, False, layout, source.dtype)
        ctx.recipe, ctx.backend, ctx.traced, ctx.queues, ctx.source_grad = recipe, backend, traced, queues, source_grad
        ctx.combine_fns = combine_fns
        ctx.save_for_backward(xt_fp8, xt_scale, gu, w_gate_up, w_down, gate_up_fp8, gate_up_scale, down_fp8,
                              down_scale, tile_expert, tile_start, tile_count, grad_index, main_grad_gate_up,
                              main_grad_down, *((y, pos, weights) if combine_fns is not None else (None,) * 3))
        return y if combine_fns is None else combine_fns[0](y, pos, weights)

    @staticmethod
    def backward(ctx, dy):
        recipe, traced, (gate_up_queue, down_queue) = ctx.recipe, ctx.traced, ctx.queues
        k = kernels(ctx.backend, traced)
        (xt_fp8, xt_scale, gu, w_gate_up, w_down, gate_up_fp8, gate_up_scale, down_fp8, down_scale, tile_expert,
         tile_start, tile_count, grad_index, main_grad_gate_up, main_grad_down, y, pos, weights) = ctx.saved_tensors
        layout = ExpertRows.of_tiles(gu.shape[0], tile_expert, tile_start, tile_count)
        gate_up = QuantizedWeight(gate_up_fp8, gate_up_scale, None, None)
        down = QuantizedWeight(down_fp8, down_scale, None, None)
        pow2, experts = recipe.power_of_two_scales, w_down.shape[0]
        dweights = None
        if ctx.combine_fns is None:
            dy_fp8, dy_scale, dyt_fp8, dyt_scale = k.quantize_rows_cols(dy.contiguous(), recipe.grad_fmt, pow2)
        else:  # dy is the combined output's gradient (N, hidden)
            dweights = ctx.combine_fns[1](dy, y, pos).to(weights.dtype)
            row_token, row_factor = _padded_rows_of_slots(pos, weights, gu.shape[0])
            dy_fp8, dy_scale, dyt_fp8, dyt_scale = k.gather_scale_quantize_rows_cols(
                dy.contiguous(), row_token, row_factor, recipe.grad_fmt, pow2)
        da = k.grouped_gemm_1x128_128x128(dy_fp8, dy_scale, down, True, layout, dy.dtype)
        dgu_fp8, dgu_scale, dgut_fp8, dgut_scale, at_fp8, at_scale = k.swiglu_backward_quantize(
            gu, da, recipe.fmt, recipe.grad_fmt, pow2)
        dw_down = _expert_weight_gradient(k, w_down, main_grad_down, dyt_fp8, dyt_scale, at_fp8, at_scale, layout,
                                          experts, dy.dtype, down_queue, traced)
        dx = ctx.source_grad(k.grouped_gemm_1x128_128x128(dgu_fp8, dgu_scale, gate_up, True, layout, dy.dtype),
                             grad_index)
        dw_gate_up = _expert_weight_gradient(k, w_gate_up, main_grad_gate_up, dgut_fp8, dgut_scale, xt_fp8, xt_scale,
                                             layout, experts, dy.dtype, gate_up_queue, traced)
        return (dx, dw_gate_up, dw_down) + (None,) * 12 + (dweights,) + (None,) * 6


def _padded_rows_of_slots(pos: torch.Tensor, weights: torch.Tensor, padded_rows: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each padded row p, the token t whose slot j it holds (pos[t, j] = p; -1 for padding) and that slot's
    routing weight in FP32 (0 for padding): row p of the experts' output gradient is weight[p] * dout[token[p]]."""
    flat = pos.reshape(-1)
    token = torch.full((padded_rows,), -1, dtype=torch.int64, device=pos.device).index_copy_(
        0, flat, torch.arange(flat.shape[0], device=pos.device) // pos.shape[1])
    factor = torch.zeros(padded_rows, dtype=torch.float32, device=pos.device).index_copy_(
        0, flat, weights.reshape(-1).to(torch.float32))
    return token, factor


def _expert_weight_gradient(k, weight: torch.Tensor, main_grad: Optional[torch.Tensor], a: torch.Tensor,
                            a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, layout: ExpertRows,
                            experts: int, out_dtype: torch.dtype, queue: Optional[WeightGradQueue],
                            traced: bool) -> Optional[torch.Tensor]:
    """The experts' FP8 weight gradients a @ b^T per expert (1x128 tiles along the padded rows), where they go: as
    `megafp8.precision.fp8_linear.fp8_weight_gradient` says for one FP8 linear."""
    def compute(into: Optional[torch.Tensor] = None) -> torch.Tensor:
        return k.grouped_gemm_1x128_1x128(a, a_scale, b, b_scale, layout, experts, out_dtype, accumulate=into)

    return route_weight_gradient(weight, main_grad, compute, compute, queue, traced)


def grouped_fp8_swiglu_mlp(x: GatheredInput, layout: ExpertRows, gate_up: ExpertProjection, down: ExpertProjection,
                           recipe: Fp8Recipe, backend: Fp8Backend,
                           combined: Optional[CombinedOutput] = None) -> torch.Tensor:
    """down(silu(gate) * up) per expert with [gate | up] = gate_up(x), all six GEMMs grouped FP8 GEMMs, in the
    padded expert layout `layout` (at least one row): x's rows are gathered from their source in the same pass
    that quantizes them, and the output (Mp, N) is padded (zero rows in the padding), or with `combined` the
    combined output (N tokens, N). gate_up.weight (E, 2F, K) holds [gate; up] per expert, down.weight (E, N, F).

    Under `torch.compile` it is traced into the graph as custom ops (`megafp8.precision.fp8_ops`), reading the
    weights the block quantized eagerly and adding the weight gradients into the caches' `main_grad` aliases, as a
    dense FP8 MLP does; with a weight-gradient queue (zero-bubble pipelines) it runs eagerly inside the graph."""
    if x.index.shape[0] != layout.total or layout.index.shape[0] == 0:
        raise ValueError(f"{x.index.shape[0]} padded rows for a layout of {layout.total} "
                         f"({layout.index.shape[0]} rows; at least one needed)")
    traced = torch.compiler.is_compiling()
    if traced and (gate_up.queue is not None or down.queue is not None):
        return _eager_grouped_fp8_swiglu_mlp(x, layout, gate_up, down, recipe, backend, combined)
    gate_up_entry = _experts_weight(gate_up, layout, recipe, backend, traced)
    down_entry = _experts_weight(down, layout, recipe, backend, traced)
    return _GroupedFp8SwiGLUFn.apply(
        x.source, gate_up.weight, down.weight, gate_up_entry.w_fp8, gate_up_entry.w_scale, down_entry.w_fp8,
        down_entry.w_scale, x.index, layout.tile_expert, layout.tile_start, layout.tile_count, x.grad_index,
        traced_main_grad(gate_up.cache, traced), traced_main_grad(down.cache, traced),
        *((combined.pos, combined.weights) if combined is not None else (None, None)), x.source_grad,
        (combined.combine, combined.weights_grad) if combined is not None else None, recipe,
        backend_arg(backend, traced), traced, (gate_up.queue, down.queue))


def _experts_weight(projection: ExpertProjection, layout: ExpertRows, recipe: Fp8Recipe, backend: Fp8Backend,
                    traced: bool) -> QuantizedWeight:
    """The projection's FP8 weight, current for every expert with rows in `layout` (a cache quantizing its experts
    lazily, `Fp8WeightCache.per_expert`, quantizes those that are stale now: eagerly, or in the graph by the custom
    op that writes the cache, `megafp8.precision.fp8_ops.quantize_stale_experts`)."""
    cache, weight, fmt, pow2 = projection.cache, projection.weight, recipe.fmt, recipe.power_of_two_scales
    if not cache.per_expert:
        return current_weight(cache, weight, recipe, backend, traced)
    if not traced:
        return cache.get_for_rows(weight, backend, fmt, pow2, layout.tile_count)
    entry = cache.traced_entry()
    if entry is None:  # not prepared: the graph quantizes the whole weight itself
        return current_weight(cache, weight, recipe, backend, traced)
    return kernels(backend.name, True).quantize_stale_experts(weight.detach(), entry, cache.stale, layout.tile_count,
                                                              fmt, pow2)


@run_eagerly  # deferred weight gradients run eagerly inside compiled code
def _eager_grouped_fp8_swiglu_mlp(x: GatheredInput, layout: ExpertRows, gate_up: ExpertProjection,
                                  down: ExpertProjection, recipe: Fp8Recipe, backend: Fp8Backend,
                                  combined: Optional[CombinedOutput]) -> torch.Tensor:
    return grouped_fp8_swiglu_mlp(x, layout, gate_up, down, recipe, backend, combined)
