"""The MoE experts on the GPU (skipped without CUDA): the grouped GEMM kernels (TMA, warp-specialized) against the
pointer kernels, the permutation kernels against their pure-torch twins, the MoE layer compiled whole against eager,
weight gradients added into FP32 `main_grad`, and MoE steps that never make the host wait.

The kernels' own bits against the reference backend are checked by `tests/test_fp8_backends.py`; the FP8 layers
built on the same kernels by `tests/test_fp8_gpu.py`.
"""
from __future__ import annotations

import pytest
import torch

from megafp8.precision import PrecisionRecipe

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def _grouped_problem(rows, n: int = 384, k: int = 256) -> tuple:
    """Operands of the grouped GEMMs over the layout `rows` (outlier-laden, reference-quantized, on the GPU) and the
    pointer kernels' results: (a, a_s, b, b_s, at, at_s, bt, bt_s, fprop (rows, n), wgrad (E, n, k))."""
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.kernels import gemm
    from tests.fp8_checks import outlier_tensor
    a, a_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(rows.total, k), E4M3))
    w = [ref.quantize_128x128(outlier_tensor(n, k, seed=10 + e), E4M3) for e in range(rows.tile_start.shape[0])]
    b, b_s = (torch.stack([pair[i] for pair in w]).to(CUDA) for i in (0, 1))
    at, at_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(n, rows.total, seed=3), E4M3))
    bt, bt_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(k, rows.total, seed=4), E4M3))
    want_y = gemm.grouped_gemm(a, a_s, b, b_s, rows.tile_expert, torch.float32, kernel="pointer")
    want_dw = gemm.grouped_wgrad(at, at_s, bt, bt_s, rows.tile_start, rows.tile_count, torch.float32,
                                 kernel="pointer")
    return a, a_s, b, b_s, at, at_s, bt, bt_s, want_y, want_dw


