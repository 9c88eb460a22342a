"""FP8 layers on the GPU against the reference backend, eagerly and compiled (skipped without CUDA).

The kernels themselves are checked against the reference by `tests/test_fp8_backends.py` (bit for bit for the
standalone quantizers, within one E4M3 ULP for the fused producers); here the layers built on them are: the FP8
linear (with its input's RMSNorm fused in, or not) and the fused SwiGLU MLP match the reference backend within FP8
GEMM tolerance, compile to exactly their eager bits, and train.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megafp8.precision import Fp8Recipe, PrecisionRecipe, select_backend, why_unavailable
from tests.conftest import REPO, torchrun_env
from tests.fp8_checks import assert_same_quantization, run_with_grads, swiglu_mlp_layers

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def fast_backends():
    names = [n for n in ("triton", "cublas") if why_unavailable(n, CUDA) is None]
    assert "triton" in names, why_unavailable("triton", CUDA)
    return [select_backend(n, CUDA) for n in names]


def test_fp8_linear_on_gpu_matches_reference_backend():
    from megafp8.parallel import ColumnParallelLinear

    torch.manual_seed(0)
    x = torch.randn(4, 256, 512, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    results = {}
    for name in ["reference"] + [b.name for b in fast_backends()]:
        layer = ColumnParallelLinear(512, 384, PrecisionRecipe.from_name("fp8", Fp8Recipe(backend=name)), device=CUDA)
        torch.manual_seed(1)
        with torch.no_grad():
            layer.weight.normal_(0, 0.02)
        x.grad = None
        y = layer(x)
        y.backward(torch.ones_like(y) * 0.01)
        results[name] = (y.float(), x.grad.float(), layer.weight.grad.float())
    for name, outs in results.items():
        for got, want, what in zip(outs, results["reference"], ("y", "dx", "dw")):
            err = (got - want).norm() / want.norm()
            assert err < 5e-3, f"{name} {what}: rel err {err:.2e} vs reference backend"


def assert_compiled_bits(got: torch.Tensor, want: torch.Tensor, what: str, message: str) -> None:
    """The FP8 kernels are the same ops compiled or not: the bits are equal. Except the gradients through a fused
    RMSNorm's backward, plain torch ops that Inductor fuses into kernels of its own (another summation order):
    those within BF16 rounding."""
    if what in ("dx", "d norm", "dx through the norm"):
        err = float((got.float() - want.float()).norm() / want.float().norm())
        assert err < 4e-3, f"{message}: rel err {err:.2e}"
    else:
        assert torch.equal(got, want), message


def _mlp(backend: str, keep_transpose: bool = True):
    recipe = Fp8Recipe(backend=backend, keep_weight_transpose=keep_transpose)
    return swiglu_mlp_layers(PrecisionRecipe.from_name("fp8", recipe), 512, 768, 0.02, 1, CUDA)


def _mlp_step(fn, x0, params):
    return run_with_grads(fn, x0, params, dy_scale=0.01)


def test_fused_fp8_mlp_on_gpu_matches_the_reference_backend_and_compiles_to_its_eager_bits():
    """The fused SwiGLU MLP (norm, SwiGLU and SwiGLU's backward quantizing their FP32 outputs) on each GPU backend:
    within FP8 tolerance of the reference backend, and compiled (Inductor) exactly its eager bits."""
    from megafp8.parallel import swiglu_mlp

    x0 = torch.randn(3, 100, 512, device=CUDA, dtype=torch.bfloat16)
    results = {}
    for name in ["reference"] + [b.name for b in fast_backends()]:
        gate_up, down, norm = _mlp(name)
        params = [norm.weight, gate_up.weight, down.weight]

        def f(x):
            return swiglu_mlp(x, gate_up, down, norm)
        results[name] = eager = _mlp_step(f, x0, params)
        if name == "reference":
            continue
        torch._dynamo.reset()
        compiled = _mlp_step(torch.compile(f), x0, params)
        for what, a, b in zip(("y", "dx", "d norm", "d gate_up", "d down"), eager, compiled):
            assert_compiled_bits(a, b, what, f"{name} {what} differs compiled")
        for what, a, b in zip(("y", "dx", "d norm", "d gate_up", "d down"), eager, results["reference"]):
            err = (a.float() - b.float()).norm() / b.float().norm()
            assert err < 2e-2, f"{name} {what}: rel err {err:.2e} vs reference backend"


def test_the_fused_mlp_with_its_wgrads_inputs_in_blocks_matches_the_reference_and_compiles_to_its_eager_bits():
    """`precision.fp8_wgrad_input_blocks` on the hopper backend: the fused MLP's two weight gradients read x^T
    (RMSNorm's output) and a^T (SwiGLU's, in blocks from the forward's tile maxima) in 128x128 blocks. Within FP8
    tolerance of the reference backend with the same switch, its output and input gradient the bits of the default
    recipe's, and compiled (Inductor) its eager bits."""
    from megafp8.parallel import swiglu_mlp

    if why_unavailable("hopper", CUDA) is not None:
        pytest.skip(why_unavailable("hopper", CUDA))
    x0 = torch.randn(3, 100, 512, device=CUDA, dtype=torch.bfloat16)
    results = {}
    for name, blocks in (("reference", True), ("hopper", False), ("hopper", True)):
        recipe = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend=name, wgrad_input_blocks=blocks))
        gate_up, down, norm = swiglu_mlp_layers(recipe, 512, 768, 0.02, 1, CUDA)
        params = [norm.weight, gate_up.weight, down.weight]

        def f(x):
            return swiglu_mlp(x, gate_up, down, norm)
        torch._dynamo.reset()
        results[name, blocks] = eager = _mlp_step(f, x0, params)
        if (name, blocks) != ("hopper", True):
            continue
        torch._dynamo.reset()
        compiled = _mlp_step(torch.compile(f), x0, params)
        for what, a, b in zip(("y", "dx", "d norm", "d gate_up", "d down"), eager, compiled):
            assert_compiled_bits(a, b, what, f"{what} differs compiled")
    blocks, tiles, reference = results["hopper", True], results["hopper", False], results["reference", True]
    for what, a, b in zip(("y", "dx"), blocks, tiles):
        assert torch.equal(a, b), f"{what}: the switch changes only the weight gradients"
    for what, a, b in zip(("d gate_up", "d down"), blocks[3:], tiles[3:]):
        assert not torch.equal(a, b), f"{what}: the switch left this weight gradient's input in tiles"
    for what, a, b in zip(("y", "dx", "d norm", "d gate_up", "d down"), blocks, reference):
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err < 2e-2, f"hopper with blocks, {what}: rel err {err:.2e} vs reference backend"


