"""The `deepgemm` backend (SM90, where DeepGEMM is installed): `hopper` with the dense fprop and dgrad on DeepGEMM.

DeepGEMM (github.com/deepseek-ai/DeepGEMM) is the public library of DeepSeek-V3's blockwise FP8 GEMMs. Its SM90
1x128 x 128x128 kernel (`deep_gemm.fp8_gemm_nt`) runs 256 x 128 tiles in clusters of two CTAs that share the A
tile by TMA multicast, which our Gluon kernel cannot issue (Triton 3.6); on the 8B-layer's linears it ran 5-9%
faster than ours, 8% at the same power-capped clock (`benchmarks/dense_gemm.py`'s DeepGEMM column, job GV in
docs/benchmarks.md). The numerics are the recipe's: the same operands and scales, each 128-deep product promoted
into FP32 (only the order of the FP32 additions differs, as between any two GEMM kernels).

`auto` prefers it to `hopper` where it runs (1.03x on the ~1B and 8B-layer steps; its 3,000-step parity run
ended 0.007% from BF16, jobs HC-HD in docs/benchmarks.md), and falls back to `hopper`, saying why, where it does
not. DeepGEMM is an optional dependency with needs of its own: it is built from source against the installed torch and
JIT-compiles each GEMM shape with the CUDA toolkit's nvcc at first use (seconds per shape), and on the machine we
measured on its JIT crashed unless the compiler's libstdc++ was preloaded (`tools/install_deepgemm.py` finds a
build that runs). So before it is used, a child process runs `smoke_test` once (seconds, plus the JIT's first
compiles): a crash there becomes a reason not to run (named: an error that says what to try; `auto`: `hopper`, with
the reason logged), instead of a training process killed at its first GEMM. Then DeepGEMM's runtime is made in
this process, eagerly (`create_runtime`: its workspace must not be allocated inside a CUDA graph's warm-up). The
weight gradients, the experts' grouped GEMMs and every quantizer stay on the hopper backend's kernels.
"""
from __future__ import annotations

import functools
import signal
import subprocess
import sys
from typing import Optional

import torch

from megafp8.precision.backends.hopper_backend import HopperBackend
from megafp8.precision.formats import TILE
from megafp8.precision.quantize import mn_major


class DeepGemmBackend(HopperBackend):
    """`hopper`, with the dense 1x128 x 128x128 GEMMs (fprop, dgrad) on DeepGEMM's `fp8_gemm_nt`."""

    name = "deepgemm"
    priority = 4  # `auto` prefers it to `hopper` (3) where DeepGEMM is installed and passes its check

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> Optional[str]:
        reason = super().unavailable_reason(device)
        if reason is not None:
            return reason.replace("hopper backend", "deepgemm backend")
        try:
            import deep_gemm  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any failure to load it is a reason not to use it
            return (f"the deepgemm backend needs DeepGEMM (github.com/deepseek-ai/DeepGEMM) built and importable "
                    f"({type(exc).__name__}: {exc}): `python tools/install_deepgemm.py --prefix DIR` builds and "
                    "checks it, then `source DIR/deepgemm.env`")
        return ready_failure(device.index if device.index is not None else torch.cuda.current_device())

    def gemm_1x128_128x128(self, a, a_scale, b, b_scale, out_dtype):
        if out_dtype != torch.bfloat16:  # DeepGEMM's 1x128 x 128x128 kernel writes BF16 only
            return super().gemm_1x128_128x128(a, a_scale, b, b_scale, out_dtype)
        import deep_gemm
        out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
        deep_gemm.fp8_gemm_nt((a, mn_major(a_scale)), (b, _row_major_blocks(self.block_scales_nk(b_scale), b)), out)
        return out


