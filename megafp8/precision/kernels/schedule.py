"""The order in which a persistent grouped-K GEMM's programs take their output tiles (pure torch: no Triton needed,
so the CPU tests can check it).

The warp-specialized kernel (`ws_gemm`) runs one program per SM; program p takes the tiles at positions p, p + P,
p + 2P, ... of a walk over all output tiles. In the experts' weight gradient (K grouped) a tile's cost is its
expert's K steps, its number of routed rows, which the router makes uneven. Walked expert by expert, the positions
a program takes fall on a stripe of experts (64 tiles an expert on 132 SMs: every other expert, for many rounds),
so a program whose stripe holds the busy experts finishes last: 1.17-1.32x the mean program's work at the load
spreads a young router makes (simulated), where the gate/up projection's 128 tiles an expert meet every program
about once. `balanced_tile_order` walks the experts from the most rows to the fewest and deals each round of P
tiles alternately forwards and backwards over the programs (a snake: the longest-processing-time-first rule),
which brings the busiest program within a few percent of the mean. An expert's tiles stay consecutive, so the
programs working on one expert at a time still share its operands in L2.
"""
from __future__ import annotations

import torch


def balanced_tile_order(k_count: torch.Tensor, tiles_per_group: int, programs: int) -> torch.Tensor:
    """The walk over `k_count.numel() * tiles_per_group` output tiles (tile g * tiles_per_group + t is tile t of
    group g) that balances `programs` persistent programs: groups by K steps (`k_count`), most first, their tiles
    consecutive; the walk's whole rounds of `programs` tiles alternate in direction (odd rounds reversed), the last
    partial round as it is. Int32 on `k_count`'s device; no host sync (the counts stay on the device)."""
    if programs < 1 or tiles_per_group < 1:
        raise ValueError(f"balanced_tile_order needs programs >= 1 and tiles_per_group >= 1, got {programs} and "
                         f"{tiles_per_group}")
    groups = torch.argsort(k_count, descending=True, stable=True).to(torch.int32)
    within = torch.arange(tiles_per_group, dtype=torch.int32, device=k_count.device)
    order = (groups[:, None] * tiles_per_group + within).reshape(-1)
    whole = order.numel() // programs * programs
    rounds = order[:whole].view(-1, programs)
    rounds[1::2] = rounds[1::2].flip(1)
    return order


def program_loads(tile_cost: torch.Tensor, order: torch.Tensor, programs: int) -> torch.Tensor:
    """Each program's summed tile cost when program p takes the tiles at positions p, p + programs, ... of `order`
    (the persistent kernel's static schedule): what `balanced_tile_order` evens out."""
    positions = torch.arange(order.numel(), device=order.device)
    loads = torch.zeros(programs, dtype=tile_cost.dtype, device=tile_cost.device)
    return loads.index_add_(0, positions % programs, tile_cost[order.long()])