def test_an_mlp_keeping_no_weight_transpose_on_gpu_gives_the_kept_transposes_bits():
    """`precision.fp8_keep_weight_transpose: false` on each GPU backend: w^T made in backward by the block-transpose
    kernel, in the backend's scale layout, eagerly and inside an Inductor graph, gives the bits of the run that keeps
    w^T."""
    from megafp8.parallel import swiglu_mlp

    x0 = torch.randn(3, 100, 512, device=CUDA, dtype=torch.bfloat16)
    for name in [b.name for b in fast_backends()]:
        for compiled in (False, True):  # Inductor's norm backward has bits of its own: compare like with like
            runs = []
            for keep in (True, False):
                gate_up, down, norm = _mlp(name, keep)

                def f(x):
                    return swiglu_mlp(x, gate_up, down, norm)
                torch._dynamo.reset()
                if compiled:  # as `Block.forward` does: the graph reads the caches (else it quantizes w and w^T itself)
                    gate_up.prepare_for_compiled()
                    down.prepare_for_compiled()
                runs.append(_mlp_step(torch.compile(f) if compiled else f, x0,
                                      [norm.weight, gate_up.weight, down.weight]))
                assert (gate_up.fp8_cache.entry.wt_fp8 is None) == (not keep)
            for what, a, b in zip(("y", "dx", "d norm", "d gate_up", "d down"), *runs):
                assert torch.equal(a, b), f"{name}, {'compiled' if compiled else 'eager'}: {what}"


