"""The order in which an epoch visits the samples of a split: a seeded permutation of [0, n).

Two kinds, recorded in the loader's state so that a run keeps its kind for good:

- `permutation`: numpy's `default_rng([seed, epoch]).permutation(n)`, held in memory (4 bytes a sample below
  2**31 samples). Every run of up to `PERMUTATION_LIMIT` samples uses it: golden losses, parity runs and every
  checkpoint written before `feistel-v1` existed depend on it.
- `feistel-v1`: a keyed pseudo-random permutation computed per position in O(1) memory, for larger splits (a
  15T-token corpus at seq_len 4096 is ~3.6B samples: its permutation would take 14 GB per rank, and a minute or
  more to build at start-up and at every epoch). A balanced Feistel network over the smallest even bit width 2h
  with 2**(2h) >= n permutes [0, 2**(2h)); a value >= n is encrypted again (cycle walking) until it falls in
  [0, n), which keeps the map a bijection on [0, n). The round function hashes the right half with a key drawn
  from (seed, epoch, round) by splitmix64's mixer. A position takes 6 rounds and, on average, fewer than 4 walks
  (2**(2h) < 4n); a step's positions are computed together in uint64 numpy arithmetic.
"""
from __future__ import annotations

import numpy as np

PERMUTATION = "permutation"
FEISTEL_V1 = "feistel-v1"
ORDER_KINDS = (PERMUTATION, FEISTEL_V1)
# Up to 2**26 samples (275B tokens at seq_len 4096) an epoch's permutation costs 256 MB per rank (2 GB on an
# 8-GPU node) and a few seconds to build; above, its memory and time grow without bound, and feistel-v1's do not.
PERMUTATION_LIMIT = 2**26
FEISTEL_ROUNDS = 6  # Luby-Rackoff needs 4 with random round functions; 2 more cost nothing (a step's few samples)

_MASK64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment and its two multipliers
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def order_kind(num_samples: int, permutation_limit: int = PERMUTATION_LIMIT) -> str:
    """The kind of order a new run over `num_samples` samples uses."""
    return PERMUTATION if num_samples <= permutation_limit else FEISTEL_V1


def permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """`default_rng([seed, epoch]).permutation(num_samples)` in the narrowest sufficient dtype: shuffling an int32
    `arange` draws the same swaps as shuffling the int64 one, so the values are the same at half the memory."""
    dtype = np.int32 if num_samples <= np.iinfo(np.int32).max else np.int64
    order = np.arange(num_samples, dtype=dtype)
    np.random.default_rng([seed, epoch]).shuffle(order)
    return order


def _mix64(z: int) -> int:
    """splitmix64's output step on a Python int (the round keys)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """splitmix64's output step on uint64 values (arithmetic wraps modulo 2**64, as the hash wants)."""
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
    return z ^ (z >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    """The `FEISTEL_ROUNDS` round keys of epoch `epoch`'s order under `seed`."""
    epoch_key = _mix64(_mix64(seed & _MASK64) ^ (epoch & _MASK64))
    return [np.uint64(_mix64(epoch_key ^ r)) for r in range(FEISTEL_ROUNDS)]


def _half_bits(num_samples: int) -> int:
    """h: the smallest with 2**(2h) >= num_samples (at least 1, so that n = 1 still has a domain to walk)."""
    return max(1, ((num_samples - 1).bit_length() + 1) // 2)


def _encrypt(x: np.ndarray, keys: list[np.uint64], half: np.uint64, mask: np.uint64) -> np.ndarray:
    """One pass of the Feistel network over the values `x` of [0, 2**(2 * half)) (`mask`: the low half's bits)."""
    left, right = x >> half, x & mask
    for key in keys:
        left, right = right, left ^ (_mix64_array(right ^ key) & mask)
    return (left << half) | right


def feistel_order(positions: np.ndarray, num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The samples at `positions` (each in [0, num_samples)) of epoch `epoch`'s feistel-v1 order, as int64."""
    half = _half_bits(num_samples)
    keys, shift, mask = _round_keys(seed, epoch), np.uint64(half), np.uint64((1 << half) - 1)
    values = _encrypt(np.asarray(positions, dtype=np.uint64), keys, shift, mask)
    # Cycle walking: the walk from a position < n through the 2**(2h)-permutation comes back below n (at the
    # latest where its cycle returns to itself), and distinct positions meet distinct first values below n.
    walking = np.flatnonzero(values >= num_samples)
    while walking.size:
        values[walking] = _encrypt(values[walking], keys, shift, mask)
        walking = walking[values[walking] >= num_samples]
    return values.astype(np.int64)
