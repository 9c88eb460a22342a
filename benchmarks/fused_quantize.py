#!/usr/bin/env python
"""The FP8 quantizers on the GPU: how close to HBM bandwidth each kernel runs, and what fusing a quantizer into
its producer saves against running them one after the other (or against Inductor fusing the pure-torch ones).

    PYTHONPATH=. python benchmarks/fused_quantize.py [--tokens 16384] [--backend cublas]

Table 1, each kernel alone at the ~1B and 8B-layer shapes: milliseconds, GB/s of the bytes it must move (each
input read once, each output written once; BF16 2 bytes, FP8 1 byte, FP32 scales), and that as a share of a plain
device-to-device copy's GB/s measured in the same run.

Table 2, each producer three ways: the eager BF16 producer then our standalone quantizer (rows and columns); our
fused kernel; the producer and the pure-torch reference quantizer compiled together by Inductor. The producers:
RoPE's backward into the QKV projection's output gradient (`megafp8.precision.fp8_qkv`; its first column is what a
compiled model ran before: Inductor's RoPE backward to BF16, then our quantizer), RMSNorm, SwiGLU and SwiGLU's
backward.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision import producers  # noqa: E402
from megafp8.precision.backends import select_backend  # noqa: E402
from megafp8.precision.formats import E4M3  # noqa: E402

SHAPES = {"~1B": dict(hidden=2048, ffn=5632, qkv=6144), "8B-layers": dict(hidden=4096, ffn=14336, qkv=12288)}


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


def graphed_ms(fn, *args, iters: int = 30) -> float:
    """Device time per call: `iters` calls captured in one CUDA graph and replayed, so the host's launch cost (which
    `timed_ms` includes when the host is slower than the kernel) is left out, as under `compile_mode:
    reduce-overhead`."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * iters)


def variant_benchmark_args(doc: str, argv=None, moe_tokens: bool = False) -> tuple[argparse.Namespace, torch.device]:
    """The variant benchmarks' command line (`--tokens`, `--iters`; with `moe_tokens`, `--moe-tokens`: the MoE
    experts' padded rows, 131,072 routed and up to 127 a busy expert's padding) and their GPU (an error without
    one)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=30)
    if moe_tokens:
        parser.add_argument("--moe-tokens", type=int, default=132_736)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (SM90 for the Gluon kernel)")
    return args, torch.device("cuda")


def differing_bytes(got, want) -> int:
    """Bytes that differ over a kernel's outputs (FP8 values and FP32 scales in any layout, compared as bytes): the
    variant benchmarks' check that a faster kernel writes its twin's bits."""
    return sum(int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())
               for a, b in zip(got, want))


def poisoned_rows_cols_outputs(m: int, k: int, fmt, device) -> tuple:
    """Empty row + column outputs (`tiles.rows_cols_outputs`) with their FP8 bytes set to 0x55: the variant
    benchmarks' outputs, where a byte a kernel left unwritten shows as a difference."""
    from megafp8.precision.kernels import tiles
    out = tiles.rows_cols_outputs(m, k, fmt, device)
    for t in (out[0], out[2]):
        t.view(torch.uint8).fill_(0x55)
    return out


def rows_cols_bytes(m: int, k: int) -> int:
    """FP8 rows and columns of an (m, k) tensor, with their FP32 scales."""
    return 2 * m * k + 2 * 4 * m * k // 128


