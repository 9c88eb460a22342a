#!/usr/bin/env python
"""A dense FP8 linear's three GEMMs (issue 18): cuBLAS against our warp-specialized kernel, and BF16.

    PYTHONPATH=. python benchmarks/dense_gemm.py [--model 1b 8b-layers linear] [--tokens 16384] [--iters 30]
                                                 [--backend cublas] [--device cuda] [--shapes N,K ...]
                                                 [--cuda-graphs] [--gemms fprop wgrad] [--columns "ws 256"]

Per linear (N output features, K input features) and M tokens (`--tokens` for the models' linears, 8192 for
`linear`, the shapes of `benchmarks/fp8_linear.py`; `--shapes` names others instead, at `--tokens`):

    fprop  y (M, N) = x (M, K) in 1x128 tiles @ w (N, K)^T in 128x128 blocks, BF16 out
    dgrad  dx (M, K) = dy (M, N) in 1x128 tiles @ w^T (K, N) in 128x128 blocks (the weight's transpose, made once)
    wgrad  main_grad (N, K) FP32 += dy^T @ x, both in 1x128 tiles along the tokens

each 2 M N K FLOPs. Operands are quantized beforehand by the cublas backend (what the FP8 linear hands its GEMMs);
only the GEMM is timed. Columns:

- BF16: `mm` for fprop and dgrad; for wgrad the BF16 recipe's GEMM adding into main_grad
  (`megafp8.precision.bf16_linear.accumulate_product_`).
- backend: `--backend`'s dense GEMMs; the cublas backend's (the default, and the hopper backend's) are
  `F.scaled_mm` with blockwise scaling and, for wgrad, cuBLASLt adding into main_grad in its epilogue.
- ws 128 / ws 256: the warp-specialized Gluon kernel (`megafp8.precision.kernels.ws_gemm`), 128- or 256-wide tiles,
  output tiles by TMA (wgrad: added into main_grad by TMA's reduction where this Triton builds it).
- ws 256, registers: the same kernel storing (or adding) from its registers.
- ws 256, interleaved FFMA: ws 256 with its promotion's FFMA runs interleaved in the cubin
  (`ws_gemm(interleave_ffma=True)`; the 1x128 x 1x128 wgrad has no such runs, so its cubin is unchanged).
- ws 256, interleaved FFMA, GROUP_M 16 / 32: the interleaved kernel (what the hopper backend runs, 8 row tiles a
  group) walking its output tiles in groups of 16 or 32 row tiles (`ws_gemm(group_m=...)`): the weight, streamed
  once per group (the 8B-layer gate/up's 117 MB of FP8 16 times per fprop at 16,384 tokens with groups of 8), is
  then read from HBM half or a quarter as often; the same bits.
- ws 256, x in 128x128 blocks (wgrad only; the opt-in `precision.fp8_wgrad_input_blocks`, not DeepSeek-V3's
  recipe): x^T quantized in 128 x 128 blocks (features x tokens, `quantize_rows_cols(cols_in_blocks=True)`) instead
  of 1x128 tiles along the tokens, so the kernel (`gemm.wgrad(b_blocks=True)`, what the hopper backend runs)
  promotes each K step as fprop does (one FFMA an element, the interleaved cubin) instead of forming the outer
  product of two scale vectors.
  Its output is checked against its own dequantized operands; what the coarser scaling costs in accuracy is
  `benchmarks/wgrad_scaling.py`'s question.
- DeepGEMM (a peer, not ours; left out of the ratio columns): DeepSeek's `deep_gemm.fp8_gemm_nt` on the same FP8
  operands, its 1D2D kernel for fprop and dgrad and its 1D1D kernel adding into main_grad for wgrad
  (`benchmarks/deepgemm_peer.py`; only where `import deep_gemm` works, its cell says why not elsewhere).

Timing: CUDA events around `--iters` calls after warm-up; the calls are launched from Python, so a GEMM shorter
than its launch path (the warp-specialized kernel builds TMA descriptors on the host) is timed at the host's pace.
`--gemms` and `--columns` keep some GEMMs and columns (with a short `--iters`, a clean launch sequence for Nsight
Compute: `benchmarks/gpu_e2e.sh ncu_ws`).
`--cuda-graphs` captures the `--iters` calls in one CUDA graph and times its replay: device time, as the training
step runs under `training.compile_mode: reduce-overhead`.

Cells: TFLOP/s (ms); the last two columns are the best FP8 column's ratio to the backend's and to BF16. Each output is
checked first against the FP32 product of the dequantized operands (BF16 columns: of the BF16 operands); relative
Frobenius error above 1/64 prints "wrong". A column that cannot run prints its error's first line (`--device cpu
--backend reference --tokens 256` runs the table as a smoke test: the warp-specialized columns say why not).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.backends import select_backend  # noqa: E402
from megafp8.precision.formats import E4M3  # noqa: E402
from grouped_gemm import graphed_ms, timed_ms  # noqa: E402  (benchmarks/, beside this file)
from wgrad_gemm import LINEARS, accumulated_result  # noqa: E402

LINEAR_SHAPES = [("fp8_linear", 18432, 7168), ("fp8_linear", 7168, 18432), ("fp8_linear", 4096, 4096),
                 ("fp8_linear", 7168, 2048)]  # benchmarks/fp8_linear.py's (M, K, N) at M = 8192, as (name, N, K)
GEMMS = ("fprop", "dgrad", "wgrad")
BLOCKS = "ws 256, x in 128x128 blocks"
GROUPED = {"ws 256, interleaved FFMA, GROUP_M 16": 16, "ws 256, interleaved FFMA, GROUP_M 32": 32}
FP8_COLUMNS = ("backend", "ws 128", "ws 256", "ws 256, registers", "ws 256, interleaved FFMA", *GROUPED, BLOCKS)
PEER = "DeepGEMM"  # a peer's kernels on the same operands: measured, not counted as ours in the ratio columns
ALL_COLUMNS = ("BF16", *FP8_COLUMNS, PEER)
WRONG = 2**-6

# (timed call, its result in FP32, the FP32 result it should give; None: the dequantized operands' product)
Column = tuple[Callable[[], object], Callable[[], torch.Tensor], Optional[Callable[[], torch.Tensor]]]


def operands(m: int, n: int, k: int, g: torch.Generator, backend_name: str) -> dict:
    """BF16 x (M, K), dy (M, N), w (N, K) and their FP8 forms as the backend makes them."""
    device = g.device
    backend = select_backend(backend_name, device)
    x = torch.randn(m, k, device=device, generator=g).bfloat16()
    dy = (torch.randn(m, n, device=device, generator=g) * 1e-3).bfloat16()
    w = (torch.randn(n, k, device=device, generator=g) * k ** -0.5).bfloat16()
    xq, xs, xtq, xts = backend.quantize_rows_cols(x, E4M3, False)
    dyq, dys, dytq, dyts = backend.quantize_rows_cols(dy, E4M3, False)
    qw = backend.empty_weight(w.shape, E4M3, w.device)
    backend.quantize_weight_(w, qw, E4M3, False)
    return dict(backend=backend, x=x, dy=dy, w=w, xq=xq, xs=xs, xtq=xtq, xts=xts, dyq=dyq, dys=dys, dytq=dytq,
                dyts=dyts, qw=qw)


def fp8_inputs(gemm: str, o: dict) -> tuple:
    """(a, a_scale, b, b_scale, b in blocks?) for one GEMM: b_scale (rows, K/128), or a weight's block scales in
    the layout the backend's GEMM reads (`block_scales_nk` views them as (N/128, K/128))."""
    qw = o["qw"]
    if gemm == "fprop":
        return o["xq"], o["xs"], qw.w_fp8, qw.w_scale, True
    if gemm == "dgrad":
        return o["dyq"], o["dys"], qw.wt_fp8, qw.wt_scale, True
    return o["dytq"], o["dyts"], o["xtq"], o["xts"], False


