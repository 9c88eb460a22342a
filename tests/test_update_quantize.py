"""The optimizer's fused update quantizing the FP8 weights it writes (`DistributedAdamW.quantize_weights_in_update`,
`megafp8.optim.fused_update.adamw_update_quantize_`): the same masters, moments, weights and FP8 caches as the
update followed by the first forward's quantization, and no second quantization of the weight before it changes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from megafp8.config import OptimizerConfig
from megafp8.optim import DistributedAdamW
from megafp8.parallel import ColumnParallelLinear, GradBuckets
from megafp8.precision import E4M3, Fp8Recipe, PrecisionRecipe
from megafp8.precision import quantize as ref
from megafp8.precision.backends.reference import Fp8Backend
from tests.conftest import REPO

# Triton's CPU interpreter (chosen at import, so in a subprocess): the blocked kernel against the flat one over the
# same elements, and its FP8 blocks against the standalone weight quantizer's kernel on the weights it wrote (the
# interpreter converts to FP8 and BF16 its own way: both kernels run in it, so the bits must agree).
INTERPRETED = r'''
import torch
from megafp8.optim.fused_update import adamw_update_, adamw_update_quantize_, bias_corrections
from megafp8.precision.formats import FORMATS
from megafp8.precision.kernels import quantize as tq
from megafp8.precision.weight_cache import WeightQuantizeTarget
g = torch.Generator().manual_seed(0)
cases = (((2, 128, 256), torch.float32, True, False, True, "e4m3"),
         ((256, 128), torch.bfloat16, False, True, False, "e4m3"),
         ((128, 256), torch.float32, True, True, True, "e5m2"))
for shape, moments, transpose, pow2, decay, fmt_name in cases:
    fmt, n = FORMATS[fmt_name], torch.Size(shape).numel()
    e, rows, cols = (1, *shape) if len(shape) == 2 else shape
    master = torch.randn(n, generator=g) * 0.02
    master[5] = 3.0  # one block's scale set by an outlier
    grad = torch.randn(n, generator=g) * 1e-3
    exp_avg = (torch.randn(n, generator=g) * 1e-4).to(moments)
    exp_avg_sq = (torch.rand(n, generator=g) * 1e-7).to(moments)
    hyper = dict(corrections=bias_corrections(torch.tensor([0.9, 0.95]), torch.tensor(7.0)), lr=3e-4, beta1=0.9,
                 beta2=0.95, eps=1e-8, weight_decay=0.1, coef=torch.tensor(0.7312))
    for skip in ((None, torch.tensor(1.0)) if decay else (None,)):
        want = [t.clone() for t in (master, grad, exp_avg, exp_avg_sq)] + [torch.empty(n, dtype=torch.bfloat16)]
        adamw_update_(*want, decay_end=n if decay else 0, skip=skip, **hyper)
        got = [t.clone() for t in (master, grad, exp_avg, exp_avg_sq)] + [torch.empty(shape, dtype=torch.bfloat16)]
        q, s = torch.empty(shape, dtype=fmt.dtype), torch.empty(*shape[:-2], rows // 128, cols // 128)
        qt = torch.empty(*shape[:-2], cols, rows, dtype=fmt.dtype) if transpose else None
        st = s.transpose(-2, -1).contiguous() if transpose else None
        adamw_update_quantize_(*got, target=WeightQuantizeTarget(q, s, qt, st, fmt, pow2), decay=decay, skip=skip,
                               **hyper)
        assert all(torch.equal(a, b.reshape(-1)) for a, b in zip(want, got)), "the update"
        assert not torch.equal(got[0], master) if skip is None else torch.equal(got[0], master)
        w = want[4].view(e, rows, cols)
        q2, s2 = torch.empty(e, rows, cols, dtype=fmt.dtype), torch.empty(e, rows // 128, cols // 128)
        qt2, st2 = torch.empty(e, cols, rows, dtype=fmt.dtype), torch.empty(e, cols // 128, rows // 128)
        tq._quantize_weight_kernel[(cols // 128, e * (rows // 128))](
            w, q2, s2, qt2, st2, rows // 128, w.stride(0), w.stride(1), q2.stride(0), q2.stride(1), qt2.stride(0),
            qt2.stride(1), *s2.stride(), *st2.stride(), FP8_MAX=fmt.max, POW2=pow2, TRANSPOSE=True)
        assert torch.equal(q.view(torch.uint8).view(e, rows, cols), q2.view(torch.uint8)), "values"
        assert torch.equal(s.view(e, rows // 128, cols // 128), s2), "scales"
        if transpose:
            assert torch.equal(qt.view(torch.uint8).view(e, cols, rows), qt2.view(torch.uint8)), "w^T"
            assert torch.equal(st.view(e, cols // 128, rows // 128), st2), "w^T scales"
print("ok")
'''


def test_the_update_quantize_kernel_gives_the_flat_update_and_the_weight_quantizer_in_the_interpreter(tmp_path):
    """`adamw_update_quantize_`'s Triton kernel in Triton's CPU interpreter: masters, moments and weights bit for bit
    those of `adamw_update_` (the flat kernel) on the same elements, decayed or not, FP32 or BF16 moments, a step
    skipped on the device included; the FP8 values and block scales (and w^T's, where kept) those of the standalone
    weight quantizer's kernel on the weights it wrote: stacked experts and a plain weight, E4M3 and E5M2, exact
    and power-of-two scales."""
    pytest.importorskip("triton")
    script = tmp_path / "interpreted_update_quantize.py"
    script.write_text(INTERPRETED)
    import triton
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.path.dirname(os.path.dirname(triton.__file__))]))
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


class ViewsBackend(Fp8Backend):
    """The reference backend, telling the optimizer where its weights' quantizations go (as the Triton backends do),
    for the update's bookkeeping on a CPU."""

    def weight_quantizer_views(self, out):
        return out.w_fp8, self.block_scales_nk(out.w_scale), out.wt_fp8, (
            None if out.wt_scale is None else self.block_scales_nk(out.wt_scale))


def stand_in_kernels(calls):
    """`adamw_update_` and `adamw_update_quantize_` in torch ops: torch's fused AdamW (the decayed range, the rest),
    the weights set to the master, then the reference quantizer on those weights into the target."""
    def update(master, grad, exp_avg, exp_avg_sq, out, decay_end, corrections, lr, beta1, beta2, eps, weight_decay,
               coef=None, skip=None):
        g = grad * coef if coef is not None else grad.clone()
        step = torch.tensor(float(calls["step"]))
        for lo, hi, wd in ((0, max(0, decay_end), weight_decay), (max(0, decay_end), master.numel(), 0.0)):
            if hi > lo:
                torch._fused_adamw_([master[lo:hi]], [g[lo:hi]], [exp_avg[lo:hi]], [exp_avg_sq[lo:hi]], [], [step],
                                    lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False,
                                    maximize=False, found_inf=skip)
        out.copy_(master.view_as(out))
        calls["flat"] += 1

    def update_quantize(master, grad, exp_avg, exp_avg_sq, out, target, decay, corrections, lr, beta1, beta2, eps,
                        weight_decay, coef=None, skip=None):
        calls["flat"] -= 1  # counted as a blocked launch
        update(master, grad, exp_avg, exp_avg_sq, out, master.numel() if decay else 0, corrections, lr, beta1, beta2,
               eps, weight_decay, coef, skip)
        *lead, n, k = out.shape
        q, s = ref.quantize_128x128(out.reshape(-1, k), target.fmt, target.power_of_two)
        target.q.view(torch.uint8).copy_(q.view(torch.uint8).view(out.shape))
        target.s_nk.copy_(s.view(*lead, n // 128, k // 128))
        if target.qt is not None:
            target.qt.view(torch.uint8).copy_(target.q.view(torch.uint8).transpose(-2, -1))
            target.st_nk.copy_(target.s_nk.transpose(-2, -1))
        calls["blocked"] += 1
    return update, update_quantize


def fp8_net(keep_transpose: bool, backend=ViewsBackend, device="cpu"):
    torch.manual_seed(0)
    recipe = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference", keep_weight_transpose=keep_transpose))
    first = ColumnParallelLinear(256, 384, recipe, fp8_backend=backend())
    second = ColumnParallelLinear(384, 128, recipe, fp8_backend=backend())
    unused = ColumnParallelLinear(128, 128, recipe, fp8_backend=backend())  # never run: no cache to fill
    norm = nn.LayerNorm(384)  # a vector between the weights' ranges
    for layer in (first, second, unused):
        with torch.no_grad():
            layer.weight.normal_(0.0, 0.05)
    return nn.ModuleDict(dict(first=first, norm=norm, second=second, unused=unused)).to(device, torch.bfloat16)


def train(net, fuse: bool, device="cpu", calls=None):
    """Four steps (the third skipped on the device) of the FP8 net with the fused update, its weights quantized by
    it (`fuse`) or by the forward. Checks, after each step, who quantized the FP8 layers' weights, and that a fused
    step's caches hold the quantization of the new weights. Returns the optimizer's state, the weights, the
    outputs of five forwards and the FP8 caches."""
    params = list(net.parameters())
    buckets = GradBuckets(params, {p: None for p in params}, bucket_numel=10**6, sharded=True)
    opt = DistributedAdamW(buckets, {p: n for n, p in net.named_parameters()},
                           OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0, warmup_steps=0))
    if fuse:
        opt.quantize_weights_in_update([net["first"], net["second"], net["unused"]])
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
    outputs, names = [], ("first", "second")
    for step in range(4):
        buckets.prepare_backward(last_micro_batch=True)
        y = net["second"](net["norm"](net["first"](x)))
        outputs.append(y.detach())
        y.float().square().mean().backward()
        buckets.finish()
        opt.clip_grad_norm()
        if calls is not None:
            calls["step"] = opt.step_count + 1
        counts = [net[name].fp8_cache.quantize_count for name in names]
        opt.step(1e-2, torch.tensor(step != 2, device=device))
        after = [net[name].fp8_cache.quantize_count for name in names]
        assert after == ([c + 1 for c in counts] if fuse else counts)  # quantized by the step, or not yet
        if fuse:
            for name, count in zip(names, after):
                cache, weight = net[name].fp8_cache, net[name].weight
                assert (cache.entry.wt_fp8 is not None) == net[name].fp8_cache.keep_transpose
                assert cache.get(weight, net[name].fp8_backend, E4M3, False) is cache.entry
                assert cache.quantize_count == count  # current: the forward does not quantize again
        assert net["unused"].fp8_cache.entry is None
    outputs.append(net["second"](net["norm"](net["first"](x))).detach())
    caches = [t for name in names for t in net[name].fp8_cache.entry.tensors() if t is not None]
    return ([t.clone() for s in opt.shards for t in (s.master, s.exp_avg, s.exp_avg_sq)]
            + [p.detach().clone() for p in net.parameters()] + outputs + [c.clone() for c in caches])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtypes, shapes and bytes (strided views, such as cuBLAS's column-major scales, compared by value)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                                                      b.reshape(-1).contiguous().view(torch.uint8))


@pytest.mark.parametrize("keep_transpose", [True, False])
def test_the_update_quantizes_the_weights_it_writes_and_the_forward_does_not_again(monkeypatch, keep_transpose):
    """The fused update's path through DistributedAdamW on a CPU (its kernels replaced by torch stand-ins): with
    `quantize_weights_in_update` the FP8 layers' caches are filled by the step (one quantization each, none in the
    next forward); masters, moments, weights, outputs and FP8 caches bit for bit those of the run that quantizes in
    the forward; a layer that never ran (no cache yet) and the norm between the weights are updated by the flat
    kernel; a step skipped on the device leaves the caches current."""
    import megafp8.optim.distributed as distributed
    runs = {}
    for fuse in (True, False):
        calls = {"flat": 0, "blocked": 0, "step": 0}
        update, update_quantize = stand_in_kernels(calls)
        monkeypatch.setattr(distributed, "fused_update_reason", lambda device: None)
        monkeypatch.setattr(distributed, "adamw_update_", update)
        monkeypatch.setattr(distributed, "adamw_update_quantize_", update_quantize)
        runs[fuse] = train(fp8_net(keep_transpose), fuse, calls=calls)
        assert calls["blocked"] == (8 if fuse else 0)
        # the flat kernel takes the pieces between the fused weights (the unused layer's, the norm's): one launch
        # a step unfused, one or more fused
        assert calls["flat"] == 4 if not fuse else (calls["flat"] % 4 == 0 and calls["flat"] > 0)
        monkeypatch.undo()
    assert len(runs[True]) == len(runs[False])
    assert all(same_bits(a, b) for a, b in zip(runs[True], runs[False]))


@pytest.mark.gpu
@pytest.mark.parametrize("keep_transpose", [True, False])
def test_the_fused_update_quantizes_as_the_forward_would_on_the_gpu(keep_transpose):
    """The same two runs on the GPU with the Triton kernels and the backend `auto` selects (cuBLAS's scale layout
    for plain weights on Hopper): every bit equal, the FP8 caches included."""
    from megafp8.optim.fused_update import fused_update_reason
    from megafp8.precision import select_backend
    assert fused_update_reason(torch.device("cuda")) is None
    backend = lambda: select_backend("auto", torch.device("cuda"))  # noqa: E731
    runs = {fuse: train(fp8_net(keep_transpose, backend, "cuda"), fuse, "cuda") for fuse in (True, False)}
    assert all(same_bits(a, b) for a, b in zip(runs[True], runs[False]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(384, 256), (3, 256, 384)])
@pytest.mark.parametrize("transpose, power_of_two, moments", [(True, False, torch.float32),
                                                               (False, True, torch.bfloat16)])
def test_the_update_quantize_kernel_gives_the_update_then_the_backends_quantizer(shape, transpose, power_of_two,
                                                                                  moments):
    """`adamw_update_quantize_` on the GPU against `adamw_update_` followed by the selected backend's
    `quantize_weight_` into its own layout (`empty_weight`): masters, moments, weights, FP8 values and scales bit
    for bit, a plain weight (cuBLAS's column-major scales) and stacked experts, with and without w^T."""
    from megafp8.optim.fused_update import adamw_update_, adamw_update_quantize_, bias_corrections
    from megafp8.precision import select_backend
    from megafp8.precision.weight_cache import WeightQuantizeTarget
    backend = select_backend("auto", torch.device("cuda"))
    n = torch.Size(shape).numel()
    g = torch.Generator().manual_seed(0)
    state = [torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3,
             (torch.randn(n, generator=g) * 1e-4).to(moments), (torch.rand(n, generator=g) * 1e-7).to(moments)]
    state[0][7] = 5.0
    corrections = bias_corrections(torch.tensor([0.9, 0.95], device="cuda"), torch.tensor(3.0, device="cuda"))
    hyper = dict(corrections=corrections, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                 coef=torch.tensor(0.5, device="cuda"))
    want = [t.cuda() for t in state] + [torch.empty(n, dtype=torch.bfloat16, device="cuda")]
    adamw_update_(*want, decay_end=n, **hyper)
    want_q = backend.empty_weight(torch.Size(shape), E4M3, torch.device("cuda"), transpose)
    backend.quantize_weight_(want[4].view(shape), want_q, E4M3, power_of_two)
    got = [t.cuda() for t in state] + [torch.empty(shape, dtype=torch.bfloat16, device="cuda")]
    got_q = backend.empty_weight(torch.Size(shape), E4M3, torch.device("cuda"), transpose)
    target = WeightQuantizeTarget(*backend.weight_quantizer_views(got_q), E4M3, power_of_two)
    adamw_update_quantize_(*got, target=target, decay=True, **hyper)
    assert all(same_bits(a, b.reshape(-1)) for a, b in zip(want, got))
    assert all((a is None and b is None) or same_bits(a, b) for a, b in zip(want_q.tensors(), got_q.tensors()))
