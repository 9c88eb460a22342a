"""The fused AdamW update (`megafp8/optim/fused_update.py`): its Triton kernel against torch's CUDA fused AdamW
(in Triton's CPU interpreter here, bit for bit on the GPU), and its path through DistributedAdamW against the unfused
passes."""
from __future__ import annotations

import pytest
import torch

from megafp8.config import OptimizerConfig
from tests.scripts import run_in_triton_interpreter
from tests.test_optim import make_optimizer, small_net


# Torch's fused AdamW on CUDA (`fused_adam_utils.cuh`, ADAMW, FP32, as read in torch 2.13's headers), written out in
# NumPy operation for operation: what the fused update's kernel must compute. Run in Triton's interpreter (a
# subprocess: the interpreter is chosen at import), which computes `tl.fma(a, b, c)` as a product and a sum each
# rounded to FP32 and divides exactly, so this pins the operations and their order, not where an FMA or a correctly
# rounded division stands: the GPU tests below check those against torch itself.
INTERPRETED_UPDATE = r'''
import sys
import numpy as np, torch
from megafp8.optim.fused_update import adamw_update_, bias_corrections
moments = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
lr, b1, b2, eps, wd, step, n, decay_end = 3e-4, 0.9, 0.95, 1e-8, 0.1, 7, 5000, 3000
g = torch.Generator().manual_seed(0)
master, grad = torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3
exp_avg = (torch.randn(n, generator=g) * 1e-4).to(moments)
exp_avg_sq = (torch.rand(n, generator=g) * 1e-7).to(moments)
coef = torch.tensor(0.7312)
corrections = bias_corrections(torch.tensor([b1, b2]), torch.tensor(float(step)))
m, a, v, out = master.clone(), exp_avg.clone(), exp_avg_sq.clone(), torch.empty(n)
adamw_update_(m, grad.clone(), a, v, out, decay_end, corrections, lr, b1, b2, eps, wd, coef=coef)
f32 = np.float32
fma = lambda x, y, z: f32(x) * f32(y) + f32(z)
lr_, b1_, b2_, eps_, wd_ = (f32(x) for x in (lr, b1, b2, eps, wd))
p, q, s, gr = (t.float().numpy().copy() for t in (master, exp_avg, exp_avg_sq, grad * coef))
p = np.where(np.arange(n) < decay_end, fma(-(lr_ * wd_), p, p), p)
q = fma(b1_, q, fma(-b1_, gr, gr))
s = fma(b2_, s, fma(-b2_, gr * gr, gr * gr))
bc1, bc2 = corrections.numpy()
step_size, bc2_sqrt = lr_ / bc1, np.sqrt(bc2)
p = p - (step_size * q) / (np.sqrt(s) / bc2_sqrt + eps_)
assert p.dtype == q.dtype == s.dtype == np.float32
assert np.array_equal(p, m.numpy()) and np.array_equal(out.numpy(), p) and not np.array_equal(p, master.numpy())
if moments == torch.float32:
    assert np.array_equal(q, a.numpy()) and np.array_equal(s, v.numpy())
else:  # stored rounded; the interpreter's BF16 conversion truncates: within one BF16 step of the FP32 moments
    assert a.dtype == v.dtype == torch.bfloat16
    for want, got in ((q, a), (s, v)):
        assert np.all(np.abs(got.float().numpy() - want) <= np.abs(want) * 2.0 ** -7)
    assert not torch.equal(a, exp_avg) and not torch.equal(v, exp_avg_sq)
skip_m, skip_out, skip_a, skip_v = master.clone(), torch.zeros(n), exp_avg.clone(), exp_avg_sq.clone()
adamw_update_(skip_m, grad.clone(), skip_a, skip_v, skip_out, decay_end, corrections, lr, b1, b2, eps, wd, coef=coef,
              skip=torch.tensor(1.0))
assert torch.equal(skip_m, master) and torch.equal(skip_out, master)
assert torch.equal(skip_a, exp_avg) and torch.equal(skip_v, exp_avg_sq)
print("ok")
'''


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_the_fused_update_kernel_computes_torchs_cuda_adamw_operations_in_the_interpreter(tmp_path, moments):
    """The fused update's Triton kernel, run by Triton's CPU interpreter, against torch's CUDA fused AdamW written
    out in NumPy (FP32 throughout, FMAs rounded as the interpreter rounds them): masters bit for bit, FP32 moments
    bit for bit and BF16 ones within a BF16 step, the FP32 output equal to the master, and a skipped step changing
    nothing. The interpreter's BF16 conversion truncates, its FMA rounds twice and its division is exact, so this
    checks the operations and their order; BF16 rounding, FMA placement and correctly rounded division are checked
    against torch on the GPU (the next tests)."""
    run_in_triton_interpreter(tmp_path, INTERPRETED_UPDATE, moments)