def test_compiled_fp8_linear_on_gpu_equals_eager():
    """Under torch.compile the FP8 linear is custom ops inside the graph; on each GPU backend they compute the eager
    path's exact bits (y, dx, dw), 300 tokens (not a multiple of 128), Inductor compiling the code around it, with
    the weight quantized in the graph or read from a cache prepared before (as a compiled block does), and with
    its input's RMSNorm fused into the quantizer or not."""
    from megafp8.model.norm import RMSNorm
    from megafp8.precision import Fp8WeightCache, fp8_linear

    recipe = Fp8Recipe()
    torch.manual_seed(0)
    w0 = torch.randn(384, 512, device=CUDA).mul(0.02).to(torch.bfloat16)
    x0 = torch.randn(3, 100, 512, device=CUDA, dtype=torch.bfloat16)
    norm = RMSNorm(512, 1e-5, torch.bfloat16, CUDA)
    for backend in fast_backends():
        for prepared, fused_norm in ((False, False), (True, False), (True, True)):
            cache = Fp8WeightCache()

            def f(x, w):
                if fused_norm:
                    return fp8_linear(x, w, cache, recipe, backend, norm=norm)
                return fp8_linear(x, w, cache, recipe, backend)

            runs = []
            for fn in (f, torch.compile(f)):
                torch._dynamo.reset()
                x, w = x0.clone().requires_grad_(True), torch.nn.Parameter(w0.clone())
                cache.clear()
                if prepared and fn is not f:
                    cache.prepare(w, backend, recipe.fmt, recipe.power_of_two_scales)
                y = fn(x, w)
                y.backward(torch.ones_like(y) * 0.01)
                runs.append((y, x.grad, w.grad))
            for got, want, what in zip(runs[1], runs[0], ("y", "dx", "dw")):
                what = "dx through the norm" if what == "dx" and fused_norm else what
                assert_compiled_bits(got, want, what, f"{backend.name} {what} differs compiled (prepared {prepared},"
                                                      f" fused norm {fused_norm})")
            graphs = torch._dynamo.explain(f)(x0, w).graphs  # w: the compiled run's weight, its cache prepared
            code = "\n".join(g.print_readable(print_output=False) for g in graphs)
            assert "megafp8.gemm_1x128_128x128" in code and ("megafp8.quantize_weight" in code) != prepared


def test_fp8_training_on_gpu_learns(tiny_overrides):
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["training.steps=12"])
    trainer = Trainer(cfg, ParallelDims.single(), CUDA)
    assert trainer.model.layers[0].mlp.down_proj.fp8_backend is None  # resolved lazily, logged at build
    losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
    assert trainer.model.layers[0].mlp.down_proj.fp8_backend.name in ("deepgemm", "hopper", "cublas", "triton")
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("name", ["cublas", "hopper"])
def test_cublaslt_adds_the_weight_gradient_into_main_grad(name, monkeypatch):
    """The cublas and hopper backends' weight gradient into an FP32 main_grad: cuBLASLt adds the FP32 product in its
    epilogue (SM90 must take this path, not the fallback: the GEMM-then-add is refused here), equal to the
    reference's product added in FP32 up to the tensor cores' accumulation inside each 128-wide block (6.8e-5
    measured on these outlier-laden operands, job Y), on a layer's shape and on views into a larger gradient buffer
    (offset, as `main_grad`s are)."""
    from megafp8.precision import E4M3
    from megafp8.precision.backends.triton_backend import TritonBackend
    from megafp8.precision.kernels import cublaslt
    from tests.fp8_checks import outlier_tensor
    if why_unavailable(name, CUDA) is not None:
        pytest.skip(why_unavailable(name, CUDA))
    assert cublaslt.cached_unavailable_reason(CUDA) is None
    backend, reference = select_backend(name, CUDA), select_backend("reference", CUDA)

    def no_fallback(*args, **kwargs):
        raise AssertionError(f"the {name} backend's weight gradient took the GEMM-then-add fallback")
    monkeypatch.setattr(TritonBackend, "gemm_1x128_1x128_accumulate_", no_fallback)
    for n, k, tokens in ((384, 512, 1000), (2048, 5632, 4096)):
        dy = outlier_tensor(tokens, n, seed=1, device=CUDA)
        x = outlier_tensor(tokens, k, seed=2, device=CUDA)
        dyt, dyt_s = backend.quantize_rows_cols(dy, E4M3, False)[2:]
        xt, xt_s = backend.quantize_rows_cols(x, E4M3, False)[2:]
        buffer = torch.randn(n * k + 4096, device=CUDA)
        head, main_grad = buffer[:4096].clone(), buffer[4096:].view(n, k)
        want = main_grad + reference.gemm_1x128_1x128(dyt, dyt_s, xt, xt_s, torch.float32)
        backend.gemm_1x128_1x128_accumulate_(main_grad, dyt, dyt_s, xt, xt_s)
        err = float((main_grad - want).norm() / want.norm())
        assert err < 5e-4, f"{n}x{k}x{tokens}: rel err {err:.2e}"
        assert torch.equal(buffer[:4096], head)  # nothing written outside the view


