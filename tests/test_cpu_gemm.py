"""`megafp8.precision.cpu_gemm`: BF16/FP16 products on CPUs without BF16 GEMM instructions, computed in FP32 and
rounded once; other dtypes and CUDA left to torch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megafp8.precision import cpu_gemm
from tests.conftest import REPO


def widened(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What a BF16 GEMM with FP32 accumulation gives, one rounding at the end (the sums in torch's FP32 order)."""
    out = torch.empty(a.shape[:-1] + b.shape[-1:], dtype=torch.float32)
    op = torch.ops.aten.mm.out if a.dim() == 2 else torch.ops.aten.bmm.out
    return op(a.float(), b.float(), out=out).to(a.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_compute_reduced_precision_products_in_fp32_and_round_once(dtype):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(shape, generator=g).to(dtype) for shape in ((37, 300), (300, 19), (37, 19)))
    assert cpu_gemm._mm(a, b).dtype == dtype
    assert torch.equal(cpu_gemm._mm(a, b), widened(a, b))
    assert torch.equal(cpu_gemm._mm(a.t().contiguous().t(), b.t().contiguous().t()), widened(a, b))  # strides
    a3, b3 = a.view(1, 37, 300).expand(3, -1, -1), b.view(1, 300, 19).expand(3, -1, -1)
    assert torch.equal(cpu_gemm._bmm(a3, b3), widened(a3, b3))
    expected = (c.float() * 0.5 + 2.0 * (a.float() @ b.float())).to(dtype)
    torch.testing.assert_close(cpu_gemm._addmm(c, a, b, beta=0.5, alpha=2.0), expected, rtol=0, atol=0)


def test_other_dtypes_pass_through_to_torchs_kernels():
    a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    assert torch.equal(cpu_gemm._mm(a, b), a @ b) and cpu_gemm._mm(a, b).dtype == torch.float64
    ints = torch.randint(-5, 5, (4, 3)), torch.randint(-5, 5, (3, 2))
    assert torch.equal(cpu_gemm._mm(*ints), ints[0] @ ints[1])
    with pytest.raises(RuntimeError):  # mixed dtypes stay an error, not a silent promotion
        cpu_gemm._mm(a.to(torch.bfloat16), b.float())


def test_the_process_setting_widens_where_the_cpu_lacks_bf16_gemms_and_autograd_and_linear_use_it():
    """In a fresh process (this one has it on already where it applies): the CPU kernels of `mm`, `bmm` and `addmm`
    are the widening ones exactly where the CPU lacks BF16 GEMMs, and `F.linear` (with a bias: `addmm`) and its
    backward then give the widened products; `MEGAFP8_CPU_GEMM=native` keeps torch's kernels."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from megafp8.precision import cpu_gemm\n"
        "g = torch.Generator().manual_seed(1)\n"
        "x = torch.randn(64, 256, generator=g).bfloat16().requires_grad_(True)\n"
        "w = torch.randn(48, 256, generator=g).bfloat16().requires_grad_(True)\n"
        "bias = torch.randn(48, generator=g).bfloat16()\n"
        "dy = torch.randn(64, 48, generator=g).bfloat16()\n"
        "on = cpu_gemm.widen_reduced_precision_gemms()\n"
        "y = F.linear(x, w); y.backward(dy)\n"
        "ok = torch.equal(y, (x.float() @ w.float().t()).bfloat16())\n"
        "ok &= torch.equal(x.grad, (dy.float() @ w.float()).bfloat16())\n"
        "ok &= torch.equal(w.grad, (dy.float().t() @ x.float()).bfloat16())\n"
        "ok &= torch.equal(F.linear(x, w, bias), (bias.float() + x.float() @ w.float().t()).bfloat16())\n"
        "ours = all('cpu_gemm.py' in next(line for line in torch._C._dispatch_dump(f'aten::{op}').splitlines()\n"
        "                                 if line.startswith('CPU:')) for op in ('mm', 'bmm', 'addmm'))\n"
        "print(on, cpu_gemm.cpu_has_bf16_gemm(), ours, ok)\n")
    env = {k: v for k, v in os.environ.items() if k != cpu_gemm.NATIVE_ENV}
    for native in (False, True):
        if native:
            env[cpu_gemm.NATIVE_ENV] = "native"
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        on, has_bf16, ours, equal = result.stdout.split()
        assert on == ours == str(has_bf16 == "False" and not native)  # the kernels that run are those it says
        assert equal == "True" or on == "False"  # (torch's own loop may give the same bits: it sums in FP32 too)
