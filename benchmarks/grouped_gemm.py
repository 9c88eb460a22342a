#!/usr/bin/env python
"""The MoE experts' grouped GEMMs (issue 19): TFLOP/s of fprop, dgrad and wgrad, BF16 and FP8, torch's and ours.

    PYTHONPATH=. python benchmarks/grouped_gemm.py [--quick] [--backend cublas] [--iters 30]

Rows are sorted by expert and every expert has the same number of rows, a multiple of 128 (so the padded layout of
our FP8 kernels is the plain one). Per (experts x rows, K, N): x (E*rows, K), the stacked weight w (E, N, K), the
output gradient dy (E*rows, N);

    fprop  y = x @ w[e]^T per expert         (E*rows, N)
    dgrad  dx = dy @ w[e] per expert         (E*rows, K)
    wgrad  dw[e] = dy[rows of e]^T @ x[rows of e]   (E, N, K): contracts over each expert's tokens
    wgrad into main_grad   main_grad[e] += dw[e], main_grad (E, N, K) FP32: the weight gradient as training
           makes it (BF16: `_grouped_mm` then the add, two kernels; ours: added in the GEMM's epilogue)
    wgrad, FP32 out   main_grad[e] = dw[e]: what a first micro-batch could write over main_grad instead of
           zeroing it and adding (BF16: `_grouped_mm` then a cast into main_grad; ours: FP32 stored by the GEMM)

each 2 * E*rows * K * N FLOPs. Only the GEMM is timed: operands are quantized beforehand (FP8 rowwise: one FP32
scale per row of each operand along the contracted dim, per expert for wgrad; blockwise and ours: 1x128 tiles for
activations and gradients, 128x128 blocks for the weight). Columns:

- BF16 loop of matmuls: one `torch.matmul` per expert.
- BF16 `torch._grouped_mm`: one call (the BF16 expert path of `megafp8.precision.grouped`).
- FP8 rowwise `torch._scaled_grouped_mm`: one call (use_fast_accum=False): what the hardware gives a grouped FP8
  GEMM in torch.
- FP8 blockwise, loop of `F.scaled_mm`: cuBLAS's 1x128 x 128x128 (fprop, dgrad) and 1x128 x 1x128 (wgrad) GEMMs,
  one per expert (blockwise `F.scaled_grouped_mm` has no SM90 kernel in torch 2.11).
- ours, pointer / TMA / warp-specialized: our grouped kernels chosen explicitly (`megafp8.precision.kernels.gemm`,
  `kernel=`): pointer loads (GPUs without TMA), TMA loads (Triton, SM90), and the warp-specialized Gluon kernel
  (SM90) with 128- and 256-wide tiles, its output tiles leaving by TMA where they may (`ws_gemm.tma_store_fits`;
  into main_grad by TMA's reduction where this Triton builds it) and, in the "epilogue from registers" columns,
  stored from its registers, and in the "interleaved FFMA" column with its promotion's FFMA runs interleaved in the
  cubin (`ws_gemm(interleave_ffma=True)`; the wgrad's promotion has no such runs, so that column's wgrad rows run
  the plain kernel); dgrad's transposed weight is made once, untimed.
- ours, ws 256, x in 128x128 blocks (wgrads only; the opt-in `precision.fp8_wgrad_input_blocks`, not the recipe):
  x^T quantized in 128 x 128 blocks (`quantize_rows_cols(cols_in_blocks=True)`) instead of 1x128 tiles along the
  rows, so each K step is promoted as in fprop (`gemm.grouped_wgrad(b_blocks=True)`, what the hopper backend runs).
- DeepGEMM (a peer, not ours): DeepSeek's `m_grouped_fp8_gemm_nt_contiguous` (fprop; dgrad on the weight's
  transpose, made once, untimed) and its SM90 1D1D `k_grouped_fp8_gemm_nt_contiguous` (the wgrad added into FP32
  main_grad; it has no BF16 or written-over form), on our quantized operands re-laid out untimed
  (`benchmarks/deepgemm_peer.py`; only where `import deep_gemm` works, its cell says why not elsewhere).
- ours: the backend's `grouped_gemm_1x128_128x128` (fprop; dgrad with `transposed=True`, which makes the weight's
  transpose in the call) and `grouped_gemm_1x128_1x128` (wgrad), as `megafp8.precision.grouped` calls them.

Timings: CUDA events around `--iters` calls after 3 warm-up calls (which also run Triton's autotuning);
`--cuda-graphs`: the `--iters` calls captured in one CUDA graph after those warm-up calls, the median of five
replays (device time, as the training step runs them; single timings of launched calls moved by up to 20% between
two columns running the same call, job CV). Each output
is checked against the BF16 loop's (relative Frobenius error above 1/8 prints "wrong" instead of a speed); a column
that fails (an API missing in this torch, a GPU it does not support) prints its error's first line in its cell.
`--device cpu` runs the same table on CPU (a smoke test: the FP8 columns say why they cannot run there).
`--columns` measures only the columns whose label (the list above, in the table's header) contains one of the
given words, case ignored; a word that names no column is an error.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.backends import select_backend  # noqa: E402
from megafp8.precision.formats import E4M3, TILE  # noqa: E402
from megafp8.precision.grouped import expert_rows  # noqa: E402
from megafp8.precision.quantize import mn_major  # noqa: E402

SHAPES = ["64x2048,2048,2048", "64x2048,1024,2048", "8x4096,7168,4096", "8x4096,2048,7168"]  # issue 19's
QUICK_SHAPES = ["8x256,512,512", "4x512,1024,512"]
INTO = "wgrad into main_grad"
FP32_OUT = "wgrad, FP32 out"  # written over main_grad, as a first micro-batch could without main_grad's zeroing
GEMMS = ("fprop", "dgrad", "wgrad", INTO, FP32_OUT)
WGRADS = ("wgrad", INTO, FP32_OUT)
GEMM_KEYS = {"fprop": "fprop", "dgrad": "dgrad", "wgrad": "wgrad", "into": INTO, "fp32": FP32_OUT}  # --gemms
COLUMNS = ("BF16 loop of matmuls", "BF16 `torch._grouped_mm`", "FP8 rowwise `torch._scaled_grouped_mm`",
           "FP8 blockwise, loop of `F.scaled_mm`", "ours, pointer kernels (no TMA)", "ours, TMA (Triton)",
           "ours, warp-specialized (Gluon), 128-wide tiles", "ours, warp-specialized, 256-wide tiles",
           "ours, ws 128, epilogue from registers", "ours, ws 256, epilogue from registers",
           "ours, ws 256, interleaved FFMA", "ours, ws 256, x in 128x128 blocks", "DeepGEMM (peer)",
           "ours (the backend's default)")
ALWAYS = (1, len(COLUMNS) - 1)  # BF16 `_grouped_mm` and the backend's default: the ratio column's two
WRONG = 2**-3  # relative error beyond which a column's output is reported wrong (FP8 gives a few percent)


class NotApplicable(Exception):
    """A column with no kernel for this GEMM: its cell says n/a."""


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """"64x2048,2048,2048" -> (experts, rows per expert, K, N); rows a multiple of 128, K and N of 128."""
    try:
        head, k, n = text.split(",")
        experts, rows = head.split("x")
        shape = int(experts), int(rows), int(k), int(n)
    except ValueError:
        raise ValueError(f"shape {text!r} is not EXPERTSxROWS,K,N (e.g. 64x2048,2048,2048)") from None
    if min(shape) <= 0 or any(d % TILE for d in shape[1:]):
        raise ValueError(f"shape {text!r}: rows per expert, K and N must be positive multiples of {TILE}")
    return shape


def error_cell(exc: BaseException, width: int = 160) -> str:
    """An exception's first line, fit for a markdown table cell."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".replace("|", "/")
    return text if len(text) <= width else text[:width - 1] + "…"


