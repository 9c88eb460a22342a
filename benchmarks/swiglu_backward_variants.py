#!/usr/bin/env python
"""SwiGLU's whole backward quantizer (d(gu) along the features, d(gu)^T and a^T along the tokens): the two kernels
SM90 runs today (the Triton row kernel, then the Gluon column kernel) against layouts of the one-pass Gluon kernel
(`megafp8.precision.kernels.swiglu_backward_gluon`).

    PYTHONPATH=. python benchmarks/swiglu_backward_variants.py [--tokens 16384] [--iters 30]

First the bits: on an awkward shape (200 tokens, outliers, a nan, E5M2 gradients) and on each timed shape, every
variant's FP8 values and scales must equal the two kernels' ("same bits", or the count of differing bytes). Then ms
and GB/s (gu and da read once; d(gu) twice, a^T once and their scales written once) at the ~1B, 8B-layer and MoE
experts' shapes (the experts' rows: 8 of each token's 16,384 tokens of 2,048 at F=1,024).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.formats import E4M3, E5M2  # noqa: E402
from fused_quantize import differing_bytes, timed_ms, variant_benchmark_args  # noqa: E402  (benchmarks/, beside this file)

SHAPES = {"~1B": (1, 5632), "8B-layers": (1, 14336), "MoE experts": (8, 1024)}  # (rows per token, F)
LAYOUTS = ((8, 8, 8), (8, 4, 16))  # tokens x features a thread, warps


def outputs(m: int, f: int, grad_fmt, device):
    from megafp8.precision.kernels import tiles
    out = tiles.rows_cols_outputs(m, 2 * f, grad_fmt, device)
    at, ats = tiles.rows_cols_outputs(m, f, E4M3, device)[2:]
    for t in (out[0], out[2], at):
        t.view(torch.uint8).fill_(0x55)  # poison: a byte left unwritten shows as a difference
    return (*out, at, ats)


def two_kernels(gu, da, q, s, qt, st, at, ats, grad_fmt):
    from megafp8.precision.kernels import producers, swiglu_cols_gluon
    producers.swiglu_backward_rows(gu, da, q, s, grad_fmt, False)
    swiglu_cols_gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, E4M3, grad_fmt, False)


def variants() -> dict:
    from megafp8.precision.kernels import swiglu_backward_gluon as fused
    out = {"rows (Triton) + columns (Gluon)": two_kernels}
    for tokens, features, warps in LAYOUTS:
        out[f"one pass {tokens}x{features}, {warps} warps"] = (
            lambda gu, da, q, s, qt, st, at, ats, grad_fmt, t=tokens, f=features, w=warps: fused.swiglu_backward(
                gu, da, (q, s, qt, st), at, ats, E4M3, grad_fmt, False, tokens_each=t, features_each=f, num_warps=w))
    return out


def main(argv=None) -> None:
    args, device = variant_benchmark_args(__doc__, argv)
    runs = variants()
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [("200 tokens, outliers, nan", 200, 256, E5M2)] + [(name, args.tokens * per, f, E4M3)
                                                                for name, (per, f) in SHAPES.items()]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| shape | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
    for name, m, f, grad_fmt in cases:
        gu = (torch.randn(m, 2 * f, generator=g) * torch.logspace(-2, 2, 2 * f)).bfloat16().to(device)
        da = torch.randn(m, f, generator=g).bfloat16().to(device)
        if m == 200:
            gu[17, 3] = float("nan")
        want = outputs(m, f, grad_fmt, device)
        two_kernels(gu, da, *want, grad_fmt)
        cells = []
        for label, run in runs.items():
            try:
                got = outputs(m, f, grad_fmt, device)
                run(gu, da, *got, grad_fmt)
                bad = differing_bytes(got, want)
                if m == 200:
                    cells.append("same bits" if not bad else f"{bad} bytes differ")
                    continue
                ms = timed_ms(run, gu, da, *got, grad_fmt, iters=args.iters)
                moved = gu.numel() * 2 + da.numel() * 2 + 5 * m * f + 5 * f * (m // 128) * 4
                cells.append(f"{ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s" + ("" if not bad else f" ({bad} bytes differ)"))
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run says why in its cell
                cells.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}".replace("|", "/"))
        print(f"| {name}, {m} x F={f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
