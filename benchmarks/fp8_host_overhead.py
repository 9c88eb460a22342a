#!/usr/bin/env python
"""Host (CPU) time vs wall time per FP8-linear training iteration (cuBLAS backend), plus a CPU+CUDA profile.

If host time per iteration approaches wall time, the layer is launch-bound, not GPU-bound.
Usage (GPU machine, repo root): PYTHONPATH=. python benchmarks/fp8_host_overhead.py
"""
import sys, time, torch
sys.path.insert(0, ".")
from megafp8.parallel import ColumnParallelLinear
from megafp8.precision import Fp8Recipe, PrecisionRecipe
for (m, k, n) in [(8192, 7168, 18432), (8192, 4096, 4096)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    layer = ColumnParallelLinear(k, n, PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="cublas")), device="cuda")
    with torch.no_grad():
        layer.weight.normal_(0, 0.02)  # real values: uninitialized memory draws less power and flatters timings
    layer.weight.main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
    def it():
        layer.fp8_cache.clear(); layer(x).backward(dy)
    for _ in range(3): it()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    it()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10): it()
    t_cpu = (time.perf_counter() - t0) / 10
    torch.cuda.synchronize(); t_all = (time.perf_counter() - t0) / 10
    print(f"{m}x{k}x{n}: host time per iteration {t_cpu*1e3:.2f} ms, wall {t_all*1e3:.2f} ms, allocs/frees: "
          f"{torch.cuda.memory_stats()['num_alloc_retries']} retries, segments {torch.cuda.memory_stats()['segment.all.allocated']}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3): it()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    del x, dy, layer; torch.cuda.empty_cache()
