#!/usr/bin/env python
"""Can torch.compile (Inductor) generate our per-tile quantizers, and fuse them into the op before them?

For each case, times (a) the eager producer (RMSNorm, SwiGLU, or nothing) followed by our Triton quantizer and
(b) the same producer and the pure-torch reference quantizer compiled together into Inductor kernels, and says
whether (b)'s FP8 bytes and scales equal the reference quantizer's on the same producer output, bit for bit.

    PYTHONPATH=. python benchmarks/fused_quantize.py [--tokens 16384]

The output gradient's two quantizations run either as one fused kernel (`quantize_both`) or as two (rows, then
columns, what the backends use); both are timed. A second table times each configuration of the fused kernel on
the ~1B model's output-gradient widths, as GB/s of bytes moved (2 read + 2 written per element), and the
configuration the autotuner picks, with the FP8 rounding done explicitly in FP32 (the default) or
by the conversion instruction alone.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision import quantize as ref  # noqa: E402
from megafp8.precision.formats import FORMATS  # noqa: E402

E4M3 = FORMATS["e4m3"]


def timed_ms(fn, *args, iters: int = 30) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def same(a: tuple, b: tuple) -> str:
    """'yes' when every tensor pair is bitwise equal, else the share of differing FP8 bytes."""
    diffs = [(x.view(torch.uint8) != y.view(torch.uint8)).float().mean().item() if x.dtype == E4M3.dtype
             else float(not torch.equal(x, y)) for x, y in zip(a, b)]
    return "yes" if not any(diffs) else "no (" + ", ".join(f"{d:.2e}" for d in diffs) + " differ)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    m, dev = args.tokens, torch.device("cuda")
    from megafp8.precision import triton_kernels as tk

    torch.manual_seed(0)
    x = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
    norm_w = torch.rand(2048, device=dev, dtype=torch.bfloat16) + 0.5
    g = torch.randn(m, 5632, device=dev, dtype=torch.bfloat16)
    u = torch.randn(m, 5632, device=dev, dtype=torch.bfloat16)

    def norm(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, 1e-5)

    def swiglu(g, u):
        return F.silu(g) * u

    cases = {
        # name: (producer, inputs, our eager quantizer on its output, the reference quantizer)
        "rows": (lambda x: x, (x,), lambda y: tk.quantize_rows(y, E4M3, False),
                 lambda y: ref.quantize_1x128(y, E4M3)),
        "rmsnorm -> rows": (norm, (x, norm_w), lambda y: tk.quantize_rows(y, E4M3, False),
                            lambda y: ref.quantize_1x128(y, E4M3)),
        "swiglu -> rows": (swiglu, (g, u), lambda y: tk.quantize_rows(y, E4M3, False),
                           lambda y: ref.quantize_1x128(y, E4M3)),
        "rows + cols (dy), fused kernel": (lambda x: x, (x,), lambda y: tk.quantize_both(y, E4M3, False),
                                           lambda y: (*ref.quantize_1x128(y, E4M3),
                                                      *ref.quantize_1x128_transposed(y, E4M3))),
        "rows + cols (dy), two kernels": (lambda x: x, (x,),
                                          lambda y: (*tk.quantize_rows(y, E4M3, False),
                                                     *tk.quantize_cols(y, E4M3, False)),
                                          lambda y: (*ref.quantize_1x128(y, E4M3),
                                                     *ref.quantize_1x128_transposed(y, E4M3))),
    }
    print("| case | eager producer + Triton quantizer (ms) | compiled producer + reference quantizer (ms) | "
          "speed-up | compiled bits equal the reference |")
    print("|---|---|---|---|---|")
    for name, (produce, inputs, ours, reference) in cases.items():
        eager = lambda *a: ours(produce(*a))  # noqa: E731
        fused = torch.compile(lambda *a: reference(produce(*a)))
        t_eager, t_fused = timed_ms(eager, *inputs), timed_ms(fused, *inputs)
        produced = produce(*inputs)
        verdict = same(fused(*inputs), reference(produced))
        print(f"| {name} | {t_eager:.3f} | {t_fused:.3f} | {t_eager / t_fused:.2f}x | {verdict} |")
    both_configs(m)


def both_configs(m: int) -> None:
    from megafp8.precision import triton_kernels as tk

    widths = (6144, 2048, 11264)  # dy widths of the ~1B model: QKV, output and down (2048), gate+up
    print("\n| quantize_both config | " + " | ".join(f"{m}x{k} (GB/s)" for k in widths) + " |")
    print("|---|" + "---|" * len(widths))
    grads = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in widths]
    runs = [(config, True) for config in [*tk.BOTH_CONFIGS, None]] + [(None, False)]
    for config, explicit in runs:
        name = "autotuned" if config is None else f"CHUNK={config.kwargs['CHUNK']}, warps={config.num_warps}"
        name += "" if explicit else ", rounding by the FP8 conversion alone"
        cells = []
        for dy in grads:
            ms = timed_ms(lambda t: tk.quantize_both(t, E4M3, False, config=config, explicit_round=explicit), dy)
            cells.append(f"{4 * dy.numel() / ms / 1e6:.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
