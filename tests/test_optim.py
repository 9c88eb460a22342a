"""Gradient buckets and the (sharded) FP32-master AdamW against torch.optim.AdamW; clipping; LR schedules."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megafp8.config import OptimizerConfig
from megafp8.optim import DistributedAdamW, lr_at
from megafp8.optim.distributed import MOMENT_DTYPES
from megafp8.parallel import (
    ColumnParallelLinear,
    GradBuckets,
    ParallelDims,
    RowParallelLinear,
    TensorParallel,
    full_shape,
    gather_full,
    shard_of,
    tp_shard_of,
)
from megafp8.precision import PrecisionRecipe
from tests.distributed import spawn


def small_net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)).to(dtype)


def make_optimizer(net, cfg, group=None, sharded=True, bucket_numel=300):
    params = list(net.parameters())
    buckets = GradBuckets(params, {p: group for p in params}, bucket_numel=bucket_numel, sharded=sharded)
    return buckets, DistributedAdamW(buckets, {p: n for n, p in net.named_parameters()}, cfg)


def data(step, rank=0, per_rank=8, world=1):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(per_rank * world, 16, generator=g)
    return x[rank * per_rank : (rank + 1) * per_rank]


def reference_run(cfg, steps, micro_batches=1, world=1):
    """torch.optim.AdamW on an FP32 copy of the net, gradients of the global batch, clipped like ours."""
    net = small_net()
    matrices = [p for p in net.parameters() if p.ndim >= 2]
    vectors = [p for p in net.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.weight_decay},
                             {"params": vectors, "weight_decay": 0.0}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    for step in range(steps):
        opt.zero_grad()
        x = data(step, per_rank=8 * world)
        for chunk in x.chunk(micro_batches):
            (net(chunk).square().mean() / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        opt.step()
    return net


def train_ours(net, buckets, opt, cfg, steps, rank=0, world=1, micro_batches=1):
    for step in range(steps):
        x = data(step, rank, world=world)
        for i, chunk in enumerate(x.chunk(micro_batches)):
            buckets.prepare_backward(last_micro_batch=i == micro_batches - 1)
            (net(chunk).square().mean() / micro_batches).backward()
        buckets.finish()
        opt.clip_grad_norm()
        opt.step(cfg.lr)
        buckets.zero()


CFG = OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.05, warmup_steps=0)


def test_buckets_accumulate_bf16_grads_in_fp32_and_params_view_the_flat_buffer():
    net = small_net(torch.bfloat16)
    buckets, _ = make_optimizer(net, CFG)
    assert len(buckets.buckets) > 1
    for p in net.parameters():
        bucket = next(b for b in buckets.buckets if any(q is p for q in b.params))
        assert p.untyped_storage().data_ptr() == bucket.params_flat.untyped_storage().data_ptr()
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    ref = small_net(torch.bfloat16)
    expected = [torch.zeros(p.shape) for p in ref.parameters()]
    for _ in range(3):
        buckets.prepare_backward(last_micro_batch=False)
        net(x).float().square().mean().backward()
        ref.zero_grad()
        ref(x).float().square().mean().backward()
        for e, p in zip(expected, ref.parameters()):
            e += p.grad.float()
    for p, e in zip(net.parameters(), expected):
        assert p.grad is None and p.main_grad.dtype == torch.float32
        torch.testing.assert_close(p.main_grad, e, rtol=0, atol=0)


def test_single_rank_matches_torch_adamw_with_decay_and_clipping():
    net = small_net()
    buckets, opt = make_optimizer(net, CFG)
    train_ours(net, buckets, opt, CFG, steps=10, micro_batches=2)
    ref = reference_run(CFG, steps=10, micro_batches=2)
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=name)


def _dp_worker(rank, world, sharded, moment_dtype):
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.05, warmup_steps=0, moment_dtype=moment_dtype)
    net = small_net()
    buckets, opt = make_optimizer(net, cfg, group=dist.group.WORLD, sharded=sharded)
    train_ours(net, buckets, opt, cfg, steps=10, rank=rank, world=world)
    ref = reference_run(cfg, steps=10, world=world)
    tol = dict(rtol=1e-5, atol=1e-6) if moment_dtype == "fp32" else dict(rtol=0, atol=2e-3)
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, msg=f"rank {rank} {name}", **tol)
    # Per-rank optimizer memory falls as 1/DP when sharded (states and masters are counted from the tensors).
    memory = opt.memory_bytes()
    total = sum(p.numel() for p in net.parameters())
    padded = sum(b.numel for b in buckets.buckets)
    states_per_element = 2 * (4 if moment_dtype == "fp32" else 2)
    expected_elements = padded // world if sharded else padded
    assert memory["optimizer_states"] == expected_elements * states_per_element
    assert memory["master_weights"] == expected_elements * 4
    assert padded - total < len(buckets.buckets) * world  # padding is at most world-1 per bucket


@pytest.mark.parametrize("world, sharded", [(2, True), (4, True), (2, False)])
def test_data_parallel_matches_single_rank_adamw(world, sharded):
    spawn(world, _dp_worker, sharded, "fp32")


def test_bf16_moments_stay_close_to_fp32():
    spawn(2, _dp_worker, True, "bf16")


def _state_worker(rank, world):
    cfg = CFG
    net = small_net()
    buckets, opt = make_optimizer(net, cfg, group=dist.group.WORLD, sharded=True)
    train_ours(net, buckets, opt, cfg, steps=3, rank=rank, world=world)
    state = opt.state_dict()  # gathered: the same full tensors on every rank
    # A fresh optimizer on another layout (unsharded, one bucket) loads it and continues identically.
    other_net = small_net(seed=5)
    other_buckets, other = make_optimizer(other_net, cfg, group=dist.group.WORLD, sharded=False, bucket_numel=10**6)
    other.load_state_dict(state)
    for p, q in zip(net.parameters(), other_net.parameters()):
        assert torch.equal(p, q)
    train_ours(net, buckets, opt, cfg, steps=2, rank=rank, world=world)
    train_ours(other_net, other_buckets, other, cfg, steps=2, rank=rank, world=world)
    for p, q in zip(net.parameters(), other_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_state_dict_is_layout_independent():
    spawn(2, _state_worker)


def _sharded_save_worker(rank, world, directory):
    from megafp8.checkpoint.sharded import write_sharded
    net = small_net()
    buckets, opt = make_optimizer(net, CFG, group=dist.group.WORLD, bucket_numel=100)
    train_ours(net, buckets, opt, CFG, steps=3, rank=rank, world=world)
    state = opt.state_dict()
    write_sharded(directory, opt.placed_state(), {"optimizer_step": opt.step_count} if rank == 0 else None)
    if rank == 0:
        torch.save(state, directory.parent / "full.pt")


def _sharded_load_worker(rank, world, directory, moment_dtype):
    from megafp8.checkpoint.sharded import read_sharded
    cfg = dataclasses.replace(CFG, moment_dtype=moment_dtype)
    net = small_net(seed=9)
    _, opt = make_optimizer(net, cfg, group=dist.group.WORLD if world > 1 else None, bucket_numel=77)
    opt.finish_placed_load(read_sharded(directory, opt.placed_state())["optimizer_step"])
    state, saved = opt.state_dict(), torch.load(directory.parent / "full.pt")
    assert state["step"] == saved["step"] == 3
    dtype = MOMENT_DTYPES[moment_dtype]
    for name, p in net.named_parameters():
        assert torch.equal(state["masters"][name], saved["masters"][name]), name
        assert torch.equal(p.detach(), saved["masters"][name].to(p.dtype)), name  # the weights cast from them
        for key in ("exp_avg", "exp_avg_sq"):  # read as they were, or rounded to BF16 once
            assert torch.equal(state[key][name], saved[key][name].to(dtype).float()), (key, name)


@pytest.mark.parametrize("world, moment_dtype", [(1, "fp32"), (3, "bf16")])
def test_a_sharded_optimizer_state_resumes_at_another_dp_size_and_moment_dtype(tmp_path, world, moment_dtype):
    """Saved at DP=2 (FP32 moments, buckets of 100 elements: shard boundaries inside parameters), read at DP=1 with
    FP32 moments or DP=3 (another bucket size) with BF16 ones: the same masters and step, the moments exact or
    rounded to BF16 once."""
    directory = tmp_path / "ck"
    spawn(2, _sharded_save_worker, directory)
    if world == 1:
        _sharded_load_worker(0, 1, directory, moment_dtype)
    else:
        spawn(world, _sharded_load_worker, directory, moment_dtype)


def test_load_rejects_mismatched_state():
    net = small_net()
    _, opt = make_optimizer(net, CFG)
    state = opt.state_dict()
    state["masters"].pop("0.weight")
    with pytest.raises(ValueError, match="lacks masters for 1 parameter"):
        opt.load_state_dict(state)


def test_post_step_hooks_see_every_step_and_a_host_skip_changes_nothing():
    """MoE balancing runs as a post-step hook: it must see applied, device-skipped and host-skipped (FP16) steps."""
    net = small_net()
    buckets, opt = make_optimizer(net, CFG)
    seen = []
    opt.register_step_post_hook(lambda applied: seen.append(None if applied is None else bool(applied)))
    train_ours(net, buckets, opt, CFG, steps=1)
    opt.step(CFG.lr, torch.tensor(False))
    before = [p.detach().clone() for p in net.parameters()] + [s.master.clone() for s in opt.shards]
    steps = opt.step_count
    opt.skip_step()
    assert seen == [None, False, False]
    assert opt.step_count == steps
    assert all(torch.equal(a, b) for a, b in zip([*net.parameters(), *(s.master for s in opt.shards)], before))


def clip_case(device: str, **cfg):
    """A net spread over several buckets, gradients of very different sizes, clipping active."""
    net = small_net().to(device)
    buckets, opt = make_optimizer(net, OptimizerConfig(grad_clip=0.5, **cfg))
    g = torch.Generator().manual_seed(3)
    for b in buckets.buckets:
        b.grads_flat.copy_((torch.randn(b.numel, generator=g) * torch.logspace(-4, 2, b.numel)).to(device))
    return buckets, opt


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_clipping_scales_every_gradient_by_one_coefficient_and_reports_the_exact_norm(device):
    """The norm is within FP32 rounding of an FP64 one (CUDA: `_foreach_norm`; CPU: pairwise sums), and clipping
    multiplies every gradient by the same FP32 coefficient, bit for bit what `mul_` by it gives (in place where the
    fused update is off; with it on CUDA the update applies the same multiply: the next test)."""
    buckets, opt = clip_case(device, fused_update=False)
    before = [b.grads_flat.clone() for b in buckets.buckets]
    exact = torch.sqrt(sum(float(t.double().square().sum()) for t in before) * torch.ones((), dtype=torch.float64))
    norm = opt.clip_grad_norm()
    assert norm.device.type == device
    assert float(norm) == pytest.approx(float(exact), rel=1e-6)
    coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
    for b, old in zip(buckets.buckets, before):
        assert torch.equal(b.grads_flat, old.mul(coef))


def test_replicated_ranges_are_left_out_by_their_complement():
    from megafp8.optim.distributed import _complement
    assert _complement([], 10) == [(0, 10)]
    assert _complement([(2, 4), (6, 10)], 10) == [(0, 2), (4, 6)]
    assert _complement([(0, 3)], 3) == []
    assert _complement([(5, 7), (0, 2)], 9) == [(2, 5), (7, 9)]


def test_clipping_reports_the_unclipped_norm():
    net = small_net()
    buckets, opt = make_optimizer(net, OptimizerConfig(grad_clip=0.5))
    for b in buckets.buckets:
        b.grads_flat.copy_(torch.arange(b.numel, dtype=torch.float32))
    before = torch.sqrt(sum((b.grads_flat.square().sum() for b in buckets.buckets), torch.tensor(0.0))).item()
    assert opt.clip_grad_norm().item() == pytest.approx(before)
    after = torch.sqrt(sum((b.grads_flat.square().sum() for b in buckets.buckets), torch.tensor(0.0))).item()
    assert after == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("style", ["cosine", "linear", "wsd", "constant"])
def test_lr_schedules(style):
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_style=style, wsd_decay_fraction=0.2)
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warmup
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    if style == "constant":
        assert lrs[-1] == 1.0
    else:
        assert lrs[-1] == pytest.approx(0.1)
        assert all(a >= b - 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # never increases after warmup
    if style == "wsd":
        assert lrs[79] == 1.0 and lrs[81] < 1.0  # stable, then decays over the last 20%
    if style == "cosine":
        assert lrs[10 + 45] == pytest.approx(0.55, abs=0.02)  # halfway through decay


@pytest.mark.parametrize("steps, fraction", [(100, 0.01), (100, 0.004), (10, 0.1), (3, 0.2)])
def test_a_wsd_decay_of_one_step_or_less_still_ends_at_min_lr(steps, fraction):
    """The decay phase's first step is at `lr` and its last at `min_lr`. Where steps x wsd_decay_fraction rounded to
    one step (or none), that one step was at `lr`: the run ended at its peak learning rate without a word."""
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=1, decay_style="wsd", wsd_decay_fraction=fraction)
    lrs = [lr_at(s, cfg, steps) for s in range(steps)]
    assert lrs[-1] == pytest.approx(0.1)
    assert lrs[-2] == 1.0  # the stable phase lasts up to the last step


def _tp_net(tp):
    """LayerNorm (replicated over TP) -> column (128 -> 256) -> tanh -> row (256 -> 128); seeded full weights."""
    recipe = PrecisionRecipe.from_name("fp32")
    net = nn.Sequential(nn.LayerNorm(128), ColumnParallelLinear(128, 256, recipe, tp), nn.Tanh(),
                        RowParallelLinear(256, 128, recipe, tp))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            full = torch.randn(full_shape(p), generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0)
            p.copy_(shard_of(full, tp_shard_of(p), tp.rank, tp.size))
    return net


def _tp_dp_worker(rank, world):
    dims = ParallelDims.build(tp=2)
    tp = dims.tensor_parallel
    net = _tp_net(tp)
    params = list(net.parameters())
    buckets = GradBuckets(params, {p: dims.dp_group for p in params}, bucket_numel=20_000, sharded=True)
    opt = DistributedAdamW(buckets, {p: n for n, p in net.named_parameters()}, CFG, tp)
    ref = _tp_net(TensorParallel.single())
    matrices = [p for p in ref.parameters() if p.ndim >= 2]
    vectors = [p for p in ref.parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW([{"params": matrices, "weight_decay": CFG.weight_decay},
                                 {"params": vectors, "weight_decay": 0.0}], lr=CFG.lr,
                                betas=(CFG.beta1, CFG.beta2), eps=CFG.eps)
    norms = []
    for step in range(10):
        x = torch.randn(8 * dims.dp, 128, generator=torch.Generator().manual_seed(step))
        buckets.prepare_backward(last_micro_batch=True)
        net(x.chunk(dims.dp)[dims.dp_rank]).square().mean().backward()  # TP ranks of a replica share data
        buckets.finish()
        norms.append(opt.clip_grad_norm().item())
        opt.step(CFG.lr)
        buckets.zero()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_norms = torch.nn.utils.clip_grad_norm_(ref.parameters(), CFG.grad_clip)
        ref_opt.step()
        assert abs(norms[-1] - ref_norms.item()) <= 1e-5 * ref_norms.item(), (step, norms[-1], ref_norms.item())
        assert norms[-1] > CFG.grad_clip  # clipping is active
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        full = gather_full(p.detach(), tp_shard_of(p), tp)
        err = (full - r.detach()).abs().max().item()
        # FP32 roundoff of the TP reductions, amplified by Adam over 10 steps: we see up to 3e-6 (lr is 1e-2).
        torch.testing.assert_close(full, r.detach(), rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}: max error {err}")


def test_tp2_x_dp2_sharded_optimizer_matches_single_rank_adamw():
    """World 4 = TP 2 x DP 2, ZeRO-sharded masters and moments, clipping active (the norm counts TP shards once
    each and the replicated LayerNorm once): 10 steps equal torch.optim.AdamW on the unsharded net."""
    spawn(4, _tp_dp_worker)