def test_bias_corrections_are_one_minus_each_beta_to_the_step():
    from megafp8.optim.fused_update import bias_corrections
    got = bias_corrections(torch.tensor([0.9, 0.95]), torch.tensor(7.0))
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([1 - 0.9 ** 7, 1 - 0.95 ** 7], rel=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fused_update_gives_the_unfused_passes_bits(model_dtype):
    """`optimizer.fused_update` on CUDA (one kernel: the clipping scale, AdamW, the cast into the model's weights)
    against the separate passes (`_foreach_mul_`, torch's fused AdamW, a copy) over five steps, one of them skipped
    on the device: masters, both moments and the model's weights bit for bit; the reduced gradients left unscaled."""
    from megafp8.optim.fused_update import fused_update_reason
    assert fused_update_reason(torch.device("cuda")) is None
    runs = {}
    for fused in (True, False):
        net = small_net(model_dtype).cuda()
        cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.05, warmup_steps=0, fused_update=fused)
        buckets, opt = make_optimizer(net, cfg)
        assert bool(opt._fused_update_shards()) == fused
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            for b in buckets.buckets:
                b.grads_flat.copy_((torch.randn(b.numel, generator=g) * torch.logspace(-6, 1, b.numel)).cuda())
            before = [b.grads_flat.clone() for b in buckets.buckets]
            opt.clip_grad_norm()
            opt.step(cfg.lr * (1 + step), torch.tensor(step != 2, device="cuda"))
            if fused:
                assert all(torch.equal(b.grads_flat, old) for b, old in zip(buckets.buckets, before))
        runs[fused] = ([s.master for s in opt.shards], [s.exp_avg for s in opt.shards],
                       [s.exp_avg_sq for s in opt.shards], [p.detach() for p in net.parameters()])
    kinds = ("master", "exp_avg", "exp_avg_sq", "weights")
    pairs = [(f"{kind} {i}", a, b) for kind, got, want in zip(kinds, runs[True], runs[False])
             for i, (a, b) in enumerate(zip(got, want))]
    assert not bit_mismatches(pairs), "; ".join(bit_mismatches(pairs))


def bit_mismatches(pairs) -> list[str]:
    """For each (name, got, want) whose bits differ: how many elements differ and by how many units in the last
    place at most (every mismatch counted, so that a failure says how far off a kernel is)."""
    found = []
    for name, a, b in pairs:
        bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
        apart = (a.view(bits).long() - b.view(bits).long()).abs()
        if bool(apart.any()):
            found.append(f"{name}: {int((apart > 0).sum())} of {a.numel()} elements differ, by at most "
                         f"{int(apart.max())} units in the last place")
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("lr, weight_decay, step", [(3e-4, 0.1, 1), (1e-2, 0.1, 7), (6e-5, 0.0, 1234),
                                                    (0.0, 0.1, 20)])