def test_grouped_gemm_kernels_with_tma_match_the_pointer_kernels_in_every_configuration():
    """The TMA grouped GEMMs (fprop/dgrad, wgrad) against the plain ones, with N not a multiple of a 256-wide block
    (a block reads past its expert's rows into the next expert's) and an expert without rows."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources
    from megafp8.precision.grouped import expert_rows
    from megafp8.precision.kernels import gemm
    if not gemm.uses_tma(CUDA):
        pytest.skip("no TMA on this GPU")
    rows = expert_rows([130, 0, 256, 5], CUDA)
    a, a_s, b, b_s, at, at_s, bt, bt_s, want_y, want_dw = _grouped_problem(rows)
    assert not want_dw[1].any()
    for kernel, run, want in ((gemm._grouped_gemm_tma_kernel, lambda: gemm.grouped_gemm(
            a, a_s, b, b_s, rows.tile_expert, torch.float32, kernel="tma"), want_y),
            (gemm._grouped_wgrad_tma_kernel, lambda: gemm.grouped_wgrad(
                at, at_s, bt, bt_s, rows.tile_start, rows.tile_count, torch.float32, kernel="tma"), want_dw)):
        saved = kernel.configs, kernel.cache
        try:
            ran = 0
            for config in saved[0]:
                kernel.configs, kernel.cache = [config], {}
                try:
                    got = run()
                except OutOfResources:  # the autotuner skips it too (e.g. FP32 C's tile)
                    continue
                ran += 1
                err = float((got - want).norm() / want.norm())
                assert err < 1e-6, f"{kernel.fn.__name__} with {config}: relative error {err}"
            assert ran >= len(saved[0]) // 2, f"{kernel.fn.__name__}: only {ran} configurations fit"
        finally:
            kernel.configs, kernel.cache = saved


def test_moe_permutation_kernels_match_their_pure_torch_twins():
    """The gather-sum and the weighted combine (forward and backward) on CUDA against their twins run on the same
    GPU tensors: the same FP32 sums in the same order, so the same bits; the combine's weight gradient (a dot
    product over the features, summed in the kernel's own order) within FP32 rounding."""
    pytest.importorskip("triton")
    from megafp8.parallel import permute, permute_kernels
    g = torch.Generator(device=CUDA).manual_seed(0)
    tokens, k, hidden = 1000, 8, 384
    row_to_source = torch.randperm(tokens * k, device=CUDA, generator=g) // k
    source_to_rows = torch.argsort(row_to_source, stable=True).view(tokens, k)
    d = torch.randn(tokens * k, hidden, device=CUDA, generator=g).bfloat16()
    assert torch.equal(permute_kernels.gather_sum(d, source_to_rows), permute.gather_sum_reference(d, source_to_rows))
    y = torch.randn(tokens * k + 300, hidden, device=CUDA, generator=g).bfloat16()  # 300 rows no token names
    pos = torch.randperm(tokens * k + 300, device=CUDA, generator=g)[:tokens * k].view(tokens, k)
    weights = torch.rand(tokens, k, device=CUDA, generator=g)
    assert torch.equal(permute_kernels.combine(y, pos, weights), permute.combine_reference(y, pos, weights))
    dout = torch.randn(tokens, hidden, device=CUDA, generator=g).bfloat16()
    dy, dweights = permute_kernels.combine_backward(dout, y, pos, weights, torch.zeros_like(y))
    want_dy, want_dweights = permute.combine_backward_reference(dout, y, pos, weights)
    assert torch.equal(dy, want_dy)
    torch.testing.assert_close(dweights, want_dweights, rtol=1e-5, atol=1e-5 * float(want_dweights.abs().max()))
    # the weights' gradient alone (the FP8 experts quantize dy themselves): the same launcher without dy
    torch.testing.assert_close(permute_kernels.combine_weights_grad(dout, y, pos), want_dweights, rtol=1e-5,
                               atol=1e-5 * float(want_dweights.abs().max()))
    assert torch.equal(permute.combine_weights_grad_reference(dout, y, pos), want_dweights)
    # the dispatch's gather as a copy kernel (`permute.GATHER_ROWS_BY_BLOCKS`), rows not a whole number of blocks,
    # features not of 128: index_select's bytes, either walk
    source = torch.randn(tokens, hidden + 64, device=CUDA, generator=g).bfloat16()
    index = row_to_source[:tokens * k - 5]
    for rows_first in (True, False):
        assert torch.equal(permute_kernels.gather_rows(source, index, rows_first), source.index_select(0, index))


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_compiled_moe_layer_on_gpu_is_one_graph_and_matches_eager(recipe):
    """The MoE layer under torch.compile with Inductor, whole (`fullgraph`: the experts' grouped GEMMs, the gathering
    quantizer and the combine are ops of the graph), against the same layer run eagerly."""
    from megafp8.config import ModelConfig, MoeConfig
    from megafp8.model import init_weights
    from megafp8.model.moe import MoE
    from megafp8.parallel import ExpertParallel, TensorParallel
    from megafp8.precision import GemmLayer

    cfg = ModelConfig(hidden_size=256, num_heads=2, moe=MoeConfig(num_experts=8, top_k=2, ffn_hidden_size=256,
                                                                  num_shared_experts=1, first_dense_layers=0))
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        moe = MoE(cfg.moe, cfg.hidden_size, PrecisionRecipe.from_name(recipe), TensorParallel.single(),
                  ExpertParallel.single(), device=CUDA)
        init_weights(moe, cfg, seed=0)
        if compiled:  # as `Block.forward` does before its compiled code: the weights quantized eagerly
            for layer in moe.modules():
                if isinstance(layer, GemmLayer):
                    layer.prepare_for_compiled()
        run = torch.compile(moe, fullgraph=True) if compiled else moe
        x = torch.randn(300, 256, generator=torch.Generator().manual_seed(1)).bfloat16().to(CUDA).requires_grad_()
        y, _ = run(x, batch=3, seq_len=100)
        y.float().square().sum().backward()
        results.append((y.float(), x.grad.float(), moe.experts.down_proj.weight.grad.float(),
                        moe.experts.gate_up_proj.weight.grad.float()))
    for eager, compiled in zip(*results):
        assert (eager - compiled).norm() <= 2**-5 * eager.norm()


