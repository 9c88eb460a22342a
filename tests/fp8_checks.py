"""Comparisons of FP8 results shared by the tests (bit for bit, within one E4M3 ULP), test inputs, and an MLP."""
from __future__ import annotations

import torch


def outlier_tensor(m: int, k: int, seed: int = 0, device="cpu", dtype=torch.bfloat16) -> torch.Tensor:
    """(m, k) normal values with an outlier channel, a zero tile, a tiny value and a tile below MIN_AMAX (made on
    the CPU, so every device gets the same values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5 % k] *= 300.0
    x[7 % m, :128] = 0.0
    x[9 % m, 130 % k] = 1e-30
    if k >= 384:
        x[11 % m, 256:384] = torch.randn(128, generator=g) * 1e-37
    return x.to(device=device, dtype=dtype)


def ties_tensor(fmt, device="cpu") -> torch.Tensor:
    """(128, 256): in every row, a tile of the format's maximum and every midpoint between neighbouring FP8 values
    (subnormal ones included), and the same negated; at scale 1 each midpoint is a tie to round to the even side."""
    grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # sorted non-negative FP8 values
    ties = (grid[:-1] + grid[1:]) / 2  # exact in BF16 (one more mantissa bit than the format)
    tile = torch.cat([torch.tensor([fmt.max]), ties, grid])[:128]
    return torch.cat([tile, -tile]).repeat(128, 1).to(device=device, dtype=torch.bfloat16)


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal, or both nan."""
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def assert_same_quantization(got: tuple, want: tuple, what: str = "") -> None:
    """(fp8 values, scales) equal bit for bit (a nan matching a nan), compared on the CPU."""
    (q, s), (q_ref, s_ref) = [tuple(t.cpu() for t in pair) for pair in (got, want)]
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape, (what, q.dtype, q.shape, q_ref.dtype, q_ref.shape)
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)) | (torch.isnan(q.float()) & torch.isnan(q_ref.float()))
    bad = (~same).nonzero()
    assert len(bad) == 0, f"{what}: {len(bad)} FP8 values differ, first at {bad[:3].tolist()}: " \
        f"{q[tuple(bad[0])].float().item()} vs {q_ref[tuple(bad[0])].float().item()}"
    assert s.shape == s_ref.shape and bool(_same(s, s_ref).all()), f"{what}: scales differ"


def fp8_ordinal(q: torch.Tensor) -> torch.Tensor:
    """Each FP8 value's signed position on the format's grid (0 for both zeros): neighbours differ by one."""
    code = q.view(torch.uint8).to(torch.int32)
    magnitude = code & 0x7F
    return torch.where(code & 0x80 != 0, -magnitude, magnitude)


def float_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many FP32 ULPs apart two positive FP32 tensors are (through their bit patterns)."""
    return (a.float().view(torch.int32).long() - b.float().view(torch.int32).long()).abs()


def assert_within_one_fp8_ulp(got: tuple, want: tuple, max_scale_ulps: int, what: str = "") -> None:
    """(fp8 values, scales): every value within one FP8 ULP of `want`'s, every scale within `max_scale_ulps` FP32
    ULPs (the numerics contract for a quantizer fused into its producer)."""
    (q, s), (q_ref, s_ref) = [tuple(t.cpu() for t in pair) for pair in (got, want)]
    assert q.shape == q_ref.shape and s.shape == s_ref.shape, what
    off = (fp8_ordinal(q) - fp8_ordinal(q_ref)).abs()
    assert int(off.max()) <= 1, f"{what}: FP8 values {int(off.max())} ULPs apart at {(off > 1).nonzero()[:3].tolist()}"
    ulps = float_ulps(s, s_ref)
    assert int(ulps.max()) <= max_scale_ulps, f"{what}: scales {int(ulps.max())} FP32 ULPs apart"


def swiglu_mlp_layers(recipe, hidden: int, ffn: int, std: float, seed: int = 0, device=None):
    """(gate_up, down, norm): a seeded SwiGLU MLP's projections and its input's RMSNorm, for `swiglu_mlp`."""
    from megafp8.model.norm import RMSNorm
    from megafp8.parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(seed)
    gate_up = ColumnParallelLinear(hidden, 2 * ffn, recipe, parts=(ffn, ffn), device=device)
    down = RowParallelLinear(ffn, hidden, recipe, device=device)
    norm = RMSNorm(hidden, 1e-5, torch.bfloat16, device)
    with torch.no_grad():
        gate_up.weight.normal_(0, std)
        down.weight.normal_(0, std)
        norm.weight.copy_(torch.linspace(0.5, 1.5, hidden))
    return gate_up, down, norm


def run_with_grads(fn, x0: torch.Tensor, params: list, dy_scale: float | None = None) -> list:
    """[output, input gradient, each parameter's gradient] of fn(x0): backward from mean(y^2), or from a constant
    output gradient `dy_scale`."""
    x = x0.clone().requires_grad_(True)
    for p in params:
        p.grad = None
    y = fn(x)
    if dy_scale is None:
        y.float().square().mean().backward()
    else:
        y.backward(torch.ones_like(y) * dy_scale)
    return [y.detach(), x.grad] + [p.grad for p in params]