def test_the_hopper_backend_runs_dense_fprop_and_dgrad_on_the_warp_specialized_kernel(monkeypatch):
    """Under `hopper` a dense layer's 1x128 x 128x128 GEMMs (fprop, and dgrad on the weight's transpose) run on the
    warp-specialized kernel, not cuBLAS (`F.scaled_mm` is refused here), and give cuBLAS's results up to summation
    order, in BF16 and FP32, at token counts off the 128-row grid (TMA clips the last tile)."""
    import torch.nn.functional as F

    from megafp8.precision import E4M3
    from tests.fp8_checks import outlier_tensor
    if why_unavailable("hopper", CUDA) is not None:
        pytest.skip(why_unavailable("hopper", CUDA))
    hopper, cublas = select_backend("hopper", CUDA), select_backend("cublas", CUDA)
    w = hopper.empty_weight(torch.Size((384, 512)), E4M3, CUDA)
    hopper.quantize_weight_(outlier_tensor(384, 512, seed=3, device=CUDA), w, E4M3, False)
    wanted = {}
    for tokens in (200, 1000):
        x = hopper.quantize_rows(outlier_tensor(tokens, 512, seed=1, device=CUDA), E4M3, False)
        dy = hopper.quantize_rows(outlier_tensor(tokens, 384, seed=2, device=CUDA), E4M3, False)
        for dtype in (torch.bfloat16, torch.float32):
            wanted[tokens, dtype] = (cublas.gemm_1x128_128x128(*x, w.w_fp8, w.w_scale, dtype),
                                     cublas.gemm_1x128_128x128(*dy, w.wt_fp8, w.wt_scale, dtype), x, dy)

    def refused(*args, **kwargs):
        raise AssertionError("the hopper backend's dense GEMM went to cuBLAS")
    monkeypatch.setattr(F, "scaled_mm", refused)
    for (tokens, dtype), (want_y, want_dx, x, dy) in wanted.items():
        y = hopper.gemm_1x128_128x128(*x, w.w_fp8, w.w_scale, dtype)
        dx = hopper.gemm_1x128_128x128(*dy, w.wt_fp8, w.wt_scale, dtype)
        # BF16: one rounding either way; FP32: the two kernels' FP8 accumulation inside a 128-wide K step and their
        # summation orders (the conformance tests' bounds against the reference)
        limit = 4e-3 if dtype == torch.bfloat16 else 3e-4
        for got, want in ((y, want_y), (dx, want_dx)):
            assert got.dtype == dtype and got.shape == want.shape
            err = float((got.float() - want.float()).norm() / want.float().norm())
            assert err < limit, f"{tokens} tokens, {dtype}: relative error {err:.2e}"


QWEN_ATTENTION = ["model.attention.qk_norm=true", "model.attention.qkv_bias=true"]  # the unfused FP8 QKV + RoPE
RECOMPUTE = ["training.recompute=full"]


@pytest.mark.parametrize("config, extra", [
    ("tiny_dense_fp8", []), ("tiny_dense", []), ("tiny_moe_fp8", []), ("tiny_moe_fp8:bf16", []),
    ("tiny_dense_fp8", QWEN_ATTENTION), ("tiny_dense_fp8", RECOMPUTE), ("tiny_dense", RECOMPUTE),
    ("tiny_moe_fp8", RECOMPUTE), ("tiny_dense_fp8", RECOMPUTE + ["training.recompute_layers=1"])],
    ids=["dense_fp8", "dense_bf16", "moe_fp8", "moe_bf16", "dense_fp8_qk_norm_qkv_bias", "dense_fp8_recompute",
         "dense_bf16_recompute", "moe_fp8_recompute", "dense_fp8_recompute_one_block"])
