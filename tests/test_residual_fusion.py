"""The residual stream added by the output projections' FP8 GEMMs (`fp8_linear.project_with_residual`): a block's
`x + attn(x)` and `x + mlp(x)` computed as `attn(x, residual=x)` and `mlp(x, residual=x)` give the unfused bits,
forward and backward, eagerly and compiled; where a tensor-parallel reduction follows the GEMM the residual is
added after it. The GEMM's epilogue on the GPU is held to the same bits in `tests/test_fp8_gpu.py`."""
from __future__ import annotations

import pytest
import torch

from megafp8.parallel import RowParallelLinear, swiglu_mlp
from megafp8.precision import Fp8Recipe, PrecisionRecipe
from megafp8.precision.backends import Fp8Backend
from megafp8.precision.fp8_linear import fp8_linear
from megafp8.precision.linear_comm import LinearComm
from megafp8.precision.weight_cache import Fp8WeightCache
from tests.fp8_checks import outlier_tensor, swiglu_mlp_layers

FP8 = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference"))
BF16 = PrecisionRecipe.from_name("bf16")


def _grads(fn, x0: torch.Tensor, params: list) -> list:
    """[output, dx, each parameter's gradient] of fn(x), backward from a fixed pseudo-random output gradient (so
    the residual's gradient is not a constant)."""
    x = x0.clone().requires_grad_(True)
    for p in params:
        p.grad = None
    y = fn(x)
    dy = outlier_tensor(*y.shape, seed=7).to(y.dtype)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in params]


def _assert_same(got: list, want: list, names: tuple) -> None:
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("recipe", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_mlp_given_the_residual_gives_the_bits_of_adding_it_after(recipe, compiled):
    """`swiglu_mlp(x, ..., residual=x)` against `x + swiglu_mlp(x, ...)`: the block's output and the gradients of
    x (through both paths), the norm and both weights, 300 tokens (not a multiple of 128)."""
    gate_up, down, norm = swiglu_mlp_layers(recipe, 256, 384, 0.05)
    params = [norm.weight, gate_up.weight, down.weight]
    x0 = outlier_tensor(300, 256).to(torch.bfloat16)

    def fused(x):
        return swiglu_mlp(x, gate_up, down, norm, residual=x)

    def unfused(x):
        return x + swiglu_mlp(x, gate_up, down, norm)
    runs = []
    for fn in (fused, unfused):
        torch._dynamo.reset()
        if compiled:
            assert torch._dynamo.explain(fn)(x0.clone().requires_grad_(True)).graph_break_count == 0
            fn = torch.compile(fn, backend="aot_eager")
        runs.append(_grads(fn, x0, params))
    _assert_same(runs[0], runs[1], ("y", "dx", "d norm", "d gate_up", "d down"))


@pytest.mark.parametrize("recipe", [FP8, BF16], ids=["fp8", "bf16"])
def test_an_output_projection_given_the_residual_gives_the_bits_of_adding_it_after(recipe):
    """`RowParallelLinear(a, residual=x)` (the attention's output projection) against `x + layer(a)`; x and a both
    depend on the input, as in a block."""
    torch.manual_seed(0)
    layer = RowParallelLinear(384, 256, recipe)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    mix = (torch.randn(256, 384) * 0.1).to(torch.bfloat16)
    x0 = outlier_tensor(200, 256).to(torch.bfloat16)
    fused = _grads(lambda x: layer(x @ mix, residual=x), x0, [layer.weight])
    unfused = _grads(lambda x: x + layer(x @ mix), x0, [layer.weight])
    _assert_same(fused, unfused, ("y", "dx", "dw"))


class _Doubling(LinearComm):
    """A stand-in for a row-parallel layer's all-reduce over two ranks holding the same partial sums."""

    reduces_output = True

    def reduce_output(self, y2d):
        return y2d * 2


def test_the_residual_is_added_after_a_tensor_parallel_reduction():
    """Where the layer's collectives reduce its output (row-parallel TP), the GEMM cannot add the residual: it is
    added to the reduced output, once, and its gradient is the output's."""
    torch.manual_seed(0)
    recipe = Fp8Recipe(backend="reference")
    w = torch.nn.Parameter((torch.randn(256, 384) * 0.05).to(torch.bfloat16))
    a = outlier_tensor(200, 384).to(torch.bfloat16)
    r = outlier_tensor(200, 256, seed=3).to(torch.bfloat16).requires_grad_(True)
    y = fp8_linear(a, w, Fp8WeightCache(), recipe, Fp8Backend(), comm=_Doubling(), residual=r)
    plain = fp8_linear(a, w, Fp8WeightCache(), recipe, Fp8Backend(), comm=_Doubling())
    assert torch.equal(y, r.detach() + plain.detach())
    dy = outlier_tensor(200, 256, seed=4).to(torch.bfloat16)
    y.backward(dy)
    assert torch.equal(r.grad, dy)


def test_the_reference_backend_defines_the_fused_add_as_the_add_after_the_gemm():
    """`Fp8Backend.gemm_1x128_128x128_add`, the definition the hopper kernel is held to: the product rounded to
    the residual's dtype, then `residual + y`."""
    backend = Fp8Backend()
    from megafp8.precision import E4M3
    w = backend.empty_weight(torch.Size((256, 384)), E4M3, torch.device("cpu"))
    backend.quantize_weight_(outlier_tensor(256, 384, seed=2), w, E4M3, False)
    a, a_scale = backend.quantize_rows(outlier_tensor(200, 384).to(torch.bfloat16), E4M3, False)
    r = outlier_tensor(200, 256, seed=5).to(torch.bfloat16)
    got = backend.gemm_1x128_128x128_add(a, a_scale, w.w_fp8, w.w_scale, r)
    y = backend.gemm_1x128_128x128(a, a_scale, w.w_fp8, w.w_scale, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (r.float() + y.float()).to(torch.bfloat16))


def test_the_epilogue_takes_only_residuals_tma_can_read():
    """`ws_gemm.residual_fits`: a BF16 residual of C's shape whose rows TMA can address; otherwise the hopper
    backend adds it after the GEMM."""
    ws_gemm = pytest.importorskip("megafp8.precision.kernels.ws_gemm")
    c = torch.empty(200, 256, dtype=torch.bfloat16)
    assert ws_gemm.residual_fits(torch.empty(200, 256, dtype=torch.bfloat16), c)
    assert ws_gemm.residual_fits(torch.empty(200, 512, dtype=torch.bfloat16)[:, :256], c)  # rows further apart
    assert not ws_gemm.residual_fits(torch.empty(200, 256), c)  # FP32
    assert not ws_gemm.residual_fits(torch.empty(100, 256, dtype=torch.bfloat16), c)
    assert not ws_gemm.residual_fits(torch.empty(200, 260, dtype=torch.bfloat16)[:, :256], c)  # 520-byte rows
    assert not ws_gemm.residual_fits(torch.empty(256, 200, dtype=torch.bfloat16).t(), c)  # columns contiguous
