"""The epoch's sample order: numpy's permutation for the splits of today, feistel-v1 above a limit, and its resume."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megafp8.config import ConfigError
from megafp8.data import DistributedLoader, PackedDataset, TokenStream, read_meta
from megafp8.data.order import FEISTEL_V1, PERMUTATION, PERMUTATION_LIMIT, feistel_order, permutation

SIZES = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 100, 255, 256, 257, 1000, 1023, 1024, 1025, 4097, 65536, 65537]


@pytest.mark.parametrize("n", SIZES)
def test_feistel_order_is_a_bijection(n):
    for seed, epoch in [(0, 0), (3, 1), (2**40 + 5, 9)]:
        order = feistel_order(np.arange(n), n, seed, epoch)
        assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(n))


def test_feistel_order_of_any_positions_is_the_whole_order_s():
    """A step computes only its own positions: they give the same samples as the epoch's whole order."""
    n = 5000
    whole = feistel_order(np.arange(n), n, 7, 2)
    some = np.array([4999, 0, 1234, 17, 17])
    assert np.array_equal(feistel_order(some, n, 7, 2), whole[some])


def test_feistel_orders_differ_by_seed_and_epoch():
    n = 1000
    orders = [feistel_order(np.arange(n), n, seed, epoch) for seed in (0, 1, 2) for epoch in (0, 1, 2)]
    for i, a in enumerate(orders):
        for b in orders[i + 1:]:
            assert np.mean(a == b) < 0.02  # as for independent permutations: ~1 in n places agree


def test_feistel_order_looks_shuffled():
    """Fixed seeds, so this cannot fail by chance: over 200 seeds, no order of 1000 samples keeps 4 consecutive
    indices in a row or correlates with the identity, and every index's mean position is near the middle (a random
    permutation's is within 0.5 +- 0.02 one standard deviation at a time)."""
    n, seeds = 1000, range(200)
    position = np.empty((len(seeds), n))
    for seed in seeds:
        order = feistel_order(np.arange(n), n, seed, 0)
        position[seed, order] = np.arange(n)
        steps = np.diff(order) == 1
        assert not np.any(steps[:-2] & steps[1:-1] & steps[2:]), seed
        assert abs(np.corrcoef(order, np.arange(n))[0, 1]) < 0.2, seed
    mean_position = position.mean(axis=0) / n
    assert 0.4 < mean_position.min() and mean_position.max() < 0.6


def test_small_splits_keep_numpy_s_permutation_in_int32():
    """Golden losses, parity runs and existing checkpoints depend on today's order: it is kept, at half the
    memory."""
    for n in (1, 10, 24_000):
        order = permutation(n, 3, 1)
        assert order.dtype == np.int32 and np.array_equal(order, np.random.default_rng([3, 1]).permutation(n))


def make_loader(corpus_dir, rank=0, size=1, global_batch=1024, micro=32, limit=PERMUTATION_LIMIT):
    ds = PackedDataset(TokenStream(read_meta(corpus_dir), "train"), 64)
    return DistributedLoader(ds, global_batch, micro, rank, size, seed=3, permutation_limit=limit)


def test_the_loader_walks_feistel_above_its_limit_and_says_so(corpus_dir):
    small, large = make_loader(corpus_dir), make_loader(corpus_dir, limit=100)
    n = len(small.dataset)
    assert (small.state_dict()["order"], large.state_dict()["order"]) == (PERMUTATION, FEISTEL_V1)
    assert np.array_equal(small._indices(0, n), np.random.default_rng([3, 0]).permutation(n))
    assert np.array_equal(large._indices(n - 5, 10), np.concatenate([feistel_order(np.arange(n - 5, n), n, 3, 0),
                                                                     feistel_order(np.arange(5), n, 3, 1)]))
    assert large._epoch_order is None  # nothing the size of the split is held


def _same(got, want):
    return all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("saved_at", ["mid_epoch", "epoch_end"])
def test_a_feistel_run_resumes_exactly_at_any_data_parallel_size(corpus_dir, dp, saved_at):
    """The resumed loaders are built with the default limit (which would pick the permutation for this split): they
    keep the order the checkpoint records, mid-epoch and across the epoch's end."""
    straight = make_loader(corpus_dir, limit=100)
    n = len(straight.dataset)
    steps_per_epoch = n // 1024  # the corpus holds ~4,000 samples: a few steps an epoch
    saved_step = 1 if saved_at == "mid_epoch" else steps_per_epoch  # the next step straddles the epoch's end
    for _ in range(saved_step):
        straight.next_step()
    state = straight.state_dict()
    expected = [straight.next_step() for _ in range(2)]
    assert state["order"] == FEISTEL_V1
    assert (saved_step + 1) * 1024 > n if saved_at == "epoch_end" else (saved_step + 2) * 1024 <= n
    resumed = [make_loader(corpus_dir, rank=r, size=dp) for r in range(dp)]
    for loader in resumed:
        loader.load_state_dict(state)
        assert loader.order_kind == FEISTEL_V1
    for want in expected:
        got = [batch for loader in resumed for batch in loader.next_step()]
        assert _same(got, want)
    assert resumed[0].state_dict() == straight.state_dict()


def test_a_state_without_an_order_kind_walks_the_permutation(corpus_dir):
    """Checkpoints written before feistel-v1 existed: their run walked the permutation and still does, whatever
    the limit of the resuming run."""
    straight = make_loader(corpus_dir, global_batch=8, micro=2)
    straight.next_step()
    old_state = {k: v for k, v in straight.state_dict().items() if k != "order"}
    resumed = make_loader(corpus_dir, global_batch=8, micro=2, limit=100)
    resumed.load_state_dict(old_state)
    assert resumed.order_kind == PERMUTATION and _same(resumed.next_step(), straight.next_step())


def test_an_unknown_order_kind_is_refused(corpus_dir):
    loader = make_loader(corpus_dir)
    state = {**loader.state_dict(), "order": "feistel-v9"}
    with pytest.raises(ConfigError, match=r"sample order 'feistel-v9' that this version does not know \(it knows "
                                          r"permutation, feistel-v1\): resume with the megafp8 version that wrote"):
        loader.load_state_dict(state)