def test_grouped_wgrad_adds_into_fp32_main_grad_once_even_while_autotuning():
    """`grouped_wgrad(..., accumulate=main_grad)` adds the FP32 product into main_grad, with each kernel (pointer,
    TMA, warp-specialized), also on a call that autotunes (each trial configuration runs on a restored copy)."""
    pytest.importorskip("triton")
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.grouped import expert_rows
    from megafp8.precision.kernels import gemm
    from tests.fp8_checks import outlier_tensor
    counts = [130, 0, 256, 5]
    rows = expert_rows(counts, CUDA)
    n, k = 384, 256
    at, at_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(n, rows.total, seed=3), E4M3))
    bt, bt_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(k, rows.total, seed=4), E4M3))
    want = gemm.grouped_wgrad(at, at_s, bt, bt_s, rows.tile_start, rows.tile_count, torch.float32,
                              kernel="pointer")
    base = torch.randn(len(counts), n, k, device=CUDA)
    for kernel in _grouped_kernels_here(gemm):
        for autotuned in (gemm._grouped_wgrad_tma_kernel, gemm._grouped_wgrad_kernel):
            autotuned.cache = {}  # autotune again, on this accumulating call
        main_grad = base.clone()
        out = gemm.grouped_wgrad(at, at_s, bt, bt_s, rows.tile_start, rows.tile_count, torch.bfloat16,
                                 kernel=kernel, accumulate=main_grad)
        assert out.data_ptr() == main_grad.data_ptr()
        err = float((main_grad - base - want).norm() / want.norm())
        assert err < 1e-5, f"{kernel}: relative error {err}"
        assert torch.equal(main_grad[1], base[1])


def _grouped_kernels_here(gemm) -> list[str]:
    """The grouped kernels this GPU runs: pointers everywhere, TMA from SM90, warp-specialized on SM90."""
    return ["pointer"] + (["tma"] if gemm.uses_tma(CUDA) else []) + \
        (["ws"] if gemm.warp_specialized_unavailable(CUDA) is None else [])


def test_warp_specialized_gemms_match_the_pointer_kernels():
    """The warp-specialized (Gluon) kernel against the pointer kernels, both tile widths: grouped fprop with N not
    a multiple of 256 (a tile's second half reads the next expert's rows and is not stored), an expert without rows
    and padding tiles past the last expert's; grouped wgrad; a dense wgrad whose sizes are not multiples of 128
    (rows and columns past the edge masked), written in BF16 and added into FP32."""
    pytest.importorskip("triton")
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.grouped import expert_rows
    from megafp8.precision.kernels import gemm
    from tests.fp8_checks import outlier_tensor
    if gemm.warp_specialized_unavailable(CUDA) is not None:
        pytest.skip(gemm.warp_specialized_unavailable(CUDA))
    counts = torch.tensor([130, 0, 256, 5])
    rows = expert_rows(counts.to(CUDA), CUDA, rows=int(counts.sum()))  # device counts: padding tiles at the end
    assert (rows.tile_expert == -1).any()
    a, a_s, b, b_s, at, at_s, bt, bt_s, want_y, want_dw = _grouped_problem(rows)
    dn, dk, tokens = 200, 328, 640
    dt, dt_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(dn, tokens, seed=5), E4M3))
    xt, xt_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(dk, tokens, seed=6), E4M3))
    want_dense = (ref.dequantize_1x128(dt.cpu(), dt_s.cpu()).double() @
                  ref.dequantize_1x128(xt.cpu(), xt_s.cpu()).double().t()).float().to(CUDA)
    base = torch.randn(dn, dk, device=CUDA)
    for block_n in (128, 256):
        checks = {
            "grouped fprop": (gemm.grouped_gemm(a, a_s, b, b_s, rows.tile_expert, torch.float32, kernel="ws",
                                                block_n=block_n), want_y),
            "grouped wgrad": (gemm.grouped_wgrad(at, at_s, bt, bt_s, rows.tile_start, rows.tile_count,
                                                 torch.float32, kernel="ws", block_n=block_n), want_dw),
            "dense wgrad": (gemm.wgrad(dt, dt_s, xt, xt_s, torch.float32, block_n=block_n), want_dense),
            "dense wgrad, accumulated": (gemm.wgrad(dt, dt_s, xt, xt_s, torch.bfloat16, accumulate=base.clone(),
                                                    block_n=block_n) - base, want_dense),
        }
        for name, (got, want) in checks.items():
            # Against the pointer kernels (the same tensor-core products) to FP32 rounding; the dense wgrad against
            # an FP64 product, to the tensor cores' FP8 accumulation within a 128-wide K step (about 2^-14 relative,
            # measured 9.5e-5; a wrong tile or scale is off by O(1)).
            tolerance = 1e-3 if name.startswith("dense") else 1e-5
            err = float((got - want).norm() / want.norm())
            assert err < tolerance, f"{name}, block_n={block_n}: relative error {err}"
        assert not checks["grouped wgrad"][0][1].any()
        assert not checks["grouped fprop"][0][rows.tile_expert.repeat_interleave(128) == -1].any()


