"""Which output tiles a program of the warp-specialized GEMM (`ws_gemm`) takes, and where each lies: the tile walk
shared by its producer and consumer partitions, which each compute it for themselves (no tile index passes between
them).

Programs are persistent (one an SM) and take tiles program, program + programs, ...; tiles go along M in groups
of GROUP_M row tiles. K grouped (the experts' wgrads), the tiles go group by group, and where the product is added
into `main_grad` only the groups with K blocks are walked (the compact walk: `busy_ranks`, `busy_group`).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

TILE = gl.constexpr(128)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def busy_ranks(k_count_ptr, num_groups, BLOCK_E: gl.constexpr, layout: gl.constexpr):
    """(ranks, busy groups) of the compact walk: each group's place among the groups with K blocks (-1 for a group
    without any), over BLOCK_E >= num_groups lanes of `layout`, and how many groups have K blocks. Read once, at a
    program's start: a tile's group is then found in registers (`busy_group`), with no load between tiles."""
    e = gl.arange(0, BLOCK_E, layout=layout)
    busy = (gl.load(k_count_ptr + e, mask=e < num_groups, other=0) > 0).to(gl.int32)
    rank = gl.associative_scan(busy, 0, _add) - busy
    return gl.where(busy > 0, rank, -1), gl.sum(busy, 0)


@gluon.jit
def busy_group(place, ranks, BLOCK_E: gl.constexpr, layout: gl.constexpr):
    """The group whose rank is `place` (one that exists: the walk's tiles stop at the busy groups' last)."""
    e = gl.arange(0, BLOCK_E, layout=layout)
    return gl.max(gl.where(ranks == place, e, -1), 0)


@gluon.jit
def walked_tiles(M, N, num_groups, k_count_ptr, BLOCK_N: gl.constexpr, GROUPED_K: gl.constexpr,
                  COMPACT: gl.constexpr, BLOCK_E: gl.constexpr, layout: gl.constexpr):
    """(tiles, ranks): how many output tiles the programs share out, and the compact walk's ranks (0 without it).
    With COMPACT only the groups with K blocks have tiles (`tile_coords`)."""
    tiles = gl.cdiv(M, TILE) * gl.cdiv(N, BLOCK_N)
    ranks = 0
    if GROUPED_K:
        if COMPACT:
            ranks, busy = busy_ranks(k_count_ptr, num_groups, BLOCK_E, layout)
            tiles = tiles * busy
        else:
            tiles = tiles * num_groups
    return tiles, ranks


@gluon.jit
def tile_coords(tile, M, N, K_BLOCKS, tile_expert_ptr, k_start_ptr, k_count_ptr, ranks,
                GROUPED_ROWS: gl.constexpr, GROUPED_K: gl.constexpr, COMPACT: gl.constexpr, BLOCK_N: gl.constexpr,
                GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr, layout: gl.constexpr):
    """(off_m, off_n, b_row, group, k_first, k_steps) of output tile `tile`: its first row and column, the first
    row of B it reads, its expert (0 for dense), and its K blocks [k_first, k_first + k_steps).

    K grouped, the tiles are group by group: tile // (tiles a group) is the group, or, with COMPACT, the busy
    group of that rank (`busy_ranks`): only the groups with K blocks have tiles, dealt out over the programs as if
    no group were idle. In group order, a group's tiles go to consecutive programs; with most groups idle (a
    collapsed router), each busy group's tiles fall on one stripe of programs, and those under more stripes do
    several times the mean's work (`benchmarks/grouped_wgrad_walk.py`; docs/benchmarks.md, jobs IE-IG)."""
    num_m = gl.cdiv(M, TILE)
    num_n = gl.cdiv(N, BLOCK_N)
    per_group = num_m * num_n
    group = tile * 0  # dense: one group
    t = tile % per_group
    if GROUPED_K:
        if COMPACT:
            group = busy_group(tile // per_group, ranks, BLOCK_E, layout)
        else:
            group = tile // per_group
    in_group = GROUP_M * num_n
    first_m = (t // in_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % in_group) % size_m
    pid_n = (t % in_group) // size_m
    off_m = pid_m * TILE
    off_n = pid_n * BLOCK_N
    b_row = off_n
    k_first = 0
    k_steps = K_BLOCKS
    if GROUPED_ROWS:  # a padding tile past the last expert's rows (expert -1) gets zeros: no K steps
        expert = gl.load(tile_expert_ptr + pid_m)
        k_steps = gl.where(expert >= 0, K_BLOCKS, 0)
        group = gl.maximum(expert, 0)
        b_row = group * N + off_n
    if GROUPED_K:
        k_first = gl.load(k_start_ptr + group)
        k_steps = gl.load(k_count_ptr + group)
    return off_m, off_n, b_row, group, k_first, k_steps


def walk_lanes(groups: int) -> int:
    """The compact walk's lanes (`busy_ranks`): a power of two, at least the groups and a lane for each thread of a
    consumer warpgroup."""
    return max(128, 1 << (groups - 1).bit_length())
