#!/usr/bin/env python
"""SwiGLU backward's producer (`producers.swiglu_backward_quantize`: d(gu) quantized both ways, a^T along the
tokens): the Triton row kernel + Gluon column kernel pair against layouts of the one-pass Gluon kernel
(`megafp8.precision.kernels.rows_cols_gluon.swiglu_backward`), on SM90.

    PYTHONPATH=. python benchmarks/swiglu_backward_variants.py [--tokens 16384] [--iters 30]

First the bits: on an awkward shape (200 tokens, outliers, a nan) and on each timed shape, every variant's six
outputs (FP8 values and scales) must equal the pair's ("same bits" or the count of differing bytes). Then device
time per call under a CUDA graph and GB/s (gu and da read once; d(gu) both ways, a^T and their scales written
once) at the MoE model's expert shape (`train_step.py --model moe`: 16,384 tokens x top-8 expert rows, F=1024),
and the ~1B and 8B-layer dense shapes (`--tokens` tokens).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.formats import E4M3, E5M2  # noqa: E402
from fused_quantize import differing_bytes, graphed_ms, variant_benchmark_args  # noqa: E402  (benchmarks/)

LAYOUTS = [(8, 8, 8), (8, 16, 4), (16, 8, 4)]  # warps, tokens and features a thread


def outputs(m: int, f: int, grad_fmt, device) -> tuple:
    from megafp8.precision.kernels import tiles
    out = tiles.rows_cols_outputs(m, 2 * f, grad_fmt, device)
    at, ats = tiles.rows_cols_outputs(m, f, E4M3, device)[2:]
    for t in (out[0], out[2], at):
        t.view(torch.uint8).fill_(0x55)  # poison: a byte left unwritten shows as a difference
    return (*out, at, ats)


def variants() -> dict:
    from megafp8.precision.kernels import producers, rows_cols_gluon

    def pair(gu, da, q, s, qt, st, at, ats, fmt, grad_fmt, pow2):
        producers.swiglu_backward_rows(gu, da, q, s, grad_fmt, pow2)
        producers.swiglu_backward_cols(gu, da, qt, st, at, ats, fmt, grad_fmt, pow2)
    runs = {"Triton rows + Triton cols": pair}
    try:
        from megafp8.precision.kernels import swiglu_cols_gluon

        def gluon_pair(gu, da, q, s, qt, st, at, ats, fmt, grad_fmt, pow2):
            producers.swiglu_backward_rows(gu, da, q, s, grad_fmt, pow2)
            swiglu_cols_gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, fmt, grad_fmt, pow2)
        runs["Triton rows + Gluon cols (before)"] = gluon_pair
    except ImportError:
        pass
    for layout in LAYOUTS:
        runs[f"one pass, {layout[0]} warps, {layout[1]}x{layout[2]}"] = (
            lambda gu, da, q, s, qt, st, at, ats, fmt, grad_fmt, pow2, lay=layout: rows_cols_gluon.swiglu_backward(
                gu, da, (q, s, qt, st), at, ats, fmt, grad_fmt, pow2, layout=lay))
    return runs


def main(argv=None) -> None:
    args, device = variant_benchmark_args(__doc__, argv)
    runs = variants()
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [("200 tokens, outliers, nan", 200, 256, E5M2), ("MoE experts", args.tokens * 8, 1024, E4M3),
             ("~1B", args.tokens, 5632, E4M3), ("8B-layers", args.tokens, 14336, E4M3)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| shape | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
    reference = next(iter(runs.values()))
    for name, m, f, grad_fmt in cases:
        gu = (torch.randn(m, 2 * f, generator=g) * torch.logspace(-2, 2, 2 * f)).bfloat16().to(device)
        da = torch.randn(m, f, generator=g).bfloat16().to(device)
        if m == 200:
            gu[17, 3] = float("nan")
        want = outputs(m, f, grad_fmt, device)
        reference(gu, da, *want, E4M3, grad_fmt, False)
        cells = []
        for label, run in runs.items():
            try:
                got = outputs(m, f, grad_fmt, device)
                run(gu, da, *got, E4M3, grad_fmt, False)
                bad = differing_bytes(got, want)
                if m == 200:
                    cells.append("same bits" if not bad else f"{bad} bytes differ")
                    continue
                ms = graphed_ms(run, gu, da, *got, E4M3, grad_fmt, False, iters=args.iters)
                moved = gu.numel() * 2 + da.numel() * 2 + 5 * m * f + 5 * f * (m // 128) * 4
                cells.append(f"{ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s" + ("" if not bad else f" ({bad} bytes differ)"))
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run says why in its cell
                cells.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}".replace("|", "/"))
        print(f"| {name}, {m} x F={f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