def test_cuda_graphs_add_the_weight_gradients_into_main_grad_like_eager(tiny_overrides, config, extra):
    """Compiled blocks under CUDA graphs (`compile_mode: reduce-overhead`) add their weight gradients, FP8 and BF16,
    dense and MoE (the experts' grouped GEMMs inside the graphs), into main_grad inside the graphs, four micro-batches
    a step: the same gradient norms and losses as eager steps (a gradient added into a graph-owned copy instead would
    show as a different norm), and Inductor skipped CUDA graphs for none of the blocks (a skip would run them
    compiled without graphs and pass the comparison). Evaluation runs in between (no grad: other graphs) and gives
    the eager validation losses. With Qwen's query/key norms and q/k/v bias, FP8's QKV projection and RoPE run
    unfused (their own quantizers and RoPE's autograd backward) under the same check. With activation recomputation
    (every block, or the first only) the recomputed blocks' compiled backward recomputes them inside the graphs;
    checkpointing around the compiled blocks instead replayed their graphs inside backward and overwrote the other
    blocks' outputs (every such run stopped at its first step, job HQ)."""
    from torch._dynamo.utils import counters

    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    runs, evals = {}, {}
    config, _, recipe = config.partition(":")
    for mode in ("eager", "reduce-overhead"):
        mode_extra = [] if mode == "eager" else ["training.compile=true", f"training.compile_mode={mode}"]
        mode_extra += ([f"precision.recipe={recipe}"] if recipe else []) + extra
        cfg = load_config(config, tiny_overrides + ["training.steps=6", "training.eval_interval=3",
                                                     "logging.log_interval=1"] + mode_extra)
        torch._dynamo.reset()
        counters.clear()
        records = Trainer(cfg, ParallelDims.single(), CUDA).fit()
        runs[mode] = [r for r in records if r["kind"] == "train"]
        evals[mode] = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert len(runs["eager"]) == len(runs["reduce-overhead"]) == 6
    assert len(evals["eager"]) == len(evals["reduce-overhead"]) == 2
    assert evals["reduce-overhead"] == pytest.approx(evals["eager"], rel=0.01), evals
    for eager, graphed in zip(runs["eager"], runs["reduce-overhead"]):
        assert graphed["grad_norm"] == pytest.approx(eager["grad_norm"], rel=0.03), (eager, graphed)
        assert graphed["loss"] == pytest.approx(eager["loss"], rel=0.01), (eager, graphed)