def _row_major_blocks(blocks: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B's block scales as DeepGEMM's SM90 kernel reads them: (N/128, K/128) with strides exactly (K/128, 1). The
    cublas layout pads K/128 to a multiple of four, and torch calls a one-row view of it contiguous whatever its row
    stride, which DeepGEMM refuses (job GW: N = 128); either way a copy, a few bytes."""
    n_blocks, k_blocks = b.shape[0] // TILE, b.shape[1] // TILE
    blocks = blocks[:, :k_blocks]
    if blocks.stride() == (k_blocks, 1):
        return blocks
    return torch.empty(n_blocks, k_blocks, dtype=blocks.dtype, device=blocks.device).copy_(blocks)


@functools.cache
def ready_failure(device_index: int) -> Optional[str]:
    """None once DeepGEMM passed `smoke_test` in a child process and its runtime exists in this one (asked once per
    process and GPU), else why DeepGEMM cannot be used."""
    reason = smoke_test_failure(device_index)
    if reason is None:
        create_runtime(device_index)
    return reason


def create_runtime(device_index: int) -> None:
    """Make DeepGEMM's per-process runtime now, eagerly. DeepGEMM makes it at its first call, and with it a 32 MiB
    cuBLASLt workspace from torch's allocator that it keeps for the life of the process. Under CUDA graphs
    (`compile_mode: reduce-overhead`) that first call can come inside a graph tree's warm-up run, whose allocations
    go to the graphs' private pool, and Inductor then stops the run: "Detected 1 tensor(s) in the cudagraph pool not
    tracked as outputs" (job GZ: a run resumed at step 1,860 in a new process, at its first step; a fresh run's
    step 0 runs its blocks uncompiled to sample FP8 health, so there DeepGEMM's first call came outside the graphs).
    Made here, before any layer runs, the workspace comes from the ordinary pool."""
    import deep_gemm
    with torch.cuda.device(device_index):
        deep_gemm.get_num_sms()  # the first use of DeepGEMM's runtime object creates it


SMOKE_TIMEOUT_S = 900  # the child's first run JIT-compiles three kernels; later runs find them in DeepGEMM's cache


def smoke_test_failure(device_index: int, env: Optional[dict[str, str]] = None,
                       timeout_s: float = SMOKE_TIMEOUT_S) -> Optional[str]:
    """None if `smoke_test` passes in a child process on GPU `device_index` (with environment `env`, else this
    process's), else why not, with what to try when DeepGEMM crashed the child (asked once per process and GPU,
    through `ready_failure`; `tools/install_deepgemm.py` asks it of each build it makes)."""
    command = [sys.executable, "-c", "from megafp8.precision.backends.deepgemm_backend import smoke_test; "
               f"smoke_test({device_index})"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"the deepgemm backend's test of DeepGEMM did not finish in {timeout_s:g} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return (f"DeepGEMM crashed a test process ({name}) on its first GEMM: where its JIT runs std::regex against "
                "another libstdc++ than its compiler's, preloading the compiler's cures it (we saw this on an H200 "
                "machine): LD_PRELOAD=$(c++ -print-file-name=libstdc++.so.6), or install it with "
                "tools/install_deepgemm.py, which finds a build that runs here; or set precision.fp8_backend=hopper")
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"the deepgemm backend's test of DeepGEMM failed: {last}"


def smoke_test(device_index: int = 0) -> None:
    """The DeepGEMM calls this backend makes, on a small shape, against the FP32 product (FP8's error is a few
    percent): the 1x128 scales' transpose into DeepGEMM's layout and a 1x128 x 128x128 GEMM, which JIT-compile, and
    its 1x128 x 1x128 GEMM (which only the benchmarks call). Raises on a wrong result; a broken build may kill the
    process instead, which is why `smoke_test_failure` runs it in a child."""
    import deep_gemm as dg
    from deep_gemm.utils import per_block_cast_to_fp8, per_token_cast_to_fp8
    device = torch.device("cuda", device_index)
    m, n, k = 256, 512, 1024
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=g).bfloat16()
    b = torch.randn(n, k, device=device, generator=g).bfloat16()
    want = a.float() @ b.float().t()
    a8, a_scale = per_token_cast_to_fp8(a, use_ue8m0=False)
    a_scale = dg.get_mn_major_tma_aligned_tensor(a_scale)  # row-major in: DeepGEMM's JIT-compiled transpose
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    dg.fp8_gemm_nt((a8, a_scale), per_block_cast_to_fp8(b, use_ue8m0=False), out)
    b8, b_scale = per_token_cast_to_fp8(b, use_ue8m0=False)
    acc = torch.zeros(m, n, device=device, dtype=torch.float32)
    dg.fp8_gemm_nt((a8, a_scale), (b8, dg.get_mn_major_tma_aligned_tensor(b_scale)), acc, c=acc, recipe=(1, 1, 128))
    for name, got in (("1x128 x 128x128", out.float()), ("1x128 x 1x128", acc)):
        err = float((got - want).norm() / want.norm())
        if not err < 0.1:
            raise RuntimeError(f"DeepGEMM's {name} GEMM is wrong here: relative error {err:.3g}")
        print(f"DeepGEMM {dg.__version__} {name}: relative error {err:.4f}")
