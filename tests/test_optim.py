"""FP32 gradient accumulation, FP32-master AdamW against torch's AdamW, clipping, LR schedules."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megafp8.config import OptimizerConfig
from megafp8.optim import MixedPrecisionAdamW, lr_at
from megafp8.parallel import GradBuffer


def small_net(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)).to(dtype)
    return net


def test_grad_buffer_accumulates_bf16_grads_in_fp32():
    net = small_net(torch.bfloat16)
    buf = GradBuffer(net.parameters())
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    expected = [torch.zeros(p.shape) for p in net.parameters()]
    for _ in range(3):
        net(x).float().square().mean().backward()
    # Reference: the same three backward passes, each grad upcast and summed in FP32.
    ref = small_net(torch.bfloat16)
    for _ in range(3):
        ref.zero_grad()
        ref(x).float().square().mean().backward()
        for e, p in zip(expected, ref.parameters()):
            e += p.grad.float()
    for p, g, e in zip(net.parameters(), buf.main_grads, expected):
        assert p.grad is None  # freed after each backward
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    buf.zero()
    assert buf.flat.abs().sum() == 0


def test_fp32_masters_match_torch_adamw_with_decay_groups():
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    net, ref = small_net(torch.float32), small_net(torch.float32)
    buf = GradBuffer(net.parameters())
    opt = MixedPrecisionAdamW(list(net.named_parameters()), buf, cfg)
    matrices = [p for p in ref.parameters() if p.ndim >= 2]
    vectors = [p for p in ref.parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                                lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    x = torch.randn(8, 16)
    for _ in range(4):
        net(x).square().mean().backward()
        opt.step(1e-2)
        buf.zero()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_bf16_weights_are_rounded_fp32_masters():
    net = small_net(torch.bfloat16)
    buf = GradBuffer(net.parameters())
    opt = MixedPrecisionAdamW(list(net.named_parameters()), buf, OptimizerConfig(lr=1e-3))
    net(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.step(1e-3)
    for p, m in zip(net.parameters(), opt.masters):
        assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(p, m.to(torch.bfloat16))
        assert not torch.equal(p.float(), m)  # the master keeps bits the BF16 weight cannot hold


def test_clipping_scales_to_max_norm_and_reports_the_unclipped_norm():
    net = small_net(torch.float32)
    buf = GradBuffer(net.parameters())
    opt = MixedPrecisionAdamW(list(net.named_parameters()), buf, OptimizerConfig(grad_clip=0.5))
    buf.flat.copy_(torch.arange(buf.flat.numel(), dtype=torch.float32))
    norm_before = torch.linalg.vector_norm(buf.flat).item()
    norm = opt.clip_grad_norm()
    assert norm.item() == pytest.approx(norm_before)
    assert torch.linalg.vector_norm(buf.flat).item() == pytest.approx(0.5, rel=1e-5)


def test_state_dict_roundtrip_and_mismatch():
    net = small_net(torch.bfloat16)
    buf = GradBuffer(net.parameters())
    opt = MixedPrecisionAdamW(list(net.named_parameters()), buf, OptimizerConfig())
    net(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.step(1e-3)
    state = opt.state_dict()
    other_net = small_net(torch.bfloat16)
    other = MixedPrecisionAdamW(list(other_net.named_parameters()), GradBuffer(other_net.parameters()), OptimizerConfig())
    other.load_state_dict(state)
    for a, b in zip(net.parameters(), other_net.parameters()):
        assert torch.equal(a, b)
    state["masters"].pop("0.weight")
    with pytest.raises(ValueError, match="missing masters"):
        other.load_state_dict(state)


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