@pytest.mark.parametrize("tma_store", [True, False])
def test_experts_without_rows_leave_their_main_grad_untouched(tma_store):
    """The warp-specialized grouped wgrad into main_grad with most experts idle (as a young router leaves them: in
    the MoE benchmark's first steps 33-52 of 64 experts got no rows, job FS): an idle expert's main_grad keeps its
    exact bits, -0.0 and NaN included (its tiles add nothing, not even a zero, and skip their epilogue); the busy
    experts' sums are the pointer kernel's to FP32 rounding, the TMA reduction's and the registers' alike. The
    programs share out only the busy experts' tiles (the compact walk, busy experts between idle ones and at both
    ends): the same bits as walking every expert's tiles."""
    pytest.importorskip("triton")
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.grouped import expert_rows
    from megafp8.precision.kernels import gemm
    from tests.fp8_checks import outlier_tensor
    if gemm.warp_specialized_unavailable(CUDA) is not None:
        pytest.skip(gemm.warp_specialized_unavailable(CUDA))
    from megafp8.precision.kernels.ws_gemm import ws_gemm
    counts = torch.zeros(24, dtype=torch.long)
    counts[[0, 2, 3, 11, 20, 23]] = torch.tensor([129, 700, 130, 1, 256, 384])
    rows = expert_rows(counts.to(CUDA), CUDA, rows=int(counts.sum()))
    n, k = 384, 512
    at, at_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(n, rows.total, seed=3), E4M3))
    bt, bt_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(k, rows.total, seed=4), E4M3))
    want = gemm.grouped_wgrad(at, at_s, bt, bt_s, rows.tile_start, rows.tile_count, torch.float32, kernel="pointer")
    base = torch.randn(24, n, k, device=CUDA)
    base[1, 0, :5] = torch.tensor([-0.0, float("nan"), float("-inf"), -0.0, 1e-40])  # (experts 1 and 7 are idle)
    base[7].fill_(-0.0)
    idle = counts == 0
    for block_n in (128, 256):
        main_grad = base.clone()
        gemm.grouped_wgrad(at, at_s, bt, bt_s, rows.tile_start, rows.tile_count, torch.float32, kernel="ws",
                           accumulate=main_grad, block_n=block_n, tma_store=tma_store)
        assert torch.equal(main_grad[idle].view(torch.int32), base[idle].view(torch.int32)), f"block_n={block_n}"
        busy = ~idle
        err = float((main_grad[busy] - base[busy] - want[busy]).norm() / want[busy].norm())
        assert err < 1e-5, f"block_n={block_n}: relative error {err}"
        every_group = base.clone()
        ws_gemm(at, at_s, bt, bt_s, every_group, b_blockwise=False, accumulate=True, k_start=rows.tile_start,
                k_count=rows.tile_count, block_n=block_n, tma_store=tma_store, compact_groups=False)
        assert torch.equal(main_grad.view(torch.int32), every_group.view(torch.int32)), f"block_n={block_n}"
    # More experts than a consumer warpgroup's threads (the walk's ranks over 256 lanes), three of 200 busy
    many = torch.zeros(200, dtype=torch.long)
    many[[5, 130, 199]] = torch.tensor([300, 128, 1])
    rows = expert_rows(many.to(CUDA), CUDA, rows=int(many.sum()))
    at, at_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(n, rows.total, seed=5), E4M3))
    bt, bt_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(k, rows.total, seed=6), E4M3))
    outputs = [torch.zeros(200, n, k, device=CUDA) for _ in range(2)]
    for compact, out in zip((True, False), outputs):
        ws_gemm(at, at_s, bt, bt_s, out, b_blockwise=False, accumulate=True, k_start=rows.tile_start,
                k_count=rows.tile_count, tma_store=tma_store, compact_groups=compact)
    assert torch.equal(outputs[0].view(torch.int32), outputs[1].view(torch.int32))
    assert outputs[0][[5, 130, 199]].flatten(1).abs().amax(1).gt(0).all() and not outputs[0][many == 0].any()


