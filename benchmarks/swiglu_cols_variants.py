#!/usr/bin/env python
"""SwiGLU backward's column outputs (d(gu)^T and a^T, quantized along the tokens): the Triton column kernel (what
GPUs other than SM90 run) against layouts of the Gluon kernel that SM90 runs
(`megafp8.precision.kernels.swiglu_cols_gluon`; its default is 8 tokens x 4 features a thread, 4 warps, reading gu
and da by TMA where the token count is a multiple of 8).

    PYTHONPATH=. python benchmarks/swiglu_cols_variants.py [--tokens 16384] [--iters 30]

First the bits: on an awkward shape (200 tokens, outliers, a nan) and on each timed shape, every Gluon variant's
FP8 values and scales must equal the Triton kernel's ("same bits" or the count of differing bytes). Then ms and
GB/s (gu and da read once, the three transposed FP8 outputs and their scales written once) at the ~1B and
8B-layer shapes, E4M3 values and E4M3 gradients.

A second table times SwiGLU's whole backward quantization as `producers.swiglu_backward_quantize` runs it on SM90,
the Triton row kernel then the TMA column kernel, against the two in one launch
(`swiglu_cols_gluon.swiglu_backward_rows_cols`, row and column programs of each 128-token block side by side, so
that one reads gu and da from HBM and the other from L2): the same bits first, then ms and GB/s by the bytes one
pass needs (gu and da read once, d(gu) both ways and a^T written once), at the two dense shapes and the MoE
experts' (`--moe-tokens` rows of F = 1,024: 131,072 routed rows and their padding).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.formats import E4M3, E5M2  # noqa: E402
from fused_quantize import differing_bytes, timed_ms, variant_benchmark_args  # noqa: E402  (benchmarks/, beside this file)

SHAPES = {"~1B": 5632, "8B-layers": 14336}  # F, SwiGLU's width
MOE_F = 1024  # the MoE model's expert width


def outputs(m: int, f: int, grad_fmt, device):
    from megafp8.precision.kernels import tiles
    qt, st = tiles.rows_cols_outputs(m, 2 * f, grad_fmt, device)[2:]
    at, ats = tiles.rows_cols_outputs(m, f, E4M3, device)[2:]
    for t in (qt, at):
        t.view(torch.uint8).fill_(0x55)  # poison: a byte left unwritten shows as a difference
    return qt, st, at, ats


def variants() -> dict:
    from megafp8.precision.kernels import producers, swiglu_cols_gluon
    out = {"triton (backends')": producers.swiglu_backward_cols}
    # The default layout reading gu and da with the threads' loads, and by TMA (what the backends run where the
    # token count is a multiple of 8); then other layouts' loads.
    for label, tma in (("loads", False), ("TMA", True)):
        out[f"gluon 8x4, {label}"] = (lambda *a, t=tma: swiglu_cols_gluon.swiglu_backward_cols(*a, use_tma=t))
    for tokens, features, warps in ((4, 8, 4), (4, 4, 4)):
        out[f"gluon {tokens}x{features}, {warps} warps"] = (
            lambda *a, t=tokens, f=features, w=warps: swiglu_cols_gluon.swiglu_backward_cols(
                *a, num_warps=w, tokens_each=t, features_each=f))
    return out


def inputs(m: int, f: int, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """gu (M, 2F) with features over four decades, and da (M, F), BF16; the 200-token check case holds a nan."""
    gu = (torch.randn(m, 2 * f, generator=g) * torch.logspace(-2, 2, 2 * f)).bfloat16().to(device)
    da = torch.randn(m, f, generator=g).bfloat16().to(device)
    if m == 200:
        gu[17, 3] = float("nan")
    return gu, da


def rows_cols_outputs(m: int, f: int, grad_fmt, device):
    """Poisoned outputs of SwiGLU's whole backward quantization: d(gu) both ways, then a^T."""
    from megafp8.precision.kernels import tiles
    q, s, qt, st = tiles.rows_cols_outputs(m, 2 * f, grad_fmt, device)
    at, ats = tiles.rows_cols_outputs(m, f, E4M3, device)[2:]
    for t in (q, qt, at):
        t.view(torch.uint8).fill_(0x55)
    return q, s, qt, st, at, ats


