#!/usr/bin/env python
"""The FP8 producers' quantizing kernels of one 8B-layer step, each launched twice (a warm-up, then the one to read)
at that step's shapes (16,384 tokens): RoPE's backward quantizer (dq, dk, dv of 4,096 features each), SwiGLU's
backward (gu 28,672 and da 14,336 features: the Triton row kernel, then the column kernel, which reads by TMA;
`swiglu_loads`: the column kernel alone reading with the threads' loads) and the row + column quantizer of a
4,096-wide dy. For Nsight Compute, which times and analyses each launch alone, e.g.

    PYTHONPATH=. ncu --kernel-name regex:"gluon|swiglu_backward" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section MemoryWorkloadAnalysis python benchmarks/producer_kernels.py

`--kernels` picks some of them.
"""
from __future__ import annotations

import argparse

import torch

TOKENS, HEAD_DIM, SEQ_LEN = 16384, 128, 4096
WIDTH, FFN = 4096, 14336


def main(argv=None) -> None:
    from megafp8.model.rope import RotaryEmbedding
    from megafp8.precision.formats import E4M3
    from megafp8.precision.kernels import producers, quantize
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=["rope", "swiglu", "dy"],
                        choices=["rope", "swiglu", "swiglu_loads", "dy"])
    args = parser.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").bfloat16()
    runs = {}
    if "rope" in args.kernels:
        rope = RotaryEmbedding(HEAD_DIM, SEQ_LEN, 10000.0, device="cuda")
        grads = [randn(TOKENS, WIDTH) for _ in range(3)]
        runs["rope"] = lambda: producers.rope_backward_quantize(*grads, rope.cos, rope.sin, SEQ_LEN, HEAD_DIM, E4M3,
                                                                False)
    if "swiglu" in args.kernels:
        gu, da = randn(TOKENS, 2 * FFN), randn(TOKENS, FFN)
        runs["swiglu"] = lambda: producers.swiglu_backward_quantize(gu, da, E4M3, E4M3, False)
    if "swiglu_loads" in args.kernels:
        from megafp8.precision.kernels import swiglu_cols_gluon, tiles
        gu, da = randn(TOKENS, 2 * FFN), randn(TOKENS, FFN)
        qt, st = tiles.rows_cols_outputs(TOKENS, 2 * FFN, E4M3, gu.device)[2:]
        at, ats = tiles.rows_cols_outputs(TOKENS, FFN, E4M3, gu.device)[2:]
        runs["swiglu_loads"] = lambda: swiglu_cols_gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, E4M3, E4M3,
                                                                              False, use_tma=False)
    if "dy" in args.kernels:
        dy = randn(TOKENS, WIDTH)
        runs["dy"] = lambda: quantize.quantize_rows_cols(dy, E4M3, False)
    for name, run in runs.items():
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        print(name, "ran", flush=True)


if __name__ == "__main__":
    main()