def test_the_weight_quantizer_on_the_gpu_quantizes_only_stale_experts_with_rows():
    """The Triton weight quantizer with per-expert versions (`Fp8WeightCache.per_expert`) at the MoE benchmark's
    expert shape: the stale experts with rows get the reference quantizer's exact bytes and scales and are marked
    current, every other expert's bytes, scales and version are left as they were; then the stale rest alone."""
    pytest.importorskip("triton")
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.kernels import quantize
    e, n, k = 64, 2816, 2048
    w = torch.randn(e, n, k, device=CUDA).to(torch.bfloat16)
    w[5, :128, :128] *= 1e4  # an outlier block
    want_q, want_s = ref.quantize_128x128(w.float().view(e * n, k).cpu(), E4M3)
    want_q, want_s = want_q.view(e, n, k).to(CUDA), want_s.view(e, n // 128, k // 128).to(CUDA)
    q = torch.full((e, n, k), 0x7F, dtype=torch.uint8, device=CUDA).view(torch.float8_e4m3fn)
    s = torch.full((e, n // 128, k // 128), float("nan"), device=CUDA)
    version = torch.full((e,), 6, dtype=torch.int64, device=CUDA)
    version[::2] = -1  # even experts stale
    current = torch.tensor([6], device=CUDA)
    used = torch.zeros(e, dtype=torch.int32, device=CUDA)
    used[[0, 1, 5, 10, 63]] = torch.tensor([3, 1, 7, 1, 2], dtype=torch.int32, device=CUDA)
    before = version.clone()
    quantize.quantize_weight_(w, q, s, None, None, E4M3, False, (version, current, used))
    chosen = (before != 6) & (used > 0)
    assert chosen.tolist().count(True) == 2  # experts 0 and 10
    for i in range(e):
        same = torch.equal(q[i].view(torch.uint8), want_q[i].view(torch.uint8)) and torch.equal(s[i], want_s[i])
        untouched = bool((q[i].view(torch.uint8) == 0x7F).all()) and bool(s[i].isnan().all())
        assert (same if chosen[i] else untouched), i
    assert torch.equal(version, torch.where(chosen, 6, before))
    quantize.quantize_weight_(w, q, s, None, None, E4M3, False, (version, current, None))
    stale_before = before != 6
    for i in range(e):
        if stale_before[i]:
            assert torch.equal(q[i].view(torch.uint8), want_q[i].view(torch.uint8)), i
        else:
            assert bool((q[i].view(torch.uint8) == 0x7F).all()), i  # current already: left alone
    assert bool((version == 6).all())


def _relative_differences(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """Each tensor's relative difference, ||got - want|| / ||want|| in FP32."""
    return [float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) for a, b in zip(got, want)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_micro_batches_in_flight_on_the_gpu_get_the_gradients_of_one_after_another(tiny_overrides, compiled):
    """As `tests/test_moe_idle_experts.py`'s CPU test, with the Triton kernels writing the experts' cache: two forwards
    in flight then their backwards give the gradients of forward-backward twice, and no backward is refused.

    Compiled, not to the bit: in job HY, after other GPU tests in the same process, one BF16 gradient of the
    in-flight run differed from forward-backward twice's by 0.54% (relative norm); in job HZ, in a fresh process,
    two runs of forward-backward twice and the in-flight run gave the same bits, eager and compiled. Kernels whose
    configuration is chosen by timing (per process) and atomic additions set the order of a sum, and a last-bit
    difference that flips an E4M3 rounding in the backward moves that element by up to 6% and every gradient
    upstream of it. Hence 2% compiled; eager, the same bits within 1e-5. An expert read before it was quantized
    (unwritten bytes) would be off by far more."""
    pytest.importorskip("triton")
    from tests.test_moe_idle_experts import in_flight_gradients
    one_after_another = in_flight_gradients(tiny_overrides, "triton", CUDA, compiled, in_flight=False)
    again = in_flight_gradients(tiny_overrides, "triton", CUDA, compiled, in_flight=False)
    in_flight = in_flight_gradients(tiny_overrides, "triton", CUDA, compiled, in_flight=True)
    assert len(in_flight) == len(one_after_another) > 0
    noise = _relative_differences(again, one_after_another)
    got = _relative_differences(in_flight, one_after_another)
    print(f"run to run {max(noise):.2e}, in flight {max(got):.2e} (largest relative difference of a gradient)")
    bound = 2e-2 if compiled else 1e-5
    assert all(d <= bound for d in got), [(tuple(t.shape), d, n) for t, d, n in zip(one_after_another, got, noise)]


def test_the_warp_specialized_gemms_tma_epilogue_writes_the_register_epilogues_bits():
    """Output tiles leave the warp-specialized kernel through shared memory by TMA (`ws_gemm.tma_store_fits`),
    stored or added into FP32 main_grad by TMA's reduction: the same bits as the register epilogue (load, add,
    store), both tile widths, for the grouped fprop with N not a multiple of 256 (TMA clips a tile's second half),
    an expert without rows and padding tiles; the grouped wgrad as a per-expert stack, written and added into; a
    dense wgrad with sizes off the 128 grid, written and added into. Each written output is allocated where a
    nan-filled tensor of its size was just freed, so an element left unwritten shows."""
    pytest.importorskip("triton")
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.grouped import expert_rows
    from megafp8.precision.kernels import gemm
    from tests.fp8_checks import outlier_tensor
    if gemm.warp_specialized_unavailable(CUDA) is not None:
        pytest.skip(gemm.warp_specialized_unavailable(CUDA))
    counts = torch.tensor([130, 0, 256, 5])
    rows = expert_rows(counts.to(CUDA), CUDA, rows=int(counts.sum()))
    a, a_s, b, b_s, at, at_s, bt, bt_s = _grouped_problem(rows)[:8]
    dt, dt_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(200, 640, seed=5), E4M3))
    xt, xt_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(328, 640, seed=6), E4M3))
    stack = torch.randn(4, at.shape[0], bt.shape[0], device=CUDA)
    dense = torch.randn(200, 328, device=CUDA)
    for block_n in (128, 256):
        for name, (shape, run) in {
            "grouped fprop": ((rows.total, b.shape[1]), lambda tma: gemm.grouped_gemm(
                a, a_s, b, b_s, rows.tile_expert, torch.bfloat16, kernel="ws", block_n=block_n, tma_store=tma)),
            "grouped fprop in FP32": (None, lambda tma: gemm.grouped_gemm(
                a, a_s, b, b_s, rows.tile_expert, torch.float32, kernel="ws", block_n=block_n, tma_store=tma)),
            "grouped wgrad": (tuple(stack.shape), lambda tma: gemm.grouped_wgrad(
                at, at_s, bt, bt_s, rows.tile_start, rows.tile_count, torch.bfloat16, kernel="ws", block_n=block_n,
                tma_store=tma)),
            "grouped wgrad into main_grad": (None, lambda tma: gemm.grouped_wgrad(
                at, at_s, bt, bt_s, rows.tile_start, rows.tile_count, torch.float32, kernel="ws",
                accumulate=stack.clone(), block_n=block_n, tma_store=tma)),
            "dense wgrad": ((200, 328), lambda tma: gemm.wgrad(dt, dt_s, xt, xt_s, torch.bfloat16, block_n=block_n,
                                                             tma_store=tma)),
            "dense wgrad into main_grad": (None, lambda tma: gemm.wgrad(
                dt, dt_s, xt, xt_s, torch.float32, accumulate=dense.clone(), block_n=block_n, tma_store=tma)),
        }.items():
            outputs = []
            for tma in (False, True):
                if shape is not None:
                    torch.full(shape, float("nan"), dtype=torch.bfloat16, device=CUDA)  # freed at once, reused
                outputs.append(run(tma))
            plain, by_tma = (t.view(torch.int16 if t.element_size() == 2 else torch.int32) for t in outputs)
            assert not outputs[0].isnan().any() and torch.equal(plain, by_tma), f"{name}, block_n={block_n}"


