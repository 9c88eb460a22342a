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

`--gemms` models the warp-specialized GEMM's operand reads instead, at tile granularity: the 8B-layer linears'
fprop and dgrad at 16,384 tokens, its output tiles (128 x 256) in the kernel's order for groups of GROUP_M row
tiles (`ws_tiles.tile_coords`), 132 at a time (one program an SM), each touching its A row block (128 x K FP8) and
B column block (256 x K), and the HBM bytes those reads miss in L2 per GROUP_M.
"""
from __future__ import annotations

import argparse
import collections
from typing import Iterator

import torch

LINE = 128  # bytes of an L2 line
TILE = 128


def expert_layout_index(tokens: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """The padded expert layout's source row of each row (-1 for padding), built as the MoE layer builds it
    (`expert_rows` with the counts on the device, so the layout takes its bound; `padded_source_index`): every
    token routed to top_k distinct experts at random, rows sorted by expert (tokens in order within one)."""
    from megafp8.precision.expert_layout import expert_rows
    from megafp8.precision.grouped import padded_source_index

    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.flatten()
    order = torch.sort(chosen, stable=True).indices
    counts = torch.bincount(chosen, minlength=experts)
    layout = expert_rows(counts, torch.device("cpu"), rows=chosen.numel())
    return padded_source_index(layout, order // top_k)


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


# The 8B-layer linears' fprop and dgrad at 16,384 tokens: name -> (M, N, K) of C (M, N) = A (M, K) @ B (N, K)^T
GEMMS = {"qkv fprop": (16384, 12288, 4096), "out fprop": (16384, 4096, 4096), "gate/up fprop": (16384, 28672, 4096),
         "down fprop": (16384, 4096, 14336), "qkv dgrad": (16384, 4096, 12288), "out dgrad": (16384, 4096, 4096),
         "gate/up dgrad": (16384, 4096, 28672), "down dgrad": (16384, 14336, 4096)}


def gemm_tile_order(num_m: int, num_n: int, group_m: int) -> Iterator[tuple[int, int]]:
    """The output tiles (row tile, column tile) in `ws_tiles.tile_coords`'s order: groups of `group_m` row tiles,
    the row tiles varying fastest within a group."""
    in_group = group_m * num_n
    for t in range(num_m * num_n):
        first_m = (t // in_group) * group_m
        size_m = min(num_m - first_m, group_m)
        yield first_m + (t % in_group) % size_m, (t % in_group) // size_m


def gemm_bytes_from_hbm(m: int, n: int, k: int, group_m: int, l2_bytes: int, programs: int = 132,
                        block_n: int = 256) -> int:
    """FP8 operand bytes the GEMM's tiles miss in the modelled L2 (row and column blocks as LRU entries)."""
    lru: collections.OrderedDict = collections.OrderedDict()
    held = fetched = 0
    tiles = list(gemm_tile_order(m // TILE, -(-n // block_n), group_m))
    for wave in range(0, len(tiles), programs):
        for row, col in tiles[wave:wave + programs]:
            for key, size in ((("a", row), TILE * k), (("b", col), block_n * k)):
                if key in lru:
                    lru.move_to_end(key)
                    continue
                fetched += size
                held += size
                lru[key] = size
        while held > l2_bytes:
            held -= lru.popitem(last=False)[1]
    return fetched


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--l2-mib", type=int, nargs="+", default=[50, 25])
    parser.add_argument("--gemms", action="store_true", help="model the 8B-layer GEMMs' operand reads instead")
    args = parser.parse_args(argv)
    if args.gemms:
        widths = (4, 8, 16, 32)
        print(f"HBM bytes read (MB) with {args.l2_mib[0]} MiB of L2, by GROUP_M (the kernel's default: 8)\n")
        print("| GEMM (M, N, K) | A + B (MB) | " + " | ".join(f"GROUP_M {g}" for g in widths) + " |")
        print("|---|---|" + "---|" * len(widths))
        for name, (m, n, k) in GEMMS.items():
            cells = [f"{gemm_bytes_from_hbm(m, n, k, g, args.l2_mib[0] << 20) / 1e6:.0f}" for g in widths]
            print(f"| {name} ({m}, {n}, {k}) | {(m + n) * k / 1e6:.0f} | " + " | ".join(cells) + " |")
        return
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