@pytest.mark.parametrize("backend", ["hopper", "deepgemm", "auto"])
def test_a_run_under_cuda_graphs_resumes_in_a_new_process(tiny_overrides, backend):
    """A compiled FP8 run under CUDA graphs, checkpointed and launched again in a new process (as after a
    scheduler's stop), resumes and finishes. Each launch is a fresh process, so the new one's first GEMMs (for
    `deepgemm`, DeepGEMM's first call in that process) come inside the CUDA graph trees' warm-up runs (step 3 does
    not sample FP8 health, which would run the blocks uncompiled, as step 0 does): job GZ's resumed parity run
    stopped there ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs") until the backend made
    DeepGEMM's runtime eagerly (`deepgemm_backend.create_runtime`). `auto` picks `deepgemm` where DeepGEMM runs
    (its check then comes at build, before anything is compiled), else `hopper`, and the log says which."""
    picks = backend
    if backend == "auto":
        picks = "deepgemm" if why_unavailable("deepgemm", CUDA) is None else "hopper"
    reason = why_unavailable(picks, CUDA)
    if reason is not None:
        pytest.skip(reason)
    args = [sys.executable, "launch/pretrain.py", "--config", "tiny_dense_fp8", *tiny_overrides,
            "training.compile=true", "training.compile_mode=reduce-overhead", f"precision.fp8_backend={backend}",
            "training.eval_interval=0", "checkpoint.interval=3", "checkpoint.resume=auto"]
    for steps, says in ((3, "step 3/"), (5, "resuming")):
        done = subprocess.run(args + [f"training.steps={steps}"], capture_output=True, text=True, cwd=REPO,
                              env=torchrun_env(), timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-3000:]
        assert says in output, output[-3000:]
        assert f"fp8: backend {picks}{' (auto)' if backend == 'auto' else ''} |" in output, output[-3000:]
        if backend == "auto" and picks == "hopper":  # and why not deepgemm
            assert "fp8: auto did not pick the deepgemm backend: " in output, output[-3000:]
    assert "step 5/5" in output, output[-3000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_high_precision_weight_gradients_are_added_into_main_grad_by_the_gemm(dtype):
    """A BF16 (FP16) layer's weight gradient goes into its FP32 main_grad through one GEMM with FP32 C (torch.addmm
    with out_dtype, not the product then an add): closer to the FP64 sum than BF16 dw added in FP32, on a layer's
    shape and on a view into a larger gradient buffer (offset, as `main_grad`s are), nothing written outside it."""
    from megafp8.precision.bf16_linear import accumulate_product_, fused_accumulation_reason
    assert fused_accumulation_reason(CUDA, dtype) is None, fused_accumulation_reason(CUDA, dtype)
    g = torch.Generator(device=CUDA).manual_seed(0)
    for n, k, tokens in ((384, 512, 1000), (2048, 5632, 4096)):
        dy = torch.randn(tokens, n, device=CUDA, generator=g).to(dtype)
        x = torch.randn(tokens, k, device=CUDA, generator=g).to(dtype)
        buffer = torch.randn(n * k + 4096, device=CUDA, generator=g)
        head, main_grad = buffer[:4096].clone(), buffer[4096:].view(n, k)
        start = main_grad.double()
        exact = start + dy.t().double() @ x.double()
        unfused = main_grad + (dy.t() @ x).float()
        accumulate_product_(main_grad, dy.t(), x)
        err = float((main_grad.double() - exact).norm() / exact.norm())
        err_unfused = float((unfused.double() - exact).norm() / exact.norm())
        assert err < 1e-5 and err < 0.5 * err_unfused, (n, k, err, err_unfused)
        assert torch.equal(buffer[:4096], head)


def _rope_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of 64-wide heads over 64 positions, on the GPU."""
    from megafp8.model.rope import RotaryEmbedding
    rope = RotaryEmbedding(64, 64, 10000.0, device=CUDA)
    return rope.cos, rope.sin


def _kernel_outputs() -> dict:
    """Every Triton quantizer and producer on awkward shapes (rows past a tile's end, a nan), by name."""
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import producers as kp, quantize as kq, tiles
    torch.manual_seed(0)
    x = (torch.randn(200, 384, device=CUDA) * torch.logspace(-3, 3, 384, device=CUDA)).to(torch.bfloat16)
    x[17, 5] = float("nan")
    gu = torch.randn(200, 512, device=CUDA, dtype=torch.bfloat16) * 4
    da = torch.randn(200, 256, device=CUDA, dtype=torch.bfloat16)
    w = (torch.rand(384, device=CUDA) + 0.5).to(torch.bfloat16)
    index = torch.randperm(512, device=CUDA) % 300 - 100  # rows of x, and zero rows where negative
    # The Triton column kernel by itself: on SM90 swiglu_backward_quantize takes the Gluon one instead.
    triton_cols = (*tiles.rows_cols_outputs(200, 512, E5M2, CUDA)[2:],
                   *tiles.rows_cols_outputs(200, 256, E4M3, CUDA)[2:])
    kp.swiglu_backward_cols(gu, da, *triton_cols, E4M3, E5M2, False)
    return {"rows": kq.quantize_rows(x, E4M3, False), "rows_cols": kq.quantize_rows_cols(x, E5M2, True),
            "gathered_rows_cols": kq.gather_quantize_rows_cols(x, index, E4M3, False),
            "rmsnorm": kp.rmsnorm_quantize(x, w, 1e-5, E4M3, False),
            "swiglu": kp.swiglu_quantize(gu, E4M3, True),
            "swiglu_backward": kp.swiglu_backward_quantize(gu, da, E4M3, E5M2, False),
            "rope_backward": kp.rope_backward_quantize(gu[:, :256], da[:, :128], x[:, :128], *_rope_tables(), 64, 64,
                                                       E5M2, False),
            "swiglu_backward_triton_columns": triton_cols}


def _assert_same_bits(got: dict, want: dict, what: str) -> None:
    """Every output equal: FP8 values and FP32 scales (and RMSNorm's rstd) pairwise, nan matching nan."""
    for name, tensors in want.items():
        outputs = list(zip(got[name], tensors))
        for i in range(0, len(outputs) - 1, 2):
            assert_same_quantization(*zip(*outputs[i:i + 2]), f"{what}: {name} outputs {i}, {i + 1}")
        if len(outputs) % 2:  # rmsnorm's rstd
            assert torch.equal(*(t.nan_to_num(7.0) for t in outputs[-1])), f"{what}: {name}'s last output differs"


def test_every_autotuned_configuration_of_every_kernel_gives_the_same_bits():
    """The autotuner picks a configuration per shape and GPU, by timing, so maybe differently in the next run; each
    must compute the same bytes and scales, or a resumed run would not repeat its bits."""
    pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner
    from megafp8.precision.kernels import producers as kp, quantize as kq
    want = _kernel_outputs()
    kernels = [k for mod in (kp, kq) for k in vars(mod).values() if isinstance(k, Autotuner)]
    assert len(kernels) >= 6
    for kernel in kernels:
        saved = kernel.configs, kernel.cache
        try:
            for config in saved[0]:
                kernel.configs, kernel.cache = [config], {}
                _assert_same_bits(_kernel_outputs(), want, f"{kernel.fn.__name__} with {config}")
        finally:
            kernel.configs, kernel.cache = saved