def reference(gemm: str, o: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP32 product of the BF16 operands, of the dequantized FP8 operands)."""
    from megafp8.precision import quantize as ref
    a, a_s, b, b_s, blocks = fp8_inputs(gemm, o)
    bf16 = {"fprop": lambda: o["x"].float() @ o["w"].float().t(), "dgrad": lambda: o["dy"].float() @ o["w"].float(),
            "wgrad": lambda: o["dy"].float().t() @ o["x"].float()}[gemm]()
    b32 = ref.dequantize_128x128(b, o["backend"].block_scales_nk(b_s)) if blocks else ref.dequantize_1x128(b, b_s)
    return bf16, ref.dequantize_1x128(a, a_s) @ b32.t()


def _sm90_only(module: str, name: str) -> Callable:
    """`megafp8.precision.kernels.<module>.<name>`, imported when called (it needs Triton's Gluon and a GPU; off one
    its cells say so)."""
    def call(*args, **kwargs):
        if args[0].device.type != "cuda":
            raise RuntimeError("the warp-specialized kernel needs an SM90 GPU")
        return getattr(importlib.import_module(f"megafp8.precision.kernels.{module}"), name)(*args, **kwargs)
    return call


def peer_column(gemm: str, *operands: torch.Tensor) -> Callable[[], torch.Tensor]:
    """DeepGEMM's GEMM on these operands (`deepgemm_peer.dense`), built when first called, so that a machine without
    DeepGEMM prints why in the cell."""
    built: list[Callable[[], torch.Tensor]] = []

    def run():
        if not built:
            from deepgemm_peer import dense  # benchmarks/, beside this file
            built.append(dense(gemm, *operands))
        return built[0]()
    return run


def columns(gemm: str, o: dict, wanted: tuple[str, ...] = ALL_COLUMNS) -> dict[str, Column]:
    """label -> (timed call, FP32 result) for one GEMM of one shape, the `wanted` columns."""
    from megafp8.precision.bf16_linear import accumulate_product_

    ws_gemm, wgrad = _sm90_only("ws_gemm", "ws_gemm"), _sm90_only("gemm", "wgrad")
    backend = o["backend"]
    a, a_s, b, b_s, blocks = fp8_inputs(gemm, o)
    rows, cols, device = a.shape[0], b.shape[0], a.device
    wants: dict[str, Callable[[], torch.Tensor]] = {}
    if gemm == "wgrad":
        main_grad = torch.zeros(rows, cols, dtype=torch.float32, device=device)

        def result_of(run):
            return accumulated_result(main_grad, run)

        def bf16():
            accumulate_product_(main_grad, o["dy"].t(), o["x"])

        def by_backend():
            backend.gemm_1x128_1x128_accumulate_(main_grad, a, a_s, b, b_s)

        def ws(block_n, tma, interleave=False, group_m=8):
            return lambda: ws_gemm(a, a_s, b, b_s, main_grad, b_blockwise=False, accumulate=True, block_n=block_n,
                                   tma_store=tma, interleave_ffma=interleave, group_m=group_m)
        runs = {"BF16": bf16, "backend": by_backend}
        if PEER in wanted:
            runs[PEER] = peer_column("wgrad", a, a_s, b, b_s, main_grad)
        if BLOCKS in wanted:  # as the hopper backend runs it under `precision.fp8_wgrad_input_blocks`
            xt, xt_s = backend.quantize_rows_cols(o["x"], E4M3, False, cols_in_blocks=True)[2:]
            runs[BLOCKS] = lambda: wgrad(a, a_s, xt, xt_s, torch.float32, accumulate=main_grad, b_blocks=True)

            def blocks_want():
                from megafp8.precision import quantize as ref
                return ref.dequantize_1x128(a, a_s) @ ref.dequantize_along_tokens(xt, xt_s).t()
            wants[BLOCKS] = blocks_want
    else:
        bf16_a, bf16_b = (o["x"], o["w"].t()) if gemm == "fprop" else (o["dy"], o["w"])
        out = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)

        def result_of(run):
            return lambda: run().float()

        def by_backend():
            return backend.gemm_1x128_128x128(a, a_s, b, b_s, torch.bfloat16)

        def ws(block_n, tma, interleave=False, group_m=8):
            return lambda: ws_gemm(a, a_s, b, backend.block_scales_nk(b_s), out, b_blockwise=True, block_n=block_n,
                                   tma_store=tma, interleave_ffma=interleave, group_m=group_m)
        runs = {"BF16": lambda: bf16_a @ bf16_b, "backend": by_backend, BLOCKS: None}  # BLOCKS: wgrad only
        if PEER in wanted:
            runs[PEER] = peer_column(gemm, a, a_s, b, backend.block_scales_nk(b_s), out)
    runs.update({"ws 128": ws(128, None), "ws 256": ws(256, None), "ws 256, registers": ws(256, False),
                 "ws 256, interleaved FFMA": ws(256, None, interleave=True)})
    runs.update({label: ws(256, None, interleave=True, group_m=g) for label, g in GROUPED.items()})
    return {label: (runs[label], runs[label] and result_of(runs[label]), wants.get(label)) for label in wanted}


def measure(gemm: str, o: dict, m: int, n: int, k: int, iters: int, graphs: bool = False,
            wanted: tuple[str, ...] = ALL_COLUMNS) -> list[str]:
    """The row's cells: each wanted column's TFLOP/s (ms), then best FP8 / the backend's and best FP8 / BF16."""
    want_bf16, want_fp8 = reference(gemm, o)
    cells, ms_of = [], {}
    for label, (run, result, own_want) in columns(gemm, o, wanted).items():
        if run is None:
            cells.append("n/a")
            continue
        try:
            want = want_bf16 if label == "BF16" else own_want() if own_want else want_fp8
            err = float((result() - want).norm() / want.norm())
            if err > WRONG:
                cells.append(f"wrong ({err:.3f})")
                continue
            ms = graphed_ms(run, iters) if graphs else timed_ms(run, o["x"].device, iters)
        except Exception as exc:  # noqa: BLE001 - a column that cannot run says why
            cells.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}".replace("|", "/"))
            continue
        ms_of[label] = ms
        cells.append(f"{2 * m * n * k / ms / 1e9:.0f} ({ms:.3f})")
    best = min((ms_of[c] for c in FP8_COLUMNS if c in ms_of), default=None)
    for base in ("backend", "BF16"):
        cells.append(f"{ms_of[base] / best:.2f}x" if best and base in ms_of else "-")
    return cells


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=[*LINEARS, "linear"], choices=[*LINEARS, "linear"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--backend", default="cublas", help="whose dense GEMMs the backend column times")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", metavar="N,K", help="these linears instead of --model's")
    parser.add_argument("--cuda-graphs", action="store_true", help="time replays of a CUDA graph of the calls")
    parser.add_argument("--gemms", nargs="+", default=list(GEMMS), choices=GEMMS, help="these GEMMs only")
    parser.add_argument("--columns", nargs="+", default=list(ALL_COLUMNS), choices=ALL_COLUMNS,
                        help="these columns only")
    args = parser.parse_args(argv)
    wanted = tuple(c for c in ALL_COLUMNS if c in args.columns)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("needs an SM90 GPU (cuBLAS's blockwise FP8 GEMMs and the warp-specialized kernel)")
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if args.cuda_graphs and device.type != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    timing = "replayed from CUDA graphs" if args.cuda_graphs else "launched from Python"
    print(f"{name}, torch {torch.__version__}, the {args.backend} backend, {timing}; TFLOP/s (ms)\n")
    labels = [f"{args.backend} backend" if c == "backend" else c for c in wanted]
    header = ["model", "linear (N x K)", "M", "GEMM", *labels, "best FP8 / backend", "best FP8 / BF16"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    tables = {model: None for model in args.model}
    if args.shapes:
        try:
            pairs = [tuple(map(int, text.split(","))) for text in args.shapes]
            if any(len(pair) != 2 for pair in pairs):  # (one number, or three, unpacked badly after the header)
                raise ValueError
            tables = {"--shapes": [("linear", *pair) for pair in pairs]}
        except ValueError:
            parser.error(f"--shapes takes N,K pairs of integers, e.g. 4096,4096 (got {' '.join(args.shapes)})")
    for model, given in tables.items():
        shapes, m = (given, args.tokens) if given else \
            (LINEAR_SHAPES, min(8192, args.tokens)) if model == "linear" else (LINEARS[model], args.tokens)
        for name, n, k in shapes:
            o = operands(m, n, k, g, args.backend)
            for gemm in (g for g in GEMMS if g in args.gemms):
                cells = measure(gemm, o, m, n, k, args.iters, args.cuda_graphs, wanted)
                print(f"| {model} | {name} ({n} x {k}) | {m} | {gemm} | " + " | ".join(cells) + " |", flush=True)
            del o


if __name__ == "__main__":
    main()
