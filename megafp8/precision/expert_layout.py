"""The padded expert layout of the FP8 grouped GEMMs: rows sorted by expert, each expert's rows starting on a 128-row
boundary, built on the device from per-expert row counts (`megafp8.precision.grouped` multiplies in it; the traced
ops of `megafp8.precision.fp8_ops` rebuild it from a graph's tensors)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from megafp8.precision.formats import TILE


@dataclass
class ExpertRows:
    """Rows sorted by expert, and the padded layout the FP8 GEMMs use: each expert's rows start on a
    128-row boundary (zero rows fill the gaps), so no 1x128 tile along the rows straddles two experts.

    Built on the device from the row counts, with no host sync: where the counts live on the device, `total`
    is an upper bound of the padded rows (each expert can add at most 127 padding rows), and the tiles past the
    last expert's are padding as well (`tile_expert` -1: the GEMMs write zeros there). Only `segments` needs the
    counts on the host (the reference backend's loops and tests)."""

    counts: Optional[torch.Tensor]  # (E,) int64 rows per expert, on the rows' device (None: `of_tiles`)
    total: int  # padded rows, a multiple of 128
    index: Optional[torch.Tensor]  # (rows,) padded position of each row (None: `of_tiles`)
    tile_expert: Optional[torch.Tensor]  # (total / 128,) int32: the expert of each 128-row tile, -1 past the last
    tile_start: torch.Tensor  # (E,) int32: first tile of each expert
    tile_count: torch.Tensor  # (E,) int32: tiles of each expert

    @classmethod
    def of_tiles(cls, total: int, tile_expert: Optional[torch.Tensor], tile_start: torch.Tensor,
                 tile_count: torch.Tensor) -> "ExpertRows":
        """The layout as the grouped GEMMs read it (its tiles, not its rows): what the FP8 autograd function and the
        traced ops rebuild from tensors. `tile_expert` may be None where only weight gradients are computed."""
        return cls(None, total, None, tile_expert, tile_start, tile_count)

    @functools.cached_property
    def segments(self) -> list[tuple[int, int, int]]:
        """(expert, first padded row, end padded row) of the experts with rows (reads the counts on the host)."""
        starts, tiles = self.tile_start.tolist(), self.tile_count.tolist()
        return [(e, s * TILE, (s + t) * TILE) for e, (s, t) in enumerate(zip(starts, tiles)) if t]


def counts_on(counts, device: torch.device) -> torch.Tensor:
    """Per-expert row counts (a list or a tensor) as an int64 tensor on `device`; a host list is copied without
    waiting for the GPU (pinned, queued)."""
    if isinstance(counts, torch.Tensor):
        return counts.to(device=device, dtype=torch.int64)
    table = torch.tensor(counts, dtype=torch.int64)
    if device.type == "cuda":  # a copy from pageable memory would wait for the GPU
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def expert_rows(counts, device: torch.device, rows: Optional[int] = None) -> ExpertRows:
    """The padded layout of `rows` rows sorted by expert, `counts[e]` of them for expert e. With host counts (a
    list) the layout is exact; with device counts `rows` (their sum, known on the host) must be given, and the
    layout takes the upper bound of the padded rows, so nothing waits for the GPU."""
    if isinstance(counts, torch.Tensor):
        if rows is None:
            raise ValueError("expert_rows with counts on the device needs `rows`, their sum")
        num_tiles = (rows + counts.shape[0] * (TILE - 1)) // TILE  # sum of ceil(c / 128) is at most this
    else:
        rows, num_tiles = sum(counts), sum(-(-c // TILE) for c in counts)
    counts = counts_on(counts, device)
    tiles = (counts + TILE - 1) // TILE
    tile_end = torch.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    row_start = torch.cumsum(counts, 0) - counts
    shift = tile_start * TILE - row_start  # padded minus unpadded position, per expert
    index = torch.arange(rows, device=device) + torch.repeat_interleave(shift, counts, output_size=rows)
    tile_expert = torch.searchsorted(tile_end, torch.arange(num_tiles, device=device), right=True)
    tile_expert = torch.where(tile_expert < counts.shape[0], tile_expert, -1).to(torch.int32)
    return ExpertRows(counts, num_tiles * TILE, index, tile_expert, tile_start.to(torch.int32),
                      tiles.to(torch.int32))