def test_interleaved_ffmas_write_the_same_bits():
    """`ws_gemm(interleave_ffma=True)` changes only scheduling flags of the promotion's FFMAs (`ffma_interleave`):
    the grouped fprop (an expert without rows, padding tiles) stored by TMA and from registers, and a dense fprop
    off the 128 grid in BF16 and FP32, the same bits as the plain kernel."""
    pytest.importorskip("triton")
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.grouped import expert_rows
    from megafp8.precision.kernels import gemm
    from megafp8.precision.kernels.ws_gemm import ws_gemm
    from tests.fp8_checks import outlier_tensor
    if gemm.warp_specialized_unavailable(CUDA) is not None:
        pytest.skip(gemm.warp_specialized_unavailable(CUDA))
    counts = torch.tensor([130, 0, 256, 5])
    rows = expert_rows(counts.to(CUDA), CUDA, rows=int(counts.sum()))
    a, a_s, b, b_s = _grouped_problem(rows, n=512, k=1024)[:4]
    x, x_s = (t.to(CUDA) for t in ref.quantize_1x128(outlier_tensor(200, 1024, seed=5), E4M3))
    w, w_s = (t.to(CUDA) for t in ref.quantize_128x128(outlier_tensor(384, 1024, seed=6), E4M3))
    runs = {
        "grouped fprop": lambda o: gemm.grouped_gemm(a, a_s, b, b_s, rows.tile_expert, torch.bfloat16, kernel="ws",
                                                     **o),
        "grouped fprop, stores from registers": lambda o: gemm.grouped_gemm(
            a, a_s, b, b_s, rows.tile_expert, torch.bfloat16, kernel="ws", tma_store=False, **o)}
    for dtype in (torch.bfloat16, torch.float32):
        runs[f"dense fprop, {dtype}"] = lambda o, dtype=dtype: ws_gemm(
            x, x_s, w, w_s, torch.empty(200, 384, dtype=dtype, device=CUDA), b_blockwise=True, **o)
    for name, run in runs.items():
        want, got = run({}), run(dict(interleave_ffma=True))
        as_int = torch.int16 if got.element_size() == 2 else torch.int32
        assert torch.equal(got.view(as_int), want.view(as_int)), name