def rows_cols_table(tokens: int, moe_tokens: int, iters: int, device) -> None:
    """The second table: two kernels against one launch, bits then time."""
    from megafp8.precision.kernels import producers, swiglu_cols_gluon

    def two_kernels(gu, da, q, s, qt, st, at, ats, grad_fmt):
        producers.swiglu_backward_rows(gu, da, q, s, grad_fmt, False)
        swiglu_cols_gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, E4M3, grad_fmt, False)

    def one_launch(gu, da, q, s, qt, st, at, ats, grad_fmt):
        swiglu_cols_gluon.swiglu_backward_rows_cols(gu, da, q, s, qt, st, at, ats, E4M3, grad_fmt, False)

    runs = {"Triton rows + TMA columns (two kernels)": two_kernels, "one launch": one_launch}
    g = torch.Generator(device="cpu").manual_seed(1)
    cases = [("200 tokens, outliers, nan", 200, 256, E5M2)] + [(name, tokens, f, E4M3) for name, f in SHAPES.items()]
    cases.append(("MoE experts", moe_tokens, MOE_F, E4M3))
    print("\n| shape | " + " | ".join(runs) + " | one / two |\n|---|" + "---|" * (len(runs) + 1))
    for name, m, f, grad_fmt in cases:
        gu, da = inputs(m, f, g, device)
        want = rows_cols_outputs(m, f, grad_fmt, device)
        two_kernels(gu, da, *want, grad_fmt)
        cells, times = [], []
        for run in runs.values():
            got = rows_cols_outputs(m, f, grad_fmt, device)
            run(gu, da, *got, grad_fmt)
            bad = differing_bytes(got, want)
            if m == 200:
                cells.append("same bits" if not bad else f"{bad} bytes differ")
                continue
            ms = timed_ms(run, gu, da, *got, grad_fmt, iters=iters)
            times.append(ms)
            # gu, da read; d(gu) both ways and a^T written; scales: 2F/128 a token, 3F a 128-token block
            moved = 11 * m * f + (2 * f // 128 * m + 3 * f * (m // 128)) * 4
            differ = "" if not bad else f" ({bad} bytes differ)"
            cells.append(f"{ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s{differ}")
        ratio = f"{times[1] / times[0]:.3f}" if len(times) == 2 else "-"
        print(f"| {name}, {m} x F={f} | " + " | ".join(cells) + f" | {ratio} |", flush=True)


def main(argv=None) -> None:
    args, device = variant_benchmark_args(__doc__, argv, moe_tokens=True)
    runs = variants()
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [("200 tokens, outliers, nan", 200, 256, E5M2)] + [(name, args.tokens, f, E4M3)
                                                                for name, f in SHAPES.items()]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| shape | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
    for name, m, f, grad_fmt in cases:
        gu, da = inputs(m, f, g, device)
        want = outputs(m, f, grad_fmt, device)
        runs["triton (backends')"](gu, da, *want, E4M3, grad_fmt, False)
        cells = []
        for label, run in runs.items():
            try:
                got = outputs(m, f, grad_fmt, device)
                run(gu, da, *got, E4M3, grad_fmt, False)
                bad = differing_bytes(got, want)
                if m == 200:
                    cells.append("same bits" if not bad else f"{bad} bytes differ")
                    continue
                ms = timed_ms(run, gu, da, *got, E4M3, grad_fmt, False, iters=args.iters)
                moved = gu.numel() * 2 + da.numel() * 2 + 3 * m * f + 3 * f * (m // 128) * 4
                cells.append(f"{ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s" + ("" if not bad else f" ({bad} bytes differ)"))
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run says why in its cell
                cells.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}".replace("|", "/"))
        print(f"| {name}, F={f} | " + " | ".join(cells) + " |", flush=True)
    rows_cols_table(args.tokens, args.moe_tokens, args.iters, device)


if __name__ == "__main__":
    main()