def test_the_fused_update_kernel_gives_torchs_fused_adamw_bits(lr, weight_decay, step):
    """`adamw_update_` against `torch._fused_adamw_` (what the unfused path calls) on the same FP32 tensors: a shard
    of 1,000,003 elements (many programs, a partial last one) spanning twelve orders of magnitude, some masters
    -0.0, the decay ending inside a program, the gradient times a clipping scale; at zero decay (no decayed range)
    and at lr = 0 (where the decay's sign of zero shows); then a skipped step. Masters, moments and the BF16
    weights bit for bit."""
    from megafp8.optim.fused_update import adamw_update_, bias_corrections
    n, decay_end, b1, b2, eps = 1_000_003, 600_001, 0.9, 0.95, 1e-8
    g = torch.Generator(device="cuda").manual_seed(step)
    spread = torch.logspace(-6, 6, n, device="cuda")[torch.randperm(n, device="cuda", generator=g)]
    master = torch.randn(n, device="cuda", generator=g) * spread * 1e-3
    master[::97] = -0.0
    grad = torch.randn(n, device="cuda", generator=g) * spread * 1e-4
    exp_avg = torch.randn(n, device="cuda", generator=g) * spread * 1e-5
    exp_avg_sq = (torch.randn(n, device="cuda", generator=g) * spread * 1e-6).square()
    coef = torch.tensor(0.37, device="cuda")
    step_t = torch.tensor(float(step), device="cuda")
    corrections = bias_corrections(torch.tensor([b1, b2], device="cuda"), step_t)
    want = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
    scaled = grad.clone()
    torch._foreach_mul_([scaled], coef)
    for lo, hi, wd in ((0, decay_end, weight_decay), (decay_end, n, 0.0)):
        torch._fused_adamw_([want[0][lo:hi]], [scaled[lo:hi]], [want[1][lo:hi]], [want[2][lo:hi]], [], [step_t],
                            lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
    got = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    adamw_update_(got[0], grad.clone(), got[1], got[2], out, decay_end if weight_decay else 0, corrections, lr, b1,
                  b2, eps, weight_decay, coef=coef)
    pairs = [(name, a, b) for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), got, want)]
    pairs.append(("weights", out, want[0].to(torch.bfloat16)))
    assert not bit_mismatches(pairs), "; ".join(bit_mismatches(pairs))
    skipped = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
    adamw_update_(skipped[0], grad.clone(), skipped[1], skipped[2], out, decay_end, corrections, lr, b1, b2, eps,
                  weight_decay, coef=coef, skip=torch.tensor(1.0, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(skipped, (master, exp_avg, exp_avg_sq)))
    assert torch.equal(out, master.to(torch.bfloat16))


def stand_in_fused_update(opt):
    """`adamw_update_`'s contract in torch ops, for CPU: the gradient times `coef` (read, not written back), torch's
    fused AdamW on the decayed range and on the rest, the weights set to the master; nothing where `skip`. It lets
    a CPU test take the fused path's bookkeeping (when the clip is applied, which shards publish), not its kernel."""
    calls = []

    def update(master, grad, exp_avg, exp_avg_sq, out, decay_end, corrections, lr, beta1, beta2, eps, weight_decay,
               coef=None, skip=None):
        calls.append(coef is not None)
        g = grad * coef if coef is not None else grad.clone()
        for lo, hi, wd in ((0, decay_end, weight_decay), (decay_end, master.numel(), 0.0)):
            if hi > lo:
                torch._fused_adamw_([master[lo:hi]], [g[lo:hi]], [exp_avg[lo:hi]], [exp_avg_sq[lo:hi]], [],
                                    [opt._step_tensor], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps,
                                    amsgrad=False, maximize=False, found_inf=skip)
        out.copy_(master)
    return update, calls


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_the_fused_update_path_keeps_the_unfused_bookkeeping(monkeypatch, grad_clip):
    """The fused update's path through DistributedAdamW on CPU (its kernel replaced by `stand_in_fused_update`)
    against the unfused passes, bit for bit in masters, moments and weights: clipped steps, a step skipped on the
    device, a step skipped on the host after a clip and followed by a step without one (the clip's coefficient
    must not reach the next step's gradients), and a state_dict round trip. The fused path leaves the reduced
    gradients unscaled."""
    import megafp8.optim.distributed as distributed
    runs = {}
    for fused in (True, False):
        net = small_net(torch.bfloat16)
        buckets, opt = make_optimizer(net, OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=grad_clip,
                                                           warmup_steps=0, fused_update=fused))
        update, calls = stand_in_fused_update(opt)
        monkeypatch.setattr(distributed, "fused_update_reason", lambda device: None)
        monkeypatch.setattr(distributed, "adamw_update_", update)
        assert bool(opt._fused_update_shards()) == fused

        def grads(seed):
            g = torch.Generator().manual_seed(seed)
            for b in buckets.buckets:
                b.grads_flat.copy_(torch.randn(b.numel, generator=g) * torch.logspace(-4, 1, b.numel))
        for step in range(6):
            grads(step)
            before = [b.grads_flat.clone() for b in buckets.buckets]
            if step == 3:  # a host-side skip after the clip, then a step on new gradients without a clip
                opt.clip_grad_norm()
                opt.skip_step()
                grads(100)
                opt.step(1e-2)
                continue
            opt.clip_grad_norm()
            if fused:
                assert all(torch.equal(b.grads_flat, old) for b, old in zip(buckets.buckets, before))
            opt.step(1e-2 * (1 + step), torch.tensor(step != 1))
            if step == 4:
                opt.load_state_dict(opt.state_dict())
        assert bool(calls) == fused and (any(calls) == (fused and grad_clip > 0))
        runs[fused] = [t.clone() for s in opt.shards for t in (s.master, s.exp_avg, s.exp_avg_sq)] + \
            [p.detach().clone() for p in net.parameters()]
        monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))