def test_the_tma_reduction_into_main_grad_adds_and_keeps_subnormal_gradients():
    """Adding into main_grad by TMA's reduction gives the register epilogue's `c + product` bits where the product
    is not zero, and leaves main_grad as it is where the product is zero, FP32 subnormals included (a reduction that
    flushed subnormals to zero, or one that added nothing, would fail)."""
    pytest.importorskip("triton")
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.kernels import gemm
    if gemm.warp_specialized_unavailable(CUDA) is not None:
        pytest.skip(gemm.warp_specialized_unavailable(CUDA))
    dy = torch.randn(256, 256)
    dy[:128] = 0  # the product's first 128 rows are zero
    dt, dt_s = (t.to(CUDA) for t in ref.quantize_1x128(dy, E4M3))
    xt, xt_s = (t.to(CUDA) for t in ref.quantize_1x128(torch.randn(256, 256), E4M3))
    main_grad = torch.randn(256, 256, device=CUDA)
    main_grad[:128] = 1e-40  # subnormal in FP32
    main_grad[:128:2] = 3.0
    got, want = (gemm.wgrad(dt, dt_s, xt, xt_s, torch.float32, accumulate=main_grad.clone(), tma_store=tma)
                 for tma in (True, False))
    assert torch.equal(got[:128].view(torch.int32), main_grad[:128].view(torch.int32))
    assert not torch.equal(got[128:], main_grad[128:]) and torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_bf16_grouped_wgrad_gives_an_expert_without_rows_exact_zeros_without_a_host_sync():
    """On SM90 the BF16 grouped linear takes its counts from the device and trusts `torch._grouped_mm` to write
    zeros for an expert with no rows (SM100's kernel does not: pytorch/pytorch#172439); checked here with the
    allocator's free memory poisoned with nan first, under the sync checker."""
    from megafp8.precision.grouped import grouped_linear

    if torch.cuda.get_device_capability(CUDA)[0] != 9:
        pytest.skip("the device-count BF16 path runs on compute capability 9.x only")
    counts = torch.tensor([40, 0, 88, 0], device=CUDA)
    w = (0.05 * torch.randn(4, 256, 128, device=CUDA)).to(torch.bfloat16).requires_grad_(True)
    x = torch.randn(128, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    torch.full((64, 1024, 1024), float("nan"), device=CUDA)  # freed at once: its blocks are reused below
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_linear(x, w, counts, None, None, None)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1])) and torch.equal(w.grad[3], torch.zeros_like(w.grad[3]))
    want = (torch.ones(40, 256, device=CUDA).t() @ x[:40].float())
    torch.testing.assert_close(w.grad[0].float(), want, rtol=1e-2, atol=1e-2)


