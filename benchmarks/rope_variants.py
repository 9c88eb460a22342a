#!/usr/bin/env python
"""RoPE's backward quantizer (the QKV projection's output gradient [RoPE^T(dq) | RoPE^T(dk) | dv], quantized both
ways from FP32): the Triton kernel (what GPUs other than SM90 run) against the Gluon kernel that SM90 runs
(`megafp8.precision.kernels.rows_cols_gluon.launch_rope_backward`), in two thread layouts.

    PYTHONPATH=. python benchmarks/rope_variants.py [--tokens 16384] [--iters 30]

First the bits: on awkward shapes (200 tokens in sequences of 64: a partial last tile; heads of 128 and of 64;
outliers) and on each timed shape, every Gluon variant's FP8 values and scales must equal the Triton kernel's
("same bits" or the count of differing bytes). Then ms of device time (calls replayed from a CUDA graph, as under
`compile_mode: reduce-overhead`) and GB/s (dq, dk and dv read once, both FP8 layouts and their scales written once;
the RoPE tables, read from L2, not counted), with the ms of back-to-back eager launches in brackets, at the ~1B
(16 heads of 128, sequences of 2048) and 8B-layer (32 heads of 128, sequences of 4096) shapes.
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

SHAPES = [("~1B", 2048, 128, 2048), ("8B-layers", 4096, 128, 4096)]  # (name, width of q, k, v each, head, seq_len)
LAYOUTS = [(16, 4), (8, 8)]  # (tokens a thread, warps) of the Gluon kernel; features a thread: 8


def variants() -> dict:
    from megafp8.precision.kernels import producers, rows_cols_gluon
    out = {"triton (before)": producers.launch_rope_backward_triton}
    for tokens_each, warps in LAYOUTS:
        out[f"gluon, {tokens_each} tokens x 8 features a thread, {warps} warps"] = (
            lambda *a, t=tokens_each, w=warps: rows_cols_gluon.launch_rope_backward(*a, tokens_each=t, num_warps=w))
    return out


def main(argv=None) -> None:
    from megafp8.model.rope import RotaryEmbedding
    args, device = variant_benchmark_args(__doc__, argv)
    runs = variants()
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [(f"200 tokens, heads of {head}", 200, width, head, 64, fmt, pow2)
             for head, width in ((128, 256), (64, 128)) for fmt, pow2 in ((E4M3, False), (E5M2, True))]
    cases += [(name, args.tokens, width, head, seq, E4M3, False) for name, width, head, seq in SHAPES]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| shape | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
    for name, m, width, head, seq, fmt, pow2 in cases:
        rope = RotaryEmbedding(head, seq, 10000.0, device=device)
        dq, dk, dv = ((torch.randn(m, width, generator=g) * torch.logspace(-2, 2, width)).bfloat16().to(device)
                      for _ in range(3))
        inputs = (dq, dk, dv, rope.cos, rope.sin, seq, head)
        want = outputs(m, 3 * width, fmt, device)
        runs["triton (before)"](*inputs, want, fmt, pow2)
        cells = []
        for label, run in runs.items():
            try:
                got = outputs(m, 3 * width, fmt, device)
                run(*inputs, got, fmt, pow2)
                bad = differing_bytes(got, want)
                if m == 200:
                    cells.append("same bits" if not bad else f"{bad} bytes differ")
                    continue
                launched = timed_ms(run, *inputs, got, fmt, pow2, iters=args.iters)
                ms = graphed_ms(run, *inputs, got, fmt, pow2, iters=args.iters)
                moved = 2 * m * 3 * width + rows_cols_bytes(m, 3 * width)
                cells.append(f"{ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s ({launched:.3f})"
                             + ("" if not bad else f" ({bad} bytes differ)"))
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run says why in its cell
                cells.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}".replace("|", "/"))
        label = f"{name}, {'E5M2 pow2' if pow2 else fmt.name}" if m == 200 else f"{name}, {m}x{3 * width}"
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