def ratio_cell(ours: Optional[float], base: Optional[float]) -> str:
    return f"{ours / base:.2f}x" if ours and base else "—"


def markdown(rows: list[tuple[str, str, list[str], str]], backend: str) -> str:
    """rows: (shape, GEMM, a cell per column, ratio cell) -> the table."""
    head = ["experts x rows, K, N", "GEMM", *COLUMNS[:-1], f"megafp8 grouped ({backend})",
            "ours / BF16 `_grouped_mm`"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([shape, gemm, *cells, ratio]) + " |" for shape, gemm, cells, ratio in rows]
    return "\n".join(lines)


def timed_ms(fn: Callable[[], torch.Tensor], device: torch.device, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graphed_ms(run: Callable[[], object], iters: int) -> float:
    """Milliseconds per call of `run`, `iters` calls captured in one CUDA graph (after warm-up on a side stream, as
    torch's capture rules ask), the replay timed by CUDA events (median of 5 replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            run()
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    del graph
    return sorted(times[1:])[2]


@dataclass
class Problem:
    experts: int
    rows: int  # per expert
    x: torch.Tensor  # (E*rows, K) BF16
    w: torch.Tensor  # (E, N, K) BF16
    dy: torch.Tensor  # (E*rows, N) BF16
    offs: torch.Tensor  # (E,) int32 end row of each expert

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        return [(e, e * self.rows, (e + 1) * self.rows) for e in range(self.experts)]

    @property
    def flops(self) -> float:
        return 2.0 * self.x.shape[0] * self.x.shape[1] * self.dy.shape[1]

    def out_shape(self, gemm: str) -> tuple[int, ...]:
        return {"fprop": tuple(self.dy.shape), "dgrad": tuple(self.x.shape), "wgrad": tuple(self.w.shape),
                INTO: tuple(self.w.shape), FP32_OUT: tuple(self.w.shape)}[gemm]

    def main_grad(self) -> torch.Tensor:
        """A zeroed FP32 main_grad for `INTO` (each column adds into its own: after the first call, which is
        checked, the timed calls keep adding) and for BF16's `FP32_OUT` (cast into it)."""
        return torch.zeros(self.w.shape, dtype=torch.float32, device=self.x.device)


def make_problem(experts: int, rows: int, k: int, n: int, device: torch.device) -> Problem:
    g = torch.Generator(device=device).manual_seed(0)
    randn = lambda *shape, std=1.0: (std * torch.randn(*shape, generator=g, device=device)).bfloat16()  # noqa: E731
    offs = torch.arange(1, experts + 1, dtype=torch.int32, device=device) * rows
    return Problem(experts, rows, randn(experts * rows, k), randn(experts, n, k, std=k**-0.5), randn(experts * rows, n),
                   offs)


# ---------------------------------------------------------------- the columns: each builds its operands (untimed)
# and returns the timed call for one GEMM


def bf16_loop(p: Problem, gemm: str, backend: str) -> Callable[[], torch.Tensor]:
    x, w, dy = p.x, p.w, p.dy
    out = torch.empty(p.out_shape(gemm), dtype=torch.bfloat16, device=x.device)
    main_grad = p.main_grad() if gemm in (INTO, FP32_OUT) else None

    def run() -> torch.Tensor:
        for e, lo, hi in p.segments:
            if gemm == "fprop":
                torch.matmul(x[lo:hi], w[e].t(), out=out[lo:hi])
            elif gemm == "dgrad":
                torch.matmul(dy[lo:hi], w[e], out=out[lo:hi])
            else:
                torch.matmul(dy[lo:hi].t(), x[lo:hi], out=out[e])
        if main_grad is None:
            return out
        return main_grad.add_(out) if gemm == INTO else main_grad.copy_(out)
    return run


def bf16_grouped(p: Problem, gemm: str, backend: str) -> Callable[[], torch.Tensor]:
    x, w, dy, offs = p.x, p.w, p.dy, p.offs
    if gemm == "fprop":
        return lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if gemm == "dgrad":
        return lambda: torch._grouped_mm(dy, w, offs=offs)
    dyt = dy.t()
    if gemm == INTO:  # as BF16 training adds its experts' weight gradients (`megafp8.precision.grouped`)
        main_grad = p.main_grad()
        return lambda: main_grad.add_(torch._grouped_mm(dyt, x, offs=offs))
    if gemm == FP32_OUT:  # `_grouped_mm` writes BF16: cast into the FP32 main_grad in place of the add
        main_grad = p.main_grad()
        return lambda: main_grad.copy_(torch._grouped_mm(dyt, x, offs=offs))
    return lambda: torch._grouped_mm(dyt, x, offs=offs)


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t (..., K) -> E4M3 values and one FP32 scale per row (..., ), amax mapped to the format's max."""
    scale = t.float().abs().amax(dim=-1).clamp(min=1e-12) / E4M3.max
    return (t.float() / scale.unsqueeze(-1)).to(E4M3.dtype), scale


def rowwise_per_expert(t: torch.Tensor, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """t^T (C, E*rows) rowwise per expert's columns (the wgrad operands) -> values (C, E*rows), scales (E*C,)."""
    parts = [rowwise_fp8(t[lo:hi].t()) for _, lo, hi in p.segments]
    return torch.cat([q for q, _ in parts], dim=1).contiguous(), torch.cat([s for _, s in parts])


def fp8_rowwise(p: Problem, gemm: str, backend: str) -> Callable[[], torch.Tensor]:
    x, w, dy, offs = p.x, p.w, p.dy, p.offs
    if gemm in (INTO, FP32_OUT):
        raise NotApplicable

    def grouped(a, b, sa, sb):  # a row-major, b column-major
        return lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    if gemm == "fprop":
        (qx, sx), (qw, sw) = rowwise_fp8(x), rowwise_fp8(w)  # w rows along K: (E, N, K)
        return grouped(qx, qw.transpose(-2, -1), sx, sw)
    if gemm == "dgrad":
        (qdy, sdy), (qwt, swt) = rowwise_fp8(dy), rowwise_fp8(w.transpose(-2, -1).contiguous())  # w^T rows along N
        return grouped(qdy, qwt.transpose(-2, -1), sdy, swt)
    (qdyt, sdyt), (qxt, sxt) = rowwise_per_expert(dy, p), rowwise_per_expert(x, p)  # (N, M), (K, M)
    return grouped(qdyt, qxt.t(), sdyt, sxt)


def fp8_blockwise_loop(p: Problem, gemm: str, backend: str) -> Callable[[], list[torch.Tensor]]:
    """One `F.scaled_mm` per expert, called as the cublas backend calls it (its quantizers give the layouts). The
    timed call returns each expert's output (joining them would add a copy)."""
    if gemm in (INTO, FP32_OUT):
        raise NotApplicable
    cublas = select_backend("cublas", p.x.device)
    bw1, bw128 = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    calls = []
    for e, lo, hi in p.segments:
        if gemm == "wgrad":  # both operands in 1x128 tiles along the expert's rows
            _, _, a, a_scale = cublas.quantize_rows_cols(p.dy[lo:hi], E4M3, False)
            _, _, b, b_scale = cublas.quantize_rows_cols(p.x[lo:hi], E4M3, False)
            calls.append((a, b.t(), mn_major(a_scale), bw1, mn_major(b_scale), bw1))
            continue
        weight = cublas.empty_weight(p.w[e].shape, E4M3, p.x.device)  # dense: cuBLAS's block-scale layout
        cublas.quantize_weight_(p.w[e], weight, E4M3, False)
        a, a_scale = cublas.quantize_rows(p.x[lo:hi] if gemm == "fprop" else p.dy[lo:hi], E4M3, False)
        b, b_scale = (weight.w_fp8, weight.w_scale) if gemm == "fprop" else (weight.wt_fp8, weight.wt_scale)
        calls.append((a, b.t(), mn_major(a_scale), bw1, b_scale, bw128))
    return lambda: [F.scaled_mm(*c, output_dtype=torch.bfloat16) for c in calls]


def _our_operands(p: Problem, gemm: str, backend: str) -> tuple:
    """(rows, operands) of our grouped GEMMs, quantized by the backend: wgrad (dy^T, x^T in 1x128 tiles along the
    rows); fprop/dgrad (the rows' FP8 and the stacked weight in 128x128 blocks with its transpose)."""
    impl = select_backend(backend, p.x.device)
    rows = expert_rows([p.rows] * p.experts, p.x.device)  # rows are multiples of 128: no padding
    if gemm in WGRADS:
        return impl, rows, (*impl.quantize_rows_cols(p.dy, E4M3, False)[2:],
                            *impl.quantize_rows_cols(p.x, E4M3, False)[2:])
    weight = impl.empty_weight(p.w.shape, E4M3, p.x.device)
    impl.quantize_weight_(p.w, weight, E4M3, False)
    return impl, rows, (*impl.quantize_rows(p.x if gemm == "fprop" else p.dy, E4M3, False), weight)


def ours(p: Problem, gemm: str, backend: str) -> Callable[[], torch.Tensor]:
    """The backend's grouped GEMMs on the operands `megafp8.precision.grouped` gives them."""
    impl, rows, operands = _our_operands(p, gemm, backend)
    if gemm == "wgrad":
        return lambda: impl.grouped_gemm_1x128_1x128(*operands, rows, p.experts, torch.bfloat16)
    if gemm == INTO:
        main_grad = p.main_grad()
        return lambda: impl.grouped_gemm_1x128_1x128(*operands, rows, p.experts, torch.float32, accumulate=main_grad)
    if gemm == FP32_OUT:
        return lambda: impl.grouped_gemm_1x128_1x128(*operands, rows, p.experts, torch.float32)
    a, a_scale, weight = operands
    return lambda: impl.grouped_gemm_1x128_128x128(a, a_scale, weight, gemm == "dgrad", rows, torch.bfloat16)


def our_kernel(kernel: str, block_n: int = 256, tma_store: Optional[bool] = None,
               interleave_ffma: bool = False) -> Callable:
    """A column of one of our grouped kernels, chosen explicitly: "pointer" (what GPUs without TMA run), "tma"
    (Triton, TMA loads) or "ws" (warp-specialized Gluon, `block_n` wide tiles; `tma_store` False: its output tiles
    stored from the consumers' registers rather than by TMA where they may; `interleave_ffma`: its FFMA runs
    interleaved in the cubin), against the backend's default."""
    def build(p: Problem, gemm: str, backend: str) -> Callable[[], torch.Tensor]:
        if p.x.device.type != "cuda":
            raise RuntimeError("our Triton kernels need a CUDA GPU")
        from megafp8.precision.kernels import gemm as kernels
        _, rows, operands = _our_operands(p, gemm, backend)
        options = {} if kernel != "ws" else dict(block_n=block_n, tma_store=tma_store)
        if gemm in WGRADS:  # (no FFMA runs to interleave in the wgrad's promotion: the plain cubin)
            main_grad = p.main_grad() if gemm == INTO else None
            dtype = torch.float32 if gemm == FP32_OUT else torch.bfloat16
            return lambda: kernels.grouped_wgrad(*operands, rows.tile_start, rows.tile_count, dtype,
                                                 kernel=kernel, accumulate=main_grad, **options)
        a, a_scale, weight = operands
        impl = select_backend(backend, p.x.device)
        b, b_scale = impl.weight_transposed(weight) if gemm == "dgrad" else (weight.w_fp8, weight.w_scale)
        if interleave_ffma:
            options["interleave_ffma"] = True
        return lambda: kernels.grouped_gemm(a, a_scale, b, b_scale, rows.tile_expert, torch.bfloat16, kernel=kernel,
                                            **options)
    build.__name__ = f"ours_{kernel}_{block_n}" + ("_registers" if tma_store is False else "") + \
        ("_interleaved" if interleave_ffma else "")
    return build


def wgrad_x_blocks(p: Problem, gemm: str, backend: str) -> Callable[[], torch.Tensor]:
    """The wgrads with x^T quantized in 128 x 128 blocks (features x rows; the opt-in
    `precision.fp8_wgrad_input_blocks`, not the recipe), as the hopper backend runs them: the warp-specialized kernel
    then promotes each K step as fprop does, one FFMA an element."""
    if gemm not in WGRADS:
        raise NotApplicable
    if p.x.device.type != "cuda":
        raise RuntimeError("our Triton kernels need a CUDA GPU")
    from megafp8.precision.kernels.gemm import grouped_wgrad
    impl, rows, (dyt, dyt_scale, _, _) = _our_operands(p, gemm, backend)
    xt, xt_scale = impl.quantize_rows_cols(p.x, E4M3, False, cols_in_blocks=True)[2:]
    main_grad = p.main_grad() if gemm == INTO else None
    return lambda: grouped_wgrad(dyt, dyt_scale, xt, xt_scale, rows.tile_start, rows.tile_count,
                                 torch.bfloat16 if gemm == "wgrad" else torch.float32, kernel="ws",
                                 accumulate=main_grad, b_blocks=True)


def deepgemm(p: Problem, gemm: str, backend: str) -> Callable[[], torch.Tensor]:
    """DeepGEMM's grouped FP8 GEMMs on our quantized operands (`deepgemm_peer`): m-grouped for fprop and dgrad,
    k-grouped (SM90 1D1D) for the wgrad added into main_grad."""
    if gemm in ("wgrad", FP32_OUT):
        raise NotApplicable
    import deepgemm_peer  # benchmarks/, beside this file
    impl, _, operands = _our_operands(p, gemm, backend)
    if gemm == INTO:
        dyt, dyt_scale, xt, xt_scale = operands
        return deepgemm_peer.k_grouped(dyt, dyt_scale, xt, xt_scale, p.experts, p.rows, p.main_grad())
    a, a_scale, weight = operands
    b, b_scale = impl.weight_transposed(weight) if gemm == "dgrad" else (weight.w_fp8, weight.w_scale)
    return deepgemm_peer.m_grouped(a, a_scale, b, impl.block_scales_nk(b_scale), p.experts, p.rows)


BUILDERS = (bf16_loop, bf16_grouped, fp8_rowwise, fp8_blockwise_loop, our_kernel("pointer"), our_kernel("tma"),
            our_kernel("ws", 128), our_kernel("ws", 256), our_kernel("ws", 128, tma_store=False),
            our_kernel("ws", 256, tma_store=False), our_kernel("ws", 256, interleave_ffma=True), wgrad_x_blocks,
            deepgemm, ours)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()


def measure(build: Callable, p: Problem, gemm: str, backend: str, reference: Optional[torch.Tensor],
            iters: int, graphs: bool = False) -> tuple[str, Optional[float]]:
    """(cell, TFLOP/s or None) of one column for one GEMM."""
    try:
        fn = build(p, gemm, backend)
        out = fn()
        if isinstance(out, list):  # one output per expert
            out = torch.stack(out) if gemm == "wgrad" else torch.cat(out)
        if reference is not None and out.shape != reference.shape:
            return f"wrong: shape {tuple(out.shape)}", None
        if reference is not None and (err := relative_error(out, reference)) > WRONG:
            return f"wrong: relative error {err:.2f}", None
        del out
        tflops = p.flops / (graphed_ms(fn, iters) if graphs else timed_ms(fn, p.x.device, iters)) / 1e9
        return f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.3g}", tflops
    except NotApplicable:
        return "n/a", None
    except Exception as exc:  # noqa: BLE001 - a column that cannot run says why in its cell
        return error_cell(exc), None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: shapes {', '.join(QUICK_SHAPES)}, 5 iters")
    parser.add_argument("--shapes", nargs="+", default=None, help="EXPERTSxROWS,K,N each (default: issue 19's four)")
    parser.add_argument("--backend", default="cublas", help="the megafp8 FP8 backend of the 'ours' column")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 30; quick 5)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test of the table)")
    parser.add_argument("--columns", nargs="+", default=None,
                        help="measure only the columns whose label contains one of these (BF16 `_grouped_mm` and "
                             "the backend's default always run); the others print '-'")
    parser.add_argument("--gemms", nargs="+", choices=sorted(GEMM_KEYS), default=None,
                        help="measure only these rows (default all): fprop, dgrad, wgrad (BF16 out), into (the wgrad "
                             "added into FP32 main_grad), fp32 (the wgrad written in FP32 over main_grad)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="time replays of a CUDA graph of the calls (the median of five), not launches")
    args = parser.parse_args(argv)
    shapes = [parse_shape(s) for s in (args.shapes or (QUICK_SHAPES if args.quick else SHAPES))]
    iters = args.iters or (5 if args.quick else 30)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here (--device cpu runs a smoke test)")
    if args.cuda_graphs and device.type != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    if device.type == "cuda":
        timing = "replayed from CUDA graphs" if args.cuda_graphs else "launched from Python"
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {iters} iters {timing}, TFLOP/s\n")
    gemms = [g for g in GEMMS if args.gemms is None or g in {GEMM_KEYS[key] for key in args.gemms}]
    words = [w.lower() for w in args.columns or []]
    unknown = [w for w in words if not any(w in label.lower() for label in COLUMNS)]
    if unknown:
        parser.error(f"--columns {' '.join(unknown)}: no column's label contains it; the labels: {', '.join(COLUMNS)}")
    wanted = [i in ALWAYS or not words or any(w in label.lower() for w in words) for i, label in enumerate(COLUMNS)]
    print(markdown([], args.backend), flush=True)  # the header; each row prints as it is measured
    for experts, per_expert, k, n in shapes:
        p = make_problem(experts, per_expert, k, n, device)
        for gemm in gemms:
            reference = bf16_loop(p, gemm, args.backend)().clone()
            measured = [measure(build, p, gemm, args.backend, reference, iters, args.cuda_graphs) if want
                        else ("-", None) for build, want in zip(BUILDERS, wanted)]
            del reference
            row = (f"{experts} x {per_expert}, {k}, {n}", gemm, [cell for cell, _ in measured],
                   ratio_cell(measured[-1][1], measured[1][1]))
            print(markdown([row], args.backend).splitlines()[-1], flush=True)
        del p
    if device.type == "cuda":
        print_tuned_configs()


def print_tuned_configs() -> None:
    """The configuration the autotuner chose for each of our grouped kernels, per (N, K) it saw."""
    try:
        from megafp8.precision.kernels import gemm as kernels
        for name, kernel in sorted(vars(kernels).items()):
            for key, config in getattr(kernel, "cache", {}).items():
                print(f"- {name} {key[:2]}: {config}")
    except Exception as exc:  # noqa: BLE001 - Triton internals; the table above stands without this
        print(f"(no autotuner report: {error_cell(exc)})")


if __name__ == "__main__":
    main()
