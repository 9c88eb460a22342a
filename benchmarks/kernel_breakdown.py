"""Where a training step's GPU time goes: CUDA kernels from a `torch.profiler` trace, summed by category.

Kernel names are matched in order against `CATEGORIES` (the first hit wins). The categories follow issue 10's
question: GEMMs (cuBLAS, CUTLASS, our Triton GEMMs), FP8 quantization (our Triton quantizers), attention,
communication, optimizer, norms and fused element-wise code, copies and casts; and for the MoE step (issue 19) the
router's top-k and sort and the permutation kernels around the experts. Since the twenty-seventh session the
gradient norm's foreach kernels (`_foreach_norm`, and `_foreach_mul_` where the clip is not fused into the update)
have a category of their own; earlier tables count them in "optimizer (AdamW)".
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

# (category, name fragments); lower-case fragments, first match wins.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("communication (NCCL)", ("nccl",)),
    ("attention (SDPA/flash)", ("flash", "fmha", "attention", "sdpa", "_efficient_attention")),
    ("FP8 producers quantizing their output (RMSNorm, SwiGLU)", ("_rmsnorm_quantize", "_rms_inverse", "_swiglu")),
    ("FP8 quantization, standalone (Triton)", ("_quantize", "quantize_", "_transpose_kernel", "_transpose_blocks")),
    ("GEMM", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "_grouped_wgrad", "sm90_", "matmul")),
    ("optimizer (AdamW)", ("adam",)),
    ("gradient norm and clipping (foreach)", ("multi_tensor_apply", "foreach")),
    ("MoE routing and permutation", ("_combine", "_gather_sum", "topk", "radixsort", "radix_sort", "sort")),
    ("norm", ("norm",)),
    ("cross-entropy / softmax", ("softmax", "nll_loss", "cross_entropy", "log_softmax", "_row_stats", "_logits_grad")),
    ("torch.compile fused kernels", ("triton_",)),
    ("copies / casts", ("copy", "memcpy", "memset", "fill", "cat", "index", "scatter", "gather")),
    ("element-wise (eager)", ("elementwise", "vectorized", "unrolled", "reduce_kernel")),
]


def category_of(kernel_name: str) -> str:
    """The category a CUDA kernel's name falls in ("other" when nothing matches)."""
    name = kernel_name.lower()
    for category, fragments in CATEGORIES:
        if any(fragment in name for fragment in fragments):
            return category
    return "other"


def breakdown(kernels: Iterable[tuple[str, float]], steps: int) -> list[tuple[str, float, float]]:
    """(category, milliseconds per step, share of GPU time) from (kernel name, microseconds) pairs covering
    `steps` steps, largest first."""
    totals: dict[str, float] = defaultdict(float)
    for name, micros in kernels:
        totals[category_of(name)] += micros
    whole = sum(totals.values()) or 1.0
    rows = [(category, micros / 1e3 / steps, micros / whole) for category, micros in totals.items()]
    return sorted(rows, key=lambda row: -row[1])


def top_kernels(kernels: Iterable[tuple[str, float]], steps: int, count: int = 12) -> list[tuple[str, float]]:
    """The `count` kernels with the most time, (name cut to 90 characters, milliseconds per step)."""
    totals: dict[str, float] = defaultdict(float)
    for name, micros in kernels:
        totals[name] += micros
    best = sorted(totals.items(), key=lambda item: -item[1])[:count]
    return [(name[:90], micros / 1e3 / steps) for name, micros in best]


def cuda_kernels(prof) -> list[tuple[str, float]]:
    """(name, microseconds) of every CUDA kernel, memcpy and memset event in a finished `torch.profiler` run."""
    out = []
    for event in prof.events():
        device_type = getattr(event, "device_type", None)
        if device_type is not None and str(device_type).endswith("CUDA") and not is_annotation(event.name, event):
            out.append((event.name, event.device_time))
    return out


def is_annotation(name: str, event: object = None) -> bool:
    """Whether a device-side profiler event is a range around kernels, not a kernel: torch.compile's
    `## Call CompiledFxGraph ... ##` ranges (counting them counted their kernels twice) and other user annotations."""
    return name.startswith("## ") or bool(getattr(event, "is_user_annotation", False))


def host_ops(prof, steps: int, count: int = 15) -> list[tuple[str, float, int]]:
    """The `count` host-side operators with the most self CPU time: (name, ms per step, calls per step). Kernel
    launches (`cudaLaunchKernel`, `cuLaunchKernel`) appear among them, with their count per step."""
    rows = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()
            if e.self_cpu_time_total > 0]
    return sorted(rows, key=lambda row: -row[1])[:count]


def device_ops(prof, steps: int, count: int = 15) -> list[tuple[str, str, float, int]]:
    """The `count` operators whose own kernels take the most GPU time, by input shapes (the profile must record
    shapes): (name, shapes, ms per step, calls per step). Says which tensor a generic element-wise kernel ran on."""
    rows = [(e.key, str(e.input_shapes)[:80], e.self_device_time_total / 1e3 / steps, e.count // steps)
            for e in prof.key_averages(group_by_input_shape=True)
            if e.self_device_time_total > 0 and not is_annotation(e.key)]
    return sorted(rows, key=lambda row: -row[2])[:count]


def markdown(title: str, rows: list[tuple[str, float, float]], wall_ms: float, top: list[tuple[str, float]],
             host: list[tuple[str, float, int]] = (), ops: list[tuple[str, str, float, int]] = ()) -> str:
    """The breakdown, the top kernels and (if given) the top host operators as Markdown; `wall_ms` is the step's
    wall time (host and GPU together)."""
    gpu_ms = sum(ms for _, ms, _ in rows)
    lines = [f"### {title}", "",
             f"Wall time per step {wall_ms:.1f} ms; GPU kernel time per step {gpu_ms:.1f} ms "
             f"({100 * gpu_ms / wall_ms:.0f}% busy).", "",
             "| category | ms per step | share of GPU time |", "|---|---|---|"]
    lines += [f"| {category} | {ms:.2f} | {100 * share:.1f}% |" for category, ms, share in rows]
    lines += ["", "| top kernels | ms per step |", "|---|---|"]
    lines += [f"| `{name}` | {ms:.2f} |" for name, ms in top]
    if host:
        lines += ["", f"Host: {sum(ms for _, ms, _ in host):.1f} ms of self CPU time per step in these operators.", "",
                  "| top host operators (self CPU) | ms per step | calls per step |", "|---|---|---|"]
        lines += [f"| `{name[:90]}` | {ms:.2f} | {calls} |" for name, ms, calls in host]
    if ops:
        lines += ["", "| top operators (own GPU time) | input shapes | ms per step | calls per step |",
                  "|---|---|---|---|"]
        lines += [f"| `{name[:60]}` | `{shapes}` | {ms:.2f} | {calls} |" for name, shapes, ms, calls in ops]
    return "\n".join(lines)
