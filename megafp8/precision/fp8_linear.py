"""The FP8 linear: `y = x @ w^T` whose fprop, dgrad and wgrad GEMMs run in per-tile scaled FP8.

    forward   x -> x_fp8 (1x128 along K);  y  = x_fp8 @ w_fp8^T            (BF16 out)
    dgrad     dy -> dy_fp8 (1x128 along N); dx = dy_fp8 @ w_fp8               (BF16 out)
    wgrad     dy^T, x^T (1x128 along M);   dw = dy_fp8^T @ x_fp8            (BF16 out, FP32 accumulation)

Forward saves the FP8 input and its scales (1 byte + 1/32 byte per element instead of BF16's
2), and backward re-tiles it along tokens for wgrad. The weight is quantized in 128x128 blocks
once per weight version, together with its transpose for dgrad (128x128 blocks are
transpose-invariant, so both hold the same FP8 values): the cache is keyed on the tensor's
version counter, which every in-place update (the optimizer's write-back) bumps, so
micro-batches of one step share it and a stale copy can never be used.

A `LinearComm` adds a tensor-parallel layer's collectives around the GEMMs (supplied by
`megafp8.parallel`; the identity here): the input is quantized *before* an all-gather, so the
gather moves FP8 bytes, and the input-gradient reduction is started before the wgrad GEMM and
awaited after it, so the two overlap.

Every GEMM accumulates in FP32 inside (per 128-wide K block, scales applied in FP32) and
writes BF16, like a BF16 GEMM. The weight gradient is then added into `weight.main_grad`
(FP32, set by the gradient buffer) when the parameter has one, so micro-batches accumulate in
FP32; otherwise it is returned as the weight's gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megafp8.precision.backends import Fp8Backend
from megafp8.precision.formats import FORMATS, TILE, Fp8Format
from megafp8.precision.quantize import pad_rows


@dataclass
class _QuantizedWeight:
    version: tuple[int, int]  # (data_ptr, _version) of the weight it was made from
    w_fp8: torch.Tensor  # (N, K)
    w_scale: torch.Tensor  # (N/128, K/128), in the backend's GEMM layout
    wt_fp8: torch.Tensor  # (K, N): the same blocks, transposed, for dgrad
    wt_scale: torch.Tensor  # (K/128, N/128), in the backend's GEMM layout

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w_fp8, self.w_scale, self.wt_fp8, self.wt_scale


class Fp8WeightCache:
    """One layer's quantized weight, valid for exactly one version of the weight tensor.

    A new version is quantized into the same tensors (in place), so their addresses stay fixed for the life of the
    layer: a compiled block can read them as inputs, and CUDA graphs replay them without copying (they are marked
    static). `prepare` fills the cache eagerly before a compiled block runs (see `fp8_linear`)."""

    def __init__(self) -> None:
        self._entry: Optional[_QuantizedWeight] = None
        self.quantize_count = 0  # how many times the weight was quantized (for tests and metrics)
        self.prepared = False  # True once `prepare` has run: compiled code then reads the cache

    def get(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, pow2: bool) -> _QuantizedWeight:
        version = (weight.data_ptr(), weight._version)
        if self._entry is None or self._entry.version != version:
            w_fp8, w_scale, wt_fp8, wt_scale = backend.quantize_blocks_with_transpose(weight.detach(), fmt, pow2)
            fresh = (w_fp8, backend.block_scales_for_gemm(w_scale), wt_fp8, backend.block_scales_for_gemm(wt_scale))
            if self._entry is None:
                self._entry = _QuantizedWeight(version, *fresh)
                for t in fresh:  # unguarded: one compiled block's code serves every block, each with its own cache
                    torch._dynamo.mark_static_address(t, guard=False)
            else:
                with torch.no_grad():
                    for kept, new in zip(self._entry.tensors(), fresh):
                        kept.copy_(new)
                self._entry.version = version
            self.quantize_count += 1
        return self._entry

    @torch.compiler.disable
    def prepare(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, pow2: bool) -> None:
        """Quantize `weight` now if it changed since it was last quantized. Run eagerly (never traced) before each
        call of a compiled block, so the block's traced FP8 linears read a current cache instead of quantizing the
        weight in every forward (once per micro-batch).

        Contract: once prepared, compiled code trusts the cache, so `prepare` must run again before any compiled
        call that follows a change to the weight. `Block.forward` does this on every call (training, evaluation,
        recomputation and pipeline stages all go through it)."""
        self.get(weight, backend, fmt, pow2)
        self.prepared = True

    def clear(self) -> None:
        """Forget the quantized weight (the next forward re-quantizes)."""
        self._entry = None
        self.prepared = False


@dataclass(frozen=True)
class Fp8GemmConfig:
    """What one FP8 linear needs from the recipe (kept small so it can ride along into autograd)."""

    fmt: Fp8Format
    grad_fmt: Fp8Format
    power_of_two: bool
    fprop: bool
    dgrad: bool
    wgrad: bool

    @classmethod
    def from_names(cls, fmt: str, grad_fmt: str, power_of_two: bool, fprop: bool, dgrad: bool, wgrad: bool):
        return cls(FORMATS[fmt], FORMATS[grad_fmt], power_of_two, fprop, dgrad, wgrad)


class LinearComm:
    """The collectives around one linear's GEMMs; this base class is the identity (a plain linear).

    `megafp8.parallel` supplies the tensor-parallel ones, so the FP8 linear can quantize before it
    communicates (FP8 bytes cross the wire) while this module stays free of process groups. Rows
    are tokens throughout.
    """

    def gather_input(self, x2d: torch.Tensor) -> torch.Tensor:
        """Forward input (BF16) -> the rows the GEMM needs."""
        return x2d

    def gather_input_fp8(self, x_fp8: torch.Tensor, x_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same for an input already quantized in 1x128 row tiles (scales row-major (rows, K/128))."""
        return x_fp8, x_scale

    def reduce_output(self, y2d: torch.Tensor) -> torch.Tensor:
        """The GEMM's output -> the layer's output (e.g. summed over ranks that split K)."""
        return y2d

    def gather_grad_output(self, dy2d: torch.Tensor) -> torch.Tensor:
        """Backward: the layer's output gradient -> the GEMM's output gradient (conjugate of reduce_output)."""
        return dy2d

    def start_reduce_grad_input(self, dx2d: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Backward: start reducing the input gradient (conjugate of gather_input); the returned callable
        waits and gives the result, so the reduction overlaps the wgrad GEMM."""
        return lambda: dx2d


def quantize_input(x2d: torch.Tensor, cfg: Fp8GemmConfig, backend: Fp8Backend) -> tuple[torch.Tensor, torch.Tensor]:
    return backend.quantize_tiles(x2d, cfg.fmt, cfg.power_of_two)


def dgrad(dy2d: torch.Tensor, weight: torch.Tensor, entry: _QuantizedWeight, cfg: Fp8GemmConfig,
          backend: Fp8Backend, dy_q: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """dx = dy @ w (BF16 out); `dy_q` is dy already quantized in 1x128 tiles along N, if it is."""
    if not cfg.dgrad:
        return dy2d @ weight
    dy_fp8, dy_scale = dy_q or backend.quantize_tiles(dy2d, cfg.grad_fmt, cfg.power_of_two)
    return backend.gemm(dy_fp8, dy_scale, entry.wt_fp8, entry.wt_scale, True, dy2d.dtype)


def wgrad(dy2d: Optional[torch.Tensor], saved: tuple[torch.Tensor, ...], cfg: Fp8GemmConfig, backend: Fp8Backend,
          dyt_q: Optional[tuple[torch.Tensor, torch.Tensor]] = None, out_dtype: Optional[torch.dtype] = None
          ) -> torch.Tensor:
    """dw = dy^T @ x (BF16 out). `saved` is (x_fp8, x_scale) under FP8 wgrad, else (x2d,). `dyt_q` is dy^T already
    quantized in 1x128 tiles along tokens (padded to 128), if it is; then `dy2d` may be None."""
    if not cfg.wgrad:
        (x2d,) = saved
        return dy2d.t() @ x2d
    x_fp8, x_scale = saved
    # The GEMM contracts over tokens in 128-wide tiles: pad tokens with zero rows (which add nothing).
    pad = -x_fp8.shape[0] % TILE
    if pad:
        x_fp8 = pad_rows(x_fp8.view(torch.uint8), pad, 0).view(x_fp8.dtype)
        x_scale = pad_rows(x_scale, pad, 1.0)
    if dyt_q is None:
        dyt_q = backend.quantize_tiles_transposed(pad_rows(dy2d, pad, 0.0), cfg.grad_fmt, cfg.power_of_two)
    xt_fp8, xt_scale = backend.retile_transposed(x_fp8, x_scale, cfg.fmt, cfg.power_of_two)
    return backend.gemm(*dyt_q, xt_fp8, xt_scale, False, out_dtype or dy2d.dtype)


def accumulate_wgrad(weight: torch.Tensor, dw: torch.Tensor) -> Optional[torch.Tensor]:
    """Add dw into `weight.main_grad` (FP32, across micro-batches) if the weight has one; else return it."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return dw
    main_grad.add_(dw)
    return None


class WeightGradQueue:
    """Weight-gradient GEMMs held back from backward, to run later (the W pass of zero-bubble pipeline
    schedules). A layer given a queue pushes its wgrad (GEMM plus FP32 accumulation into `main_grad`) here
    instead of running it; `take()` hands everything pushed so far over as one callable."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []

    def push(self, run: Callable[[], None]) -> None:
        self._pending.append(run)

    def __len__(self) -> int:
        return len(self._pending)

    def take(self) -> Callable[[], None]:
        pending, self._pending = self._pending, []

        def run_all() -> None:
            with torch.no_grad():  # as inside backward: the deferred GEMMs build no graph
                for run in pending:
                    run()
        return run_all


def weight_grad_or_defer(weight: torch.Tensor, compute: Callable[[], torch.Tensor],
                         queue: Optional[WeightGradQueue]) -> Optional[torch.Tensor]:
    """The weight's gradient now (see `accumulate_wgrad`), or, with a queue and an FP32 `main_grad` to add into,
    None now and the GEMM later."""
    if queue is not None and getattr(weight, "main_grad", None) is not None:
        queue.push(lambda: accumulate_wgrad(weight, compute()))
        return None
    return accumulate_wgrad(weight, compute())


class _LinearDeferredWgradFn(torch.autograd.Function):
    """A plain (BF16/FP32) `x @ weight^T` whose weight gradient goes through a `WeightGradQueue`."""

    @staticmethod
    def forward(ctx, x, weight, queue: WeightGradQueue):
        ctx.save_for_backward(x, weight)
        ctx.queue = queue
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dy2d, x2d = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            dw = weight_grad_or_defer(weight, lambda: dy2d.t() @ x2d, ctx.queue)
        return dx, dw, None


def linear(x: torch.Tensor, weight: torch.Tensor, wgrad_queue: Optional[WeightGradQueue] = None) -> torch.Tensor:
    """`F.linear(x, weight)`, with the weight-gradient GEMM deferred to `wgrad_queue` when one is given."""
    if wgrad_queue is None:
        return F.linear(x, weight)
    return _LinearDeferredWgradFn.apply(x, weight, wgrad_queue)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cache: Fp8WeightCache, cfg: Fp8GemmConfig, backend: Fp8Backend, comm: LinearComm,
                queue: Optional[WeightGradQueue]):
        x2d = x.reshape(-1, x.shape[-1])  # (M, K) this rank's rows
        entry = cache.get(weight, backend, cfg.fmt, cfg.power_of_two)
        x_fp8 = x_scale = x_full = None
        if cfg.fprop:  # quantize first, so a gather moves FP8
            x_fp8, x_scale = comm.gather_input_fp8(*quantize_input(x2d, cfg, backend))
            y = backend.gemm(x_fp8, x_scale, entry.w_fp8, entry.w_scale, True, x.dtype)
        else:
            x_full = comm.gather_input(x2d)
            y = F.linear(x_full, weight)
            if cfg.wgrad:
                x_fp8, x_scale = quantize_input(x_full, cfg, backend)
        # wgrad in FP8 needs only the FP8 input; otherwise keep the BF16 input.
        ctx.save_for_backward(*((x_fp8, x_scale) if cfg.wgrad else (x_full if x_full is not None else x2d,)), weight)
        ctx.entry, ctx.cfg, ctx.backend, ctx.comm, ctx.in_shape = entry, cfg, backend, comm, x.shape
        ctx.queue = queue
        y = comm.reduce_output(y)
        if y.shape[0] != x2d.shape[0]:  # the collectives changed the token count (sequence parallelism)
            return y
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        cfg, backend, comm = ctx.cfg, ctx.backend, ctx.comm
        *saved, weight = ctx.saved_tensors
        dy2d = comm.gather_grad_output(dy.reshape(-1, dy.shape[-1]))  # (M, N)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_q = dyt_q = None
        if need_dx and need_dw and cfg.dgrad and cfg.wgrad:  # both quantizations of dy from one read of it
            dy_fp8, dy_scale, *dyt_q = backend.quantize_tiles_both(dy2d, cfg.grad_fmt, cfg.power_of_two)
            dy_q = (dy_fp8, dy_scale)
        finish_dx = None
        if need_dx:
            finish_dx = comm.start_reduce_grad_input(dgrad(dy2d, weight, ctx.entry, cfg, backend, dy_q))
        dw = None
        if need_dw:
            if dyt_q is not None:  # a deferred wgrad then keeps the FP8 dy^T, not the BF16 dy
                dyt, out_dtype = tuple(dyt_q), dy2d.dtype
                compute = lambda: wgrad(None, tuple(saved), cfg, backend, dyt, out_dtype)  # noqa: E731
            else:
                compute = lambda: wgrad(dy2d, tuple(saved), cfg, backend)  # noqa: E731
            dw = weight_grad_or_defer(weight, compute, ctx.queue)
        dx = finish_dx().reshape(ctx.in_shape) if finish_dx is not None else None
        return dx, dw, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache, cfg: Fp8GemmConfig,
               backend: Fp8Backend, comm: Optional[LinearComm] = None,
               wgrad_queue: Optional[WeightGradQueue] = None) -> torch.Tensor:
    """`x @ weight^T` with FP8 GEMMs; x (..., K) BF16, weight (N, K). Token count M need not be a multiple of 128.
    `comm` adds the collectives of a tensor-parallel layer (output rows may then differ from input rows);
    `wgrad_queue` defers the weight-gradient GEMM (zero-bubble pipelines).

    Under `torch.compile`, a plain layer (all three GEMMs in FP8, no collectives, no deferral) goes through the
    custom ops of `megafp8.precision.fp8_ops`, which the compiled graph keeps (no graph break); anything else
    runs eagerly inside the compiled code. The traced layer reads its quantized weight from `cache` once
    `cache.prepare` has run (eagerly, before the compiled code, and again before every compiled call that follows a
    weight change: `Block.forward` does; the weight is then quantized once per version, as in eager mode); before
    that it quantizes the weight in the graph, at every call."""
    plain = (comm is None or type(comm) is LinearComm) and wgrad_queue is None
    if torch.compiler.is_compiling() and plain and cfg.fprop and cfg.dgrad and cfg.wgrad:
        from megafp8.precision.fp8_ops import traced_fp8_linear

        # A prepared cache is current: `Fp8WeightCache.prepare` ran eagerly before this compiled code (the block
        # calls it); the graph reads the cached weight. Otherwise the graph quantizes the weight itself.
        cached = cache._entry.tensors() if cache.prepared and cache._entry is not None else None
        return traced_fp8_linear(x, weight, cfg.fmt.name, cfg.grad_fmt.name, cfg.power_of_two, backend.name, cached)
    return _eager_fp8_linear(x, weight, cache, cfg, backend, comm or LinearComm(), wgrad_queue)


# The eager FP8 linear is a graph break under torch.compile: its weight cache is Python state keyed on the weight's
# version, which Dynamo cannot trace ("an intermediate tensor 'wt_scale' ... aliases an input").
@torch.compiler.disable
def _eager_fp8_linear(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache, cfg: Fp8GemmConfig,
                      backend: Fp8Backend, comm: LinearComm, wgrad_queue: Optional[WeightGradQueue]) -> torch.Tensor:
    return _Fp8LinearFn.apply(x, weight, cache, cfg, backend, comm, wgrad_queue)
