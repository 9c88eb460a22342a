"""The persistent grouped-K GEMM's tile walk (`megafp8.precision.kernels.schedule`): every tile once, busiest
experts first, whole rounds dealt as a snake, and the programs' work within a few percent of each other where the
expert-by-expert walk leaves one program with a stripe of busy experts. Pure torch: the kernel that reads the walk
is checked on the GPU (`tests/test_moe_gpu.py`, the same bits as the expert-by-expert walk)."""
from __future__ import annotations

import pytest
import torch

from megafp8.precision.kernels.schedule import balanced_tile_order, program_loads


def _skewed_counts(experts: int, rows: int, spread: float, seed: int) -> torch.Tensor:
    """K steps (128-row tiles) per expert for `rows` routed rows, log-normally uneven (`spread`), as a young router
    spreads them."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.exp(spread * torch.randn(experts, generator=g, dtype=torch.float64))
    return torch.ceil(rows * weights / weights.sum() / 128).to(torch.int32)


def test_the_walk_visits_every_tile_once_busiest_expert_first_and_snakes_over_whole_rounds():
    counts = torch.tensor([17, 3, 40, 17, 1, 0, 9, 22], dtype=torch.int32)
    order = balanced_tile_order(counts, tiles_per_group=5, programs=6)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(40))
    # Unsnaked: experts by count, most first, ties in expert order; each expert's tiles consecutive.
    rounds = [order[i:i + 6].tolist() for i in range(0, 36, 6)]
    unsnaked = [t for i, r in enumerate(rounds) for t in (r[::-1] if i % 2 else r)] + order[36:].tolist()
    experts = [2, 7, 0, 3, 6, 1, 4, 5]
    assert unsnaked == [e * 5 + t for e in experts for t in range(5)]
    assert order[36:].tolist() == [26, 27, 28, 29]  # the last partial round as it is


@pytest.mark.parametrize("spread", [0.3, 0.6, 1.0])
def test_the_walk_evens_the_programs_work_where_the_expert_by_expert_walk_does_not(spread):
    """The MoE step's down projection: 64 experts, 16 x 4 tiles each (256-wide), 132 programs (an H200's SMs),
    131,072 routed rows. A tile's cost is its expert's K steps plus a constant for its epilogue."""
    experts, tiles_per_group, programs = 64, 64, 132
    counts = _skewed_counts(experts, 131_072, spread, seed=int(spread * 10))
    cost = counts.repeat_interleave(tiles_per_group).double() + 2.0

    def imbalance(order):
        loads = program_loads(cost, order, programs)
        assert float(loads.sum()) == pytest.approx(float(cost.sum()))  # every tile counted once
        return float(loads.max() / loads.mean())

    walk = torch.arange(experts * tiles_per_group, dtype=torch.int32)
    balanced = imbalance(balanced_tile_order(counts, tiles_per_group, programs))
    # 4,096 tiles on 132 programs: 31 or 32 tiles each, so 1.03 is the floor even for equal experts.
    assert balanced < 1.06, balanced
    assert balanced <= imbalance(walk)
    if spread >= 0.6:  # (at 0.3 this seed's stripes happen to hold even work: 1.036)
        assert imbalance(walk) > balanced + 0.05, (imbalance(walk), balanced)


def test_a_single_round_and_bad_arguments():
    counts = torch.tensor([1, 5], dtype=torch.int32)
    assert balanced_tile_order(counts, 3, 132).tolist() == [3, 4, 5, 0, 1, 2]  # fewer tiles than programs
    assert balanced_tile_order(counts, 3, 2).tolist() == [3, 4, 0, 5, 1, 2]
    with pytest.raises(ValueError, match="programs >= 1"):
        balanced_tile_order(counts, 3, 0)
