"""Training on a weighted mixture of tokenized directories (`data.paths`, `data.weights`; `megafp8.data.blend`)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.data import DistributedLoader, PackedDataset, TokenStream, read_meta
from megafp8.data.blend import TrainingMixture, ValidationMixture, read_metas
from megafp8.data.dataset import DataPositionError
from megafp8.data.preprocess import preprocess
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer

SEQ_LEN = 16


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory) -> tuple[Path, Path]:
    """Two byte-tokenized directories of distinguishable text: 'a' documents (small) and 'b' documents (4x)."""
    root = tmp_path_factory.mktemp("mixture")
    dirs = []
    for name, docs, size in (("a", 10, 400), ("b", 40, 400)):
        src = root / f"src_{name}"
        src.mkdir()
        for i in range(docs):
            (src / f"{i:03d}.txt").write_text(name * size, encoding="utf-8")
        out = root / name
        preprocess([str(src)], out, valid_fraction=0.2, seed=0)
        dirs.append(out)
    return dirs[0], dirs[1]


def splits(dirs: tuple[Path, ...], split: str = "train") -> list[PackedDataset]:
    return [PackedDataset(TokenStream(read_meta(d), split), SEQ_LEN, split) for d in dirs]


def source_of(tokens: torch.Tensor) -> str:
    """Which corpus a sample came from: its most common byte ('a' = 97, 'b' = 98)."""
    return chr(int(torch.mode(tokens.flatten()).values))


def test_blocks_give_each_dataset_its_weight_and_every_sample_an_epoch(two_corpora):
    a, b = splits(two_corpora)
    even = TrainingMixture([a, b], [1.0, 1.0])
    assert even.shares == [0.5, 0.5] and even.blocks == [len(b), len(b)]  # a is read len(b) / len(a) times
    assert even.reads_per_epoch() == [len(b) / len(a), 1.0]
    by_size = TrainingMixture([a, b], [])
    assert by_size.blocks == [len(a), len(b)] and by_size.reads_per_epoch() == [1.0, 1.0]
    # An epoch of the loader reads each dataset exactly its block's worth of samples, all of them at least once.
    loader = DistributedLoader(even, global_batch_size=2, micro_batch_size=1, dp_rank=0, dp_size=1, seed=3)
    which, within = even._locate(loader._indices(0, len(even)))  # the whole first epoch
    assert np.bincount(which).tolist() == even.blocks
    assert set(within[which == 0].tolist()) == set(range(len(a)))
    assert set(within[which == 1].tolist()) == set(range(len(b)))


def test_a_step_holds_each_dataset_about_its_weight_and_samples_are_theirs(two_corpora):
    mixture = TrainingMixture(splits(two_corpora), [3.0, 1.0])
    loader = DistributedLoader(mixture, global_batch_size=64, micro_batch_size=8, dp_rank=0, dp_size=1, seed=1)
    sources = [source_of(tokens[i]) for _ in range(4) for tokens, _ in loader.next_step() for i in range(len(tokens))]
    share_a = sources.count("a") / len(sources)
    assert 0.65 < share_a < 0.85, share_a  # 0.75 asked; 256 samples drawn


def test_validation_interleaves_by_weight_and_reads_every_sample_once(two_corpora):
    a, b = splits(two_corpora, "valid")
    mixture = ValidationMixture([a, b], [1.0, 3.0])
    assert len(mixture) == len(a) + len(b)
    which, within = mixture._locate(np.arange(len(mixture)))
    assert sorted(zip(which.tolist(), within.tolist())) == [(0, j) for j in range(len(a))] + \
        [(1, j) for j in range(len(b))]
    assert which[:8].tolist().count(0) == 2  # the first samples hold a at its weight, 1 in 4
    tokens, _ = mixture.batch(np.arange(4))
    assert [source_of(t) for t in tokens] == [chr(97 + k) for k in which[:4].tolist()]
    fresh = ValidationMixture([a, b], [1.0, 3.0])  # its order built for the first samples only: the same ones
    fresh.min_prefix = 2
    assert [k.tolist() for k in fresh._locate(np.arange(5))] == [which[:5].tolist(), within[:5].tolist()]
    assert len(fresh._which) < len(mixture)


def test_a_saved_position_over_other_weights_or_data_is_refused(two_corpora):
    a, b = splits(two_corpora)

    def loader(dataset) -> DistributedLoader:
        return DistributedLoader(dataset, 8, 2, 0, 1, seed=1)

    saved = loader(TrainingMixture([a, b], [1.0, 1.0]))
    saved.next_step()
    state = saved.state_dict()
    resumed = loader(TrainingMixture([a, b], [1.0, 1.0]))
    resumed.load_state_dict(state)
    assert resumed.consumed_samples == 8
    assert all(torch.equal(x[0], y[0]) for x, y in zip(resumed.next_step(), saved.next_step()))
    by_size = TrainingMixture([a, b], [])
    reweighted = state | {"num_samples": len(by_size)}  # the same size, to reach the fingerprint's check
    with pytest.raises(DataPositionError, match=r"the mixture's blocks were \[\d+, \d+\] samples, are .*other "
                                                r"data.weights"):
        loader(by_size).load_state_dict(reweighted)
    with pytest.raises(DataPositionError, match="it was read from a mixture of 2 datasets"):
        loader(a).load_state_dict(state | {"num_samples": len(a)})
    with pytest.raises(DataPositionError, match="it was read from one dataset, this run reads the mixture"):
        one = loader(a)
        one.next_step()
        loader(TrainingMixture([a, b], [1.0, 1.0])).load_state_dict(one.state_dict() | {"num_samples": len(saved.dataset)})


def test_directories_of_other_tokenizers_do_not_mix(two_corpora, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2, "[UNK]": 3}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.txt").write_text("a b a b " * 50)
    preprocess([str(src)], tmp_path / "other", tokenizer_spec=str(tmp_path / "tok.json"), valid_fraction=0.0)
    with pytest.raises(ConfigError, match=r"data.paths mixes data of other tokenizers: .* \(vocab 258, end of document "
                                          r"256\), .* \(vocab 4, end of document 2\): tokenize every directory"):
        read_metas([str(two_corpora[0]), str(tmp_path / "other")])


@pytest.mark.parametrize("overrides, message", [
    (["data.weights=[1.0]"], "data.weights weighs the directories of data.paths, which is empty"),
    (["data.paths=[x, y]", "data.weights=[1.0]"], "data.weights has 1 weights for the 2 directories"),
    (["data.paths=[x, y]", "data.weights=[1.0, 0]"], "data.weights must be positive finite numbers, got 0"),
    (["data.paths=[x, x]"], "data.paths names x more than once"),
    (["data.paths=[x, ./x/]"], r"data.paths names x more than once \(as x and as ./x/\)"),  # was read twice an epoch
    (["data.seed=-1"], r"data.seed=-1 is not between 0 and 2\^32 - 1"),  # numpy's tracebacks at the first step
    (["training.seed=4294967296"], r"training.seed=4294967296 is not between 0 and 2\^32 - 1 \(4294967295\)"),
])
def test_bad_mixture_and_seed_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_dense", overrides)


def test_a_run_on_a_mixture_trains_evaluates_and_resumes_bit_identically(two_corpora, tiny_overrides, tmp_path):
    mixture = [f"data.paths=[{two_corpora[0]}, {two_corpora[1]}]", "data.weights=[1, 3]", "data.seq_len=16"]
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=3"]

    def trainer(extra: list[str]) -> Trainer:
        return Trainer(load_config("tiny_dense", tiny_overrides + mixture + extra), ParallelDims.single(),
                       torch.device("cpu"))

    straight = trainer(["checkpoint.resume=none", "run_name=straight"])
    assert isinstance(straight.loader.dataset, TrainingMixture)
    assert isinstance(straight.valid_set, ValidationMixture)
    straight_losses = [r["loss"] for r in straight.fit() if r["kind"] == "train"]
    first = trainer(ckpt)
    for _ in range(3):
        first.train_step()
    first.save()
    resumed = trainer(ckpt)
    assert resumed.step == 3
    assert [r["loss"] for r in resumed.fit() if r["kind"] == "train"] == straight_losses[3:]


def test_an_export_of_a_mixture_run_checks_its_tokenizer_as_one_directory_s(two_corpora, tiny_overrides, tmp_path):
    """The run's data fingerprint of a mixture holds each directory's; the export's tokenizer check read the
    single-directory form and found no recorded vocabulary, so it checked nothing."""
    from megafp8.checkpoint.convert import export_hf

    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2, "[UNK]": 3}, unk_token="[UNK]")
    tokenizers.Tokenizer(model).save(str(tmp_path / "other.json"))
    mixture = [f"data.paths=[{two_corpora[0]}, {two_corpora[1]}]", "data.seq_len=16", "training.steps=1",
               "optimizer.warmup_steps=0",
               "training.eval_interval=0", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=1"]
    Trainer(load_config("tiny_dense", tiny_overrides + mixture), ParallelDims.single(), torch.device("cpu")).fit()
    with pytest.raises(ConfigError, match=r"has 4 ids, but the run's data was tokenized with byte of 258"):
        export_hf(tmp_path / "ckpt" / "step_00000001", tmp_path / "hf", fp8=False, tokenizer=tmp_path / "other.json",
                  eos_token="<|endoftext|>")


class _Sized:
    """A stand-in for a dataset of `n` samples: the blocks read only its length."""

    seq_len = SEQ_LEN

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def where(self) -> str:
        return f"a split of {self.n} samples"


@pytest.mark.parametrize("lengths", [[481003666, 11, 917596], [3, 7, 10**9 + 7], [1, 2, 3, 4, 5]])
def test_shares_by_size_read_every_sample_once_an_epoch(lengths):
    """No weights: one corpus of them all. In floats, shares L_k / sum(L) made blocks of L_k + 1 for about a fifth of
    size combinations (a sample read twice an epoch)."""
    mixture = TrainingMixture([_Sized(n) for n in lengths], [])
    assert mixture.blocks == lengths and mixture.reads_per_epoch() == [1.0] * len(lengths)


def test_weights_too_lopsided_to_index_are_one_clear_error():
    with pytest.raises(ConfigError, match=r"data.weights make an epoch of the mixture 5e\+22 samples \(every sample of "
                                          r"a split of 5000000 samples, weighted 1e-16, read once\), more than the "
                                          r"4.61e\+18 its sample order can index: raise that directory's weight"):
        TrainingMixture([_Sized(3 * 10**9), _Sized(5 * 10**6)], [1.0, 1e-16])
    huge = TrainingMixture([_Sized(3 * 10**9), _Sized(5 * 10**6)], [1.0, 1e-11])  # 5e17 samples: indexed
    loader = DistributedLoader(huge, global_batch_size=8, micro_batch_size=1, dp_rank=0, dp_size=1, seed=1)
    which, within = huge._locate(loader._indices(len(huge) - 4, 8))  # an epoch's end: no O(N) memory, no overflow
    assert ((within >= 0) & (within < np.array([3 * 10**9, 5 * 10**6])[which])).all()


def test_a_partial_pass_reads_other_samples_each_epoch_and_all_alike_over_epochs(two_corpora):
    """Where a block is not whole passes over its dataset, its extra reads went to the same first samples every
    epoch (position o read sample o mod L): each epoch now continues the dataset's cycle where the last stopped."""
    a, b = splits(two_corpora)
    mixture = TrainingMixture([a, b], [3.0, 1.0])
    block, length = mixture.blocks[0], len(a)
    assert block % length  # a partial pass over a, so some of its samples are read once more an epoch
    positions = np.arange(mixture.block_starts[0], mixture.block_starts[1])

    def reads(epoch: int) -> np.ndarray:
        which, within = mixture._locate(positions, np.full(len(positions), epoch))
        assert (which == 0).all()
        return np.bincount(within, minlength=length)

    assert (reads(0) == np.bincount(positions % length, minlength=length)).all()  # epoch 0 as before
    assert not (reads(0) == reads(1)).all()
    epochs = length // math.gcd(block, length)  # the cycle's period in epochs: every sample read alike
    assert len(set((sum(reads(e) for e in range(epochs))).tolist())) == 1
    # The loader passes each sample's epoch: a step straddling an epoch's end reads both epochs' cycles.
    loader = DistributedLoader(mixture, global_batch_size=8, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    loader.consumed_samples = len(mixture) - 4
    (tokens, _), = loader.next_step()
    indices = loader._indices(len(mixture) - 4, 8)
    expected, _ = mixture.batch(indices, np.array([0] * 4 + [1] * 4))
    assert torch.equal(tokens, expected)


def test_a_mixture_run_relaunched_with_another_unread_data_path_is_the_same_run():
    """data.path is not read where data.paths is given: a relaunch changing it was refused as another run."""
    from megafp8.config.loader import config_to_dict
    from megafp8.train.run_history import config_changes

    def flat(*overrides: str) -> dict:
        return config_to_dict(load_config("tiny_dense", list(overrides)))

    assert config_changes(flat("data.paths=[x, y]"), flat("data.paths=[x, y]", "data.path=elsewhere")) == []
    assert config_changes(flat("data.paths=[x, y]"), flat("data.paths=[x, z]")) != []
    assert config_changes(flat(), flat("data.path=elsewhere")) != []  # one directory: its path is the data
