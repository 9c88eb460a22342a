"""The router's FP32 logits GEMMs (`megafp8.parallel.router_gemm`): the twin is autograd's own F.linear(x.float(), W);
the Triton kernel, in Triton's CPU interpreter and on the GPU, against FP64 within FP32's error bound (which a TF32
kernel would exceed), split and unsplit, BF16 and FP32 inputs, strided views."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megafp8.parallel.router_gemm import (kernel_fits, router_logits, router_logits_backward_reference,
                                          router_logits_reference)
from tests.scripts import run_in_triton_interpreter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_the_cpu_the_router_logits_are_autograd_s_own_to_the_bit(dtype):
    """Off CUDA the twin runs: the logits and both gradients are those of F.linear(x.float(), W), bit for bit, and
    the twin's backward is what autograd gives for that expression."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).to(dtype)
    w = torch.randn(8, 96, generator=g) * 0.1
    grad = torch.randn(37, 8, generator=g)

    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.linear(xa.float(), wa)
    want.backward(grad)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = router_logits(xb, wb)
    got.backward(grad)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert xb.grad.dtype == dtype and torch.equal(xb.grad, xa.grad) and torch.equal(wb.grad, wa.grad)
    dx, dw = router_logits_backward_reference(grad, x, w)
    assert torch.equal(dx, xa.grad) and torch.equal(dw, wa.grad)
    assert torch.equal(router_logits_reference(x, w), want)
    assert not kernel_fits(x, w)  # a CPU tensor: the twin