def kernel_cases(backend, m: int, shape: dict, dev) -> list[tuple]:
    """(name, fn, args, bytes moved) for each kernel at one model shape."""
    h, f, qkv = shape["hidden"], shape["ffn"], shape["qkv"]
    randn = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
    x, gu, da, norm_w = randn(m, h), randn(m, 2 * f), randn(m, f), torch.rand(h, device=dev) + 0.5
    norm_w = norm_w.to(torch.bfloat16)
    cases = []
    for name, k in ((f"dy rows+cols, {m}x{qkv}", qkv), (f"dy rows+cols, {m}x{h}", h),
                    (f"dy rows+cols, {m}x{2 * f}", 2 * f)):
        dy = randn(m, k)
        cases.append((name, lambda t: backend.quantize_rows_cols(t, E4M3, False), (dy,), 2 * m * k + rows_cols_bytes(m, k)))
    cases += [
        (f"rmsnorm -> rows+cols, {m}x{h}", lambda t, w: backend.rmsnorm_quantize(t, w, 1e-5, E4M3, False),
         (x, norm_w), 2 * m * h + rows_cols_bytes(m, h) + 4 * m),
        (f"swiglu -> rows, {m}x{f}", lambda t: backend.swiglu_quantize(t, E4M3, False), (gu,),
         2 * m * 2 * f + rows_cols_bytes(m, f) // 2),
        (f"swiglu backward -> rows+cols, and output cols, {m}x{2 * f}",
         lambda t, d: backend.swiglu_backward_quantize(t, d, E4M3, E4M3, False), (gu, da),
         2 * m * 3 * f + rows_cols_bytes(m, 2 * f) + rows_cols_bytes(m, f) // 2),
    ]
    w = randn(2 * f, h)
    cache = backend.empty_weight(w.shape, E4M3, dev)
    cases.append((f"weight + transpose, {2 * f}x{h}", lambda t: backend.quantize_weight_(t, cache, E4M3, False), (w,),
                  2 * w.numel() + 2 * w.numel()))
    return cases


def rope_tables(head_dim: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin tables (seq, head_dim), FP32, theta 10000."""
    from megafp8.model.rope import RotaryEmbedding
    rope = RotaryEmbedding(head_dim, seq, 10000.0)
    return rope.cos, rope.sin


def producer_cases(backend, m: int, shape: dict, dev) -> list[tuple]:
    """(name, eager producer then standalone quantizer, fused kernel, Inductor-compiled twin, args)."""
    h, f = shape["hidden"], shape["ffn"]
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    w = (torch.rand(h, device=dev) + 0.5).to(torch.bfloat16)
    gu = torch.randn(m, 2 * f, device=dev, dtype=torch.bfloat16)
    da = torch.randn(m, f, device=dev, dtype=torch.bfloat16)
    quantize = lambda y: backend.quantize_rows_cols(y, E4M3, False)  # noqa: E731

    def eager_swiglu(gu):
        gate, up = gu.chunk(2, dim=-1)
        return backend.quantize_rows(F.silu(gate) * up, E4M3, False)

    def eager_swiglu_backward(gu, da):  # what the fused kernel replaces: d(gu) both ways, SwiGLU's output again
        gate, up = gu.chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        return (quantize(torch.cat([da * up * s * (1 + gate * (1 - s)), da * gate * s], dim=-1)),
                quantize(F.silu(gate) * up))

    qkv, head_dim = shape["qkv"], 128
    widths, seq = (qkv // 3, qkv // 3, qkv // 3), 2048  # no GQA, as both models here
    d_rot = [torch.randn(m, w, device=dev, dtype=torch.bfloat16) for w in widths]
    cos, sin = (t.to(dev) for t in rope_tables(head_dim, seq))

    # dynamic=False: each lambda is compiled once per shape, and its code object is the same for every shape, so
    # without it the second shape recompiles with dynamic sizes (torch's "automatic dynamic") into slower kernels.
    # Until the seventeenth session that happened: every Inductor figure of the second (8B-layer) shape was too slow.
    # What the fused kernel replaces in a compiled model: Inductor's RoPE backward writing the projection's BF16 output
    # gradient, then our standalone quantizer.
    compiled_rope_backward = torch.compile(lambda dq, dk, dv: torch.cat(
        [*(producers.rope_backward(d, cos, sin, seq, head_dim).to(torch.bfloat16) for d in (dq, dk)), dv], dim=-1),
        dynamic=False)

    def eager_rope_backward(dq, dk, dv):
        return quantize(compiled_rope_backward(dq, dk, dv))

    return [
        (f"RoPE backward {m}x{qkv}", eager_rope_backward,
         lambda dq, dk, dv: backend.rope_backward_quantize(dq, dk, dv, cos, sin, seq, head_dim, E4M3, False),
         torch.compile(lambda dq, dk, dv: producers.rope_backward_quantize(dq, dk, dv, cos, sin, seq, head_dim, E4M3,
                                                                           False), dynamic=False), tuple(d_rot)),
        (f"RMSNorm {m}x{h}", lambda x, w: quantize(F.rms_norm(x, (h,), w, 1e-5)),
         lambda x, w: backend.rmsnorm_quantize(x, w, 1e-5, E4M3, False),
         torch.compile(lambda x, w: producers.rmsnorm_quantize(x, w, 1e-5, E4M3, False), dynamic=False), (x, w)),
        (f"SwiGLU {m}x{f}", eager_swiglu, lambda gu: backend.swiglu_quantize(gu, E4M3, False),
         torch.compile(lambda gu: producers.swiglu_quantize(gu, E4M3, False), dynamic=False), (gu,)),
        (f"SwiGLU backward {m}x{2 * f}", eager_swiglu_backward,
         lambda gu, da: backend.swiglu_backward_quantize(gu, da, E4M3, E4M3, False),
         torch.compile(lambda gu, da: producers.swiglu_backward_quantize(gu, da, E4M3, E4M3, False), dynamic=False),
         (gu, da)),
    ]


def compiled_kernels() -> list[str]:
    """Every Triton kernel of megafp8 compiled so far: its configuration, registers per thread and spilled bytes
    (spills are what makes a tile kernel slow), with the autotuner's choice marked."""
    from megafp8.precision.kernels import gemm, producers, quantize

    lines = ["| kernel | warps | constexprs | registers | spills | autotuner's choice |", "|---|---|---|---|---|---|"]
    for module in (quantize, producers, gemm):
        for name, obj in sorted(vars(module).items()):
            fn, best = getattr(obj, "fn", obj), getattr(obj, "best_config", None)
            for kernel_cache, *_ in getattr(fn, "device_caches", {}).values():
                for kernel in kernel_cache.values():
                    meta = kernel.metadata
                    src = kernel.src
                    consts = {src.fn.arg_names[k[0]]: v for k, v in src.constants.items()
                              if isinstance(v, int) and not isinstance(v, bool) and len(k) == 1}
                    chosen = best is not None and best.num_warps == meta.num_warps and all(
                        consts.get(k, v) == v for k, v in best.kwargs.items())
                    lines.append(f"| {name} | {meta.num_warps} | {consts} | {kernel.n_regs} | {kernel.n_spills} | "
                                 f"{'yes' if chosen else ''} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--backend", default="cublas")
    args = parser.parse_args()
    m, dev = args.tokens, torch.device("cuda")
    backend = select_backend(args.backend, dev)
    torch.manual_seed(0)
    big = torch.randn(m, 8192, device=dev, dtype=torch.bfloat16)
    copy_gbs = 2 * big.numel() * 2 / timed_ms(torch.clone, big) / 1e6
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)\n")
    print("| kernel | shape | ms | GB/s | of copy |")
    print("|---|---|---|---|---|")
    for shape_name, shape in SHAPES.items():
        for name, fn, fn_args, nbytes in kernel_cases(backend, m, shape, dev):
            ms = timed_ms(fn, *fn_args)
            print(f"| {name} | {shape_name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} | {nbytes / ms / 1e6 / copy_gbs:.0%} |")
    print("\n| producer | eager BF16 producer + our quantizer (ms) | our fused kernel (ms) | "
          "Inductor: twin compiled (ms) | fused vs eager |")
    print("|---|---|---|---|---|")
    for shape in SHAPES.values():
        for name, eager, fused, compiled, fn_args in producer_cases(backend, m, shape, dev):
            t_eager, t_fused, t_compiled = (timed_ms(fn, *fn_args) for fn in (eager, fused, compiled))
            print(f"| {name} | {t_eager:.3f} | {t_fused:.3f} | {t_compiled:.3f} | {t_eager / t_fused:.2f}x |")
    try:  # the compiled kernels' registers and spills (Triton internals: skipped if they moved)
        print("\n" + "\n".join(compiled_kernels()))
    except (AttributeError, TypeError, ValueError) as err:
        print(f"\n(no register report: {err})")


if __name__ == "__main__":
    main()
