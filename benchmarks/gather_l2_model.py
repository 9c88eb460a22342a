#!/usr/bin/env python
"""How much of the MoE dispatch's source a gather reads from HBM, by an LRU model of L2 (CPU only, no GPU).

The FP8 dispatch (`gather_quantize_rows_cols`) and the combine's gradient (`gather_scale_quantize_rows_cols`) fill
the padded expert layout tile by tile, 128 rows x 128 features a program, each row read from the source (tokens x
hidden, BF16) through the layout's index. A token sits in top_k rows, one in each of its experts' blocks, far
apart in the layout. The model walks the tiles in the grid's order (each token block's features first, as the
kernel does by default, or the token blocks first: `rows_cols_gluon.launch(rows_first=True)`), touches every
128-byte line the tile reads from the source and writes to its two FP8 outputs, and keeps the last `--l2-mib` of
lines (least recently used out). It prints the source bytes that miss, what the kernel would read from HBM. A
model: it runs the tiles one after another (the GPU runs a few hundred at once, which reorders accesses only
within that window), ignores L2's sets and partitions and assumes every write allocates a line.

    PYTHONPATH=. python benchmarks/gather_l2_model.py [--tokens 16384] [--hidden 2048] [--experts 64] [--top-k 8]
"""
from __future__ import annotations

import argparse
import collections
from typing import Iterator

import torch

LINE = 128  # bytes of an L2 line
TILE = 128


def expert_layout_index(tokens: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """The padded expert layout's source row of each row (-1 for padding): every token routed to top_k distinct
    experts at random, rows sorted by expert (tokens in order within one), each expert padded to 128 rows, the
    layout as long as its bound without a host sync (`megafp8.precision.expert_layout.expert_rows`)."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.flatten()
    token = torch.arange(tokens).repeat_interleave(top_k)
    order = torch.sort(chosen, stable=True).indices
    chosen, token = chosen[order], token[order]
    counts = torch.bincount(chosen, minlength=experts)
    padded = (counts + TILE - 1) // TILE * TILE
    first_row = torch.cumsum(padded, 0) - padded
    rank = torch.arange(token.numel()) - (torch.cumsum(counts, 0) - counts)[chosen]
    index = torch.full(((token.numel() + experts * (TILE - 1)) // TILE * TILE,), -1, dtype=torch.long)
    index[first_row[chosen] + rank] = token
    return index


def tile_order(token_blocks: int, feature_blocks: int, rows_first: bool) -> Iterator[tuple[int, int]]:
    """(token block, feature block) in the grid's order: the first grid axis varies fastest."""
    if rows_first:
        return ((mb, kb) for kb in range(feature_blocks) for mb in range(token_blocks))
    return ((mb, kb) for mb in range(token_blocks) for kb in range(feature_blocks))


def source_bytes_from_hbm(index: torch.Tensor, hidden: int, rows_first: bool, l2_bytes: int) -> int:
    """Source bytes that miss the modelled L2 over one gather-quantize of `index`'s rows (BF16 source)."""
    capacity = l2_bytes // LINE
    lru: collections.OrderedDict = collections.OrderedDict()
    missed = 0
    rows_out, cols_out = 1 << 48, 2 << 48  # the outputs' lines, apart from the source's
    token_blocks, feature_blocks = index.numel() // TILE, hidden // TILE
    chunk_lines = TILE * 2 // LINE  # a tile's 128 BF16 features of one row
    for mb, kb in tile_order(token_blocks, feature_blocks, rows_first):
        lines = [(t * hidden * 2 + kb * TILE * 2) // LINE + j
                 for t in index[mb * TILE:(mb + 1) * TILE].tolist() if t >= 0 for j in range(chunk_lines)]
        for line in lines:
            if line in lru:
                lru.move_to_end(line)
            else:
                missed += 1
                lru[line] = None
        # the FP8 rows (128 rows x 128 bytes) and the transposed columns (128 features x 128 tokens)
        for i in range(TILE):
            row_line = rows_out + (mb * TILE + i) * feature_blocks + kb
            col_line = cols_out + (kb * TILE + i) * token_blocks + mb
            for line in (row_line, col_line):
                lru[line] = None
                lru.move_to_end(line)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return missed * LINE


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--l2-mib", type=int, nargs="+", default=[50, 25])
    args = parser.parse_args(argv)
    index = expert_layout_index(args.tokens, args.experts, args.top_k)
    source = args.tokens * args.hidden * 2
    print(f"{args.tokens} tokens x {args.hidden} BF16 ({source / 2**20:.0f} MiB), top-{args.top_k} of {args.experts} "
          f"experts, {index.numel()} rows; every read missing: {args.top_k * source / 2**20:.0f} MiB\n")
    print("| L2 (MiB) | features first (the default) | token blocks first |\n|---|---|---|")
    for mib in args.l2_mib:
        cells = [f"{source_bytes_from_hbm(index, args.hidden, rows_first, mib << 20) / 2**20:.0f} MiB"
                 for rows_first in (False, True)]
        print(f"| {mib} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