def test_compiled_the_router_logits_trace_as_two_ops_and_give_the_eager_bits():
    """Under torch.compile (fullgraph) the forward and the backward are one custom op each, whose fake shapes and
    dtypes are the real ones: the compiled logits and gradients are the eager ones."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 64, generator=g).bfloat16()
    w = torch.randn(8, 64, generator=g) * 0.1
    grad = torch.randn(24, 8, generator=g)
    results = []
    for fn in (router_logits, torch.compile(lambda a, b: router_logits(a, b) * 2.0, backend="aot_eager",
                                            fullgraph=True)):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xa, wa)
        out.backward(grad)
        results.append((out.detach(), xa.grad, wa.grad))
    (logits, dx, dw), (logits2, dx2, dw2) = results
    assert torch.equal(logits2, logits * 2.0) and torch.equal(dx2, (grad * 2.0 @ w).to(x.dtype))
    assert dx2.dtype == torch.bfloat16 and torch.equal(dw2, (grad * 2.0).t() @ x.float())


def test_the_split_depends_on_the_shape_alone():
    """K is split only where the output's tiles are too few to fill a GPU, into parts of at least 1,024, the same
    for a shape on any device (so a shape's sums always come in one order)."""
    pytest.importorskip("triton")
    from megafp8.parallel import router_gemm_kernels as k
    assert k.splits(16384, 64, 2048) == 1  # the logits: 256 tiles
    assert k.splits(16384, 2048, 64) == 1  # the input's gradient
    assert k.splits(64, 2048, 16384) == 16  # the weight's gradient: 32 tiles, 16 parts of 1,024 tokens
    assert k.splits(64, 2048, 1000) == 1  # too little K to split
    assert k.splits(8, 96, 3000) == 3


def test_the_kernel_compiles_for_sm90_to_fp32_fmas_without_spills():
    """Compiled for an H100 on the CPU (Triton's own ptxas): the products are FP32 FMAs (no TF32 MMA, which Triton
    takes for FP32 dots unless told otherwise), with nothing spilled, for each operand dtype the router passes."""
    triton = pytest.importorskip("triton")
    import os
    import subprocess
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megafp8.parallel import router_gemm_kernels as k

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for a_type, c_type, k_per_split in (("*bf16", "*fp32", 2048), ("*fp32", "*bf16", 64), ("*fp32", "*fp32", 1024)):
        signature = {"a_ptr": a_type, "b_ptr": "*fp32", "c_ptr": c_type}
        signature.update({name: "i32" for name in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                                                   "stride_cs", "stride_cm", "stride_cn")})
        constants = dict(K_PER_SPLIT=k_per_split, BLOCK_M=k.BLOCK_M, BLOCK_N=k.BLOCK_N, BLOCK_K=k.BLOCK_K)
        signature.update({name: "constexpr" for name in constants})
        compiled = triton.compile(ASTSource(k._fp32_gemm_kernel, signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": k.WARPS})
        ptx = compiled.asm["ptx"]
        assert "fma.rn.f32" in ptx and "mma" not in ptx and "tf32" not in ptx, (a_type, c_type)
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", "-", "-o", os.devnull], input=ptx, capture_output=True,
                                text=True, check=True)
        assert "0 bytes spill stores" in report.stdout + report.stderr, report.stderr


INTERPRETED = r'''
import torch
from megafp8.parallel import router_gemm_kernels as k

def check(a, b, out_dtype, label):
    got = k.fp32_gemm(a, b, out_dtype)
    a64, b64 = a.double(), b.double()
    want = a64 @ b64
    # FP32's bound for K products summed in any order (one rounding a product, K - 1 additions, the split's sum):
    # a TF32 or BF16 kernel is orders of magnitude outside it
    kk = a.shape[1]
    bound = (kk + 4) * 2.0 ** -24 * (a64.abs() @ b64.abs()) + 1e-30
    if out_dtype == torch.float32:
        assert got.dtype == torch.float32 and got.shape == want.shape, label
        err = (got.double() - want).abs()
        assert bool((err <= bound).all()), (label, float((err / bound).max()))
    else:  # rounded once to BF16: within one BF16 unit of the FP32 result (the interpreter truncates where the GPU
        # rounds to nearest; the GPU test holds it to half a unit)
        assert got.dtype == out_dtype, label
        exact = want.to(torch.float32)
        assert bool(((got.double() - exact.double()).abs() <= exact.abs().double() * 2.0 ** -7 + bound).all()), label

g = torch.Generator().manual_seed(0)
for n, h, e in ((200, 96, 8), (131, 160, 24), (3000, 64, 8)):
    x = torch.randn(n, h, generator=g).bfloat16()
    w = torch.randn(e, h, generator=g) * 0.05
    grad = torch.randn(n, e, generator=g) * 1e-3
    check(x, w.t(), torch.float32, ("logits", n, h, e))  # a BF16 input read as it is, the weight's transpose a view
    check(x.float(), w.t(), torch.float32, ("logits fp32", n, h, e))
    check(grad, w, torch.bfloat16, ("input grad", n, h, e))
    check(grad.t(), x, torch.float32, ("weight grad", n, h, e))  # split over the tokens where n = 3000
# a row stride past the features
wide = torch.randn(50, 2 * 64, generator=g)
check(wide[:, :64], torch.randn(64, 16, generator=g), torch.float32, "strided")
# no rows, no K
assert k.fp32_gemm(torch.empty(0, 64), torch.randn(64, 8), torch.float32).shape == (0, 8)
zero = k.fp32_gemm(torch.empty(5, 0), torch.empty(0, 8), torch.float32)
assert zero.shape == (5, 8) and bool((zero == 0).all())
print("ok")
'''


def test_the_kernel_computes_in_fp32_in_the_interpreter(tmp_path):
    """The Triton kernel in Triton's CPU interpreter: every GEMM of the router (logits, input and weight gradients,
    the last split over the tokens) within FP32's error bound of FP64, BF16 output rounded once."""
    run_in_triton_interpreter(tmp_path, INTERPRETED)


@pytest.mark.gpu
def test_on_the_gpu_the_router_logits_are_fp32_and_the_same_every_time():
    """On CUDA the kernel runs (eager and compiled): the MoE step's router shapes (16,384 tokens, hidden 2,048, 64
    experts) within FP32's error bound of FP64 for the logits and the weight's gradient, the input's gradient within
    half a BF16 unit of FP32, and two runs give the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16384, 2048, device="cuda", generator=g).bfloat16()
    w = torch.randn(64, 2048, device="cuda", generator=g) * 0.02
    grad = torch.randn(16384, 64, device="cuda", generator=g) * 1e-4
    assert kernel_fits(x, w)

    def run(fn):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xa, wa)
        out.backward(grad)
        return out.detach(), xa.grad, wa.grad

    results = [run(router_logits), run(router_logits),
               run(torch.compile(lambda a, b: router_logits(a, b) * 1.0, fullgraph=True))]
    logits, dx, dw = results[0]
    x64, w64, g64 = x.double(), w.double(), grad.double()
    unit = 2.0 ** -24
    assert bool(((logits.double() - x64 @ w64.t()).abs() <= (x64.abs() @ w64.abs().t()) * (2048 + 4) * unit).all())
    assert bool(((dw.double() - g64.t() @ x64).abs() <= (g64.abs().t() @ x64.abs()) * (16384 + 4) * unit).all())
    dx_fp32 = (g64 @ w64).float().double()
    assert dx.dtype == torch.bfloat16
    assert bool(((dx.double() - dx_fp32).abs() <= dx_fp32.abs() * 2.0 ** -8 + (g64.abs() @ w64.abs()) * 68 * unit)
                .all())
    for again in results[1:]:
        for a, b in zip(results[0], again):
            assert torch.equal(a, b)