def test_the_bf16_experts_weight_gradient_add_on_the_gpu_adds_only_the_experts_with_rows():
    """The Triton add of the BF16 experts' weight gradient into FP32 `main_grad` at the MoE benchmark's expert
    shape: the experts with rows get `add_`'s exact bits, the others are never read (NaN there stays out) nor
    written; then through the BF16 grouped linear, eagerly, `main_grad` gains what `w.grad` gets without one."""
    pytest.importorskip("triton")
    from megafp8.precision.grouped import add_experts_with_rows_into_, grouped_linear
    e, n, k = 16, 2816, 2048
    out = torch.randn(e, n, k, device=CUDA)
    x = torch.randn(e, n, k, device=CUDA).to(torch.bfloat16)
    counts = torch.tensor([3, 0, 0, 130] * 4, device=CUDA)
    idle = counts == 0
    x[idle] = float("nan")
    want = out + x.float()
    before = out.clone()
    add_experts_with_rows_into_(out, x, torch.cumsum(counts, 0).to(torch.int32))
    assert torch.equal(out[~idle], want[~idle]) and torch.equal(out[idle], before[idle])

    counts = torch.tensor([40, 0, 88, 0], device=CUDA)
    w = (0.05 * torch.randn(4, 256, 128, device=CUDA)).to(torch.bfloat16).requires_grad_(True)
    x = torch.randn(128, 128, device=CUDA, dtype=torch.bfloat16)
    grouped_linear(x, w, counts, None, None, None).square().sum().backward()
    plain, w.grad = w.grad.clone(), None
    w.main_grad = torch.full(w.shape, 0.5, device=CUDA)
    grouped_linear(x, w, counts, None, None, None).square().sum().backward()
    assert w.grad is None and torch.equal(w.main_grad, 0.5 + plain.float())


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_a_moe_training_step_never_makes_the_host_wait(tiny_overrides, recipe):
    """With one EP rank a MoE step waits for the GPU nowhere: the routing counts stay on the device, the FP8
    experts' padded layout is sized by its bound, BF16's grouped GEMMs take device offsets."""
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer
    from tests.conftest import steps_never_wait_for_the_gpu

    cfg = load_config("tiny_moe_fp8", tiny_overrides + ["training.device=auto", f"precision.recipe={recipe}"])
    steps_never_wait_for_the_gpu(Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0)))
