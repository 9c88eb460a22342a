#!/usr/bin/env python
"""The row + column quantizer, its gathering form (the MoE dispatch) and RMSNorm's producer tiles: the Triton
kernels (what GPUs other than SM90 run) against the Gluon kernel that SM90 runs
(`megafp8.precision.kernels.rows_cols_gluon`), with three ways of sharing out its divisions.

    PYTHONPATH=. python benchmarks/rows_cols_variants.py [--tokens 16384] [--iters 30]

First the bits: on awkward shapes (200 tokens, outliers, a nan; gathered: each token in 4 padded rows, some of them
padding) and on each timed shape, every Gluon variant's FP8 values and scales must equal the Triton kernel's
("same bits" or the count of differing bytes). Then ms of device time (calls replayed from a CUDA graph, as under
`compile_mode: reduce-overhead`) and GB/s (x read once, both FP8 layouts and their scales written once; RMSNorm's
rstd computed beforehand, not timed), with the ms of back-to-back eager launches in brackets (the host's launch
cost shows there when it exceeds the kernel's), at the ~1B and 8B-layer shapes of dy and of the
norms' inputs, for a top-4 dispatch of 16,384 tokens of width 2048 in random order, and for the MoE benchmark
model's dispatch as its layer lays it out: 16,384 tokens each in 8 of 64 experts, sorted by expert, each expert's
rows padded to 128, the layout as long as `expert_rows` makes it without a host sync (139,136 rows). The column
"token blocks first" runs the Gluon kernel with its grid walking the token blocks first (`launch(rows_first=True)`).
Last, BF16's dispatch of the same layout's rows (unpadded, as the BF16 experts take them): `index_select` (what it
runs by default) against `permute_kernels.gather_rows` walking the row blocks first and each block's features
first (`permute.GATHER_ROWS_BY_BLOCKS`), ms of device time and GB/s (read once, written once); the copies must
equal `index_select`'s.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.formats import E4M3, E5M2  # noqa: E402
# benchmarks/, beside this file
from fused_quantize import (differing_bytes, graphed_ms, poisoned_rows_cols_outputs as outputs,  # noqa: E402
                            rows_cols_bytes, timed_ms, variant_benchmark_args)
from gather_l2_model import expert_layout_index  # noqa: E402

SHAPES = [("dy", "~1B", 6144), ("dy", "~1B", 2048), ("dy", "~1B", 11264), ("dy", "8B-layers", 12288),
          ("dy", "8B-layers", 28672), ("rmsnorm", "~1B", 2048), ("rmsnorm", "8B-layers", 4096),
          ("gather", "MoE dispatch, top-4 of the tokens", 2048), ("moe_layout", "MoE expert layout, top-8 of 64", 2048)]
TOP_K = 4  # the gathering case: every token in TOP_K padded rows, 1/32 of the rows padding (index -1)
EXPERTS, EXPERT_TOP_K = 64, 8  # the MoE layout case (`train_step.py --model moe`)


def triton_rows_cols(x, rstd, weight, index, out, fmt, pow2) -> None:
    from megafp8.precision.kernels import quantize
    quantize.launch_rows_cols_triton(x, rstd, weight, out, fmt, pow2, index=index)


def variants() -> dict:
    from megafp8.precision.kernels import rows_cols_gluon
    out = {"triton (before)": triton_rows_cols}
    for rows, cols in ((True, True), (False, True), (False, False)):
        label = "gluon, divisions shared out: " + {(True, True): "rows and columns", (False, True): "columns",
                                                   (False, False): "none"}[rows, cols]
        out[label] = (lambda x, rstd, w, index, o, fmt, pow2, r=rows, c=cols: rows_cols_gluon.launch(
            x, rstd, w, o, fmt, pow2, spread_rows=r, spread_cols=c, index=index, rows_first=False))
    out["gluon, token blocks first"] = (lambda x, rstd, w, index, o, fmt, pow2: rows_cols_gluon.launch(
        x, rstd, w, o, fmt, pow2, index=index, rows_first=True))
    return out


def gather_index(tokens: int, g: torch.Generator) -> torch.Tensor:
    """Padded rows for the gathering case: each token TOP_K times in a random order, with padding rows (-1)."""
    rows = torch.arange(tokens * TOP_K) % tokens
    rows = rows[torch.randperm(rows.numel(), generator=g)]
    rows[torch.randperm(rows.numel(), generator=g)[: rows.numel() // 32]] = -1
    return rows


def moe_layout_index(tokens: int) -> torch.Tensor:
    """The MoE dispatch's gather map as the layer makes it (`gather_l2_model.expert_layout_index`: EXPERT_TOP_K of
    EXPERTS experts a token at random, sorted by expert, each expert padded to 128, the layout at its bound)."""
    return expert_layout_index(tokens, EXPERTS, EXPERT_TOP_K)


def main(argv=None) -> None:
    args, device = variant_benchmark_args(__doc__, argv)
    runs = variants()
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [(kind, "200 tokens, outliers, nan", 200, 384, fmt, pow2) for kind in ("dy", "rmsnorm", "gather")
             for fmt, pow2 in ((E4M3, False), (E5M2, True))]
    cases += [(kind, name, args.tokens, k, E4M3, False) for kind, name, k in SHAPES]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| input | shape | " + " | ".join(runs) + " |\n|---|---|" + "---|" * len(runs))
    for kind, name, tokens, k, fmt, pow2 in cases:
        x = (torch.randn(tokens, k, generator=g) * torch.logspace(-2, 2, k)).bfloat16().to(device)
        if tokens == 200:
            x[17, 3] = float("nan")
        rstd = weight = index = None
        if kind == "rmsnorm":
            rstd = torch.rsqrt(x.float().pow(2).mean(1) + 1e-5)
            weight = (torch.rand(k, generator=g) + 0.5).bfloat16().to(device)
        if kind == "gather":
            index = gather_index(tokens, g).to(device)
        if kind == "moe_layout":
            index = moe_layout_index(tokens).to(device)
        m = tokens if index is None else index.shape[0]
        want = outputs(m, k, fmt, device)
        triton_rows_cols(x, rstd, weight, index, want, fmt, pow2)
        cells = []
        for label, run in runs.items():
            try:
                got = outputs(m, k, fmt, device)
                run(x, rstd, weight, index, got, fmt, pow2)
                bad = differing_bytes(got, want)
                if tokens == 200:
                    cells.append("same bits" if not bad else f"{bad} bytes differ")
                    continue
                launched = timed_ms(run, x, rstd, weight, index, got, fmt, pow2, iters=args.iters)
                ms = graphed_ms(run, x, rstd, weight, index, got, fmt, pow2, iters=args.iters)
                moved = 2 * m * k + rows_cols_bytes(m, k)
                cells.append(f"{ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s ({launched:.3f})"
                             + ("" if not bad else f" ({bad} bytes differ)"))
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run says why in its cell
                cells.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}".replace("|", "/"))
        label = f"{name}, {'E5M2 pow2' if pow2 else fmt.name}" if tokens == 200 else name
        print(f"| {kind} | {label}, {m}x{k} | " + " | ".join(cells) + " |", flush=True)
    print("\n" + bf16_dispatch(args.tokens, 2048, args.iters, device, g))


def bf16_dispatch(tokens: int, k: int, iters: int, device: torch.device, g: torch.Generator) -> str:
    """BF16's dispatch gather of the MoE layout's rows, three ways (the module docstring), as a Markdown table."""
    from megafp8.parallel import permute_kernels
    x = torch.randn(tokens, k, generator=g).bfloat16().to(device)
    index = moe_layout_index(tokens)
    index = index[index >= 0].to(device)  # the rows sorted by expert, unpadded
    want = x.index_select(0, index)
    runs = {"`index_select`": lambda: x.index_select(0, index),
            "gather_rows, row blocks first": lambda: permute_kernels.gather_rows(x, index, rows_first=True),
            "gather_rows, features first": lambda: permute_kernels.gather_rows(x, index, rows_first=False)}
    cells = []
    for run in runs.values():
        same = torch.equal(run(), want)
        ms = graphed_ms(run, iters=iters)
        cells.append(f"{ms:.3f} ms, {2 * want.numel() * 2 / ms / 1e6:.0f} GB/s" + ("" if same else " (WRONG)"))
    return ("| BF16 dispatch, MoE expert layout | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs) + "\n"
            + f"| {index.numel()}x{k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