@pytest.mark.gpu
def test_the_fused_update_with_bf16_moments_tracks_the_unfused_path():
    """BF16 moments (`optimizer.moment_dtype: bf16`): the fused kernel against `_step_shard` (FP32 element-wise ops,
    moments rounded when stored) over five steps, one skipped on the device. The two round differently in FP32 (a
    lerp against torch's FMAs, FP64 bias corrections against `powf`), and a difference of one FP32 unit can round a
    moment to the neighbouring BF16 value; carried into the next steps, where the moment may cross a power of two
    and BF16's step halve, that can grow to two steps. So: moments within two BF16 steps, masters within what such
    steps of one moment moves an update by (2^-6 of the learning rates' sum over the steps, against differences of
    the order of the learning rate from a wrong formula), the moments stored as BF16, the weights the masters
    rounded, and the skipped step changing nothing (weights included)."""
    from megafp8.optim.fused_update import fused_update_reason
    assert fused_update_reason(torch.device("cuda")) is None
    lr, runs = 1e-2, {}
    for fused in (True, False):
        net = small_net(torch.bfloat16).cuda()
        cfg = OptimizerConfig(lr=lr, weight_decay=0.1, grad_clip=0.05, warmup_steps=0, moment_dtype="bf16",
                              fused_update=fused)
        buckets, opt = make_optimizer(net, cfg)
        if fused:
            initial = [s.master.clone() for s in opt.shards]
        assert bool(opt._fused_update_shards()) == fused
        assert all(s.exp_avg.dtype == s.exp_avg_sq.dtype == torch.bfloat16 for s in opt.shards)
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            for b in buckets.buckets:  # of one sign, so that no moment is a difference of near-equal terms
                b.grads_flat.copy_((torch.randn(b.numel, generator=g).abs() * torch.logspace(-6, 1, b.numel)).cuda())
            opt.clip_grad_norm()
            state = lambda: [t for s in opt.shards for t in (s.master, s.exp_avg, s.exp_avg_sq,  # noqa: E731
                                                              s.bucket.params_flat[s.start:s.end])]
            before = [t.clone() for t in state()]
            opt.step(lr * (1 + step), torch.tensor(step != 2, device="cuda"))
            if step == 2:
                assert all(torch.equal(x, y) for x, y in zip(before, state())), "a skipped step changed the state"
        assert all(torch.equal(s.bucket.params_flat[s.start:s.end], s.master.to(torch.bfloat16)) for s in opt.shards)
        runs[fused] = opt.shards
    for got, want in zip(runs[True], runs[False]):
        for kind in ("exp_avg", "exp_avg_sq"):
            a, b = getattr(got, kind).float(), getattr(want, kind).float()
            assert bool(((a - b).abs() <= b.abs() * 2.0 ** -6).all()), kind
        assert bool(((got.master - want.master).abs() <= 15 * lr * 2.0 ** -6).all()), "master"
    assert not all(torch.equal(s.master, m) for s, m in zip(runs[True], initial)), "nothing was updated"


@pytest.mark.gpu
def test_the_fused_update_with_bf16_moments_is_its_fp32_update_rounded():
    """One update from BF16-representable moments, stored as BF16 and as FP32: the masters and the weights bit for
    bit the same (the master is updated from the unrounded moments), and the BF16 moments the FP32 ones rounded to
    nearest, bit for bit (the store's rounding, which Triton's interpreter cannot show: it truncates)."""
    from megafp8.optim.fused_update import adamw_update_, bias_corrections
    n, decay_end, lr, b1, b2, eps, wd = 300_007, 100_003, 1e-3, 0.9, 0.95, 1e-8, 0.1
    g = torch.Generator(device="cuda").manual_seed(5)
    spread = torch.logspace(-4, 4, n, device="cuda")[torch.randperm(n, device="cuda", generator=g)]
    master = torch.randn(n, device="cuda", generator=g) * spread * 1e-3
    grad = torch.randn(n, device="cuda", generator=g) * spread * 1e-4
    exp_avg = (torch.randn(n, device="cuda", generator=g) * spread * 1e-5).bfloat16()
    exp_avg_sq = (torch.randn(n, device="cuda", generator=g) * spread * 1e-6).square().bfloat16()
    corrections = bias_corrections(torch.tensor([b1, b2], device="cuda"), torch.tensor(3.0, device="cuda"))
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        m, a, v = master.clone(), exp_avg.to(dtype, copy=True), exp_avg_sq.to(dtype, copy=True)
        out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        adamw_update_(m, grad.clone(), a, v, out, decay_end, corrections, lr, b1, b2, eps, wd)
        runs[dtype] = (m, a, v, out)
    (m32, a32, v32, out32), (m16, a16, v16, out16) = runs[torch.float32], runs[torch.bfloat16]
    pairs = [("master", m16, m32), ("weights", out16, out32), ("exp_avg", a16, a32.bfloat16()),
             ("exp_avg_sq", v16, v32.bfloat16())]
    assert not bit_mismatches(pairs), "; ".join(bit_mismatches(pairs))
    assert not torch.equal(a16, exp_avg) and not torch.equal(m16, master)
