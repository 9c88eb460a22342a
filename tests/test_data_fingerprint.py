"""The data fingerprint in the loader's state: a resume onto other data of the same number of samples is caught."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from megafp8.config import ConfigError
from megafp8.data import DistributedLoader, PackedDataset, TokenStream, read_meta
from megafp8.data.dataset import DataPositionError
from megafp8.data.indexed import shard_checksum


def make_loader(data, seed=3):
    return DistributedLoader(PackedDataset(TokenStream(read_meta(data), "train"), 64), 8, 2, 0, 1, seed)


def reverse_tokens_of(data, shard_number=1):
    """The same counts (tokens, documents, samples, largest id), other content: the shard's tokens reversed."""
    shard = data / read_meta(data).splits["train"][shard_number]["file"]
    tokens = np.memmap(shard, dtype=np.uint16, mode="r+")
    tokens[:] = tokens[::-1].copy()
    tokens.flush()
    return shard


def test_shard_checksum_reads_windows_and_sees_their_tokens():
    tokens = np.arange(10_000, dtype=np.uint16)
    changed = tokens.copy()
    changed[-1] = 7  # the last window ends at the shard's end
    assert shard_checksum(tokens) != shard_checksum(changed)
    assert shard_checksum(tokens[:10]) != shard_checksum(tokens[1:11])  # shorter than a window: all of it
    assert shard_checksum(tokens[:0]) == 0


def test_unchanged_data_resumes_exactly_and_so_does_a_state_without_a_fingerprint(corpus_dir):
    straight = make_loader(corpus_dir)
    straight.next_step()
    state = straight.state_dict()
    assert [len(shard) for shard in state["fingerprint"]["shards"]] == [3] * len(read_meta(corpus_dir).splits["train"])
    expected = straight.next_step()
    for saved in (state, {k: v for k, v in state.items() if k != "fingerprint"}):  # the latter: older checkpoints
        resumed = make_loader(corpus_dir)
        resumed.load_state_dict(saved)
        assert all(torch.equal(g[0], w[0]) for g, w in zip(resumed.next_step(), expected, strict=True))


def test_other_data_of_as_many_samples_is_refused_naming_what_differs(corpus_dir, tmp_path):
    state = make_loader(corpus_dir).state_dict()
    data = shutil.copytree(corpus_dir, tmp_path / "data")
    shard = reverse_tokens_of(data)
    loader = make_loader(data)
    assert len(loader.dataset) == state["num_samples"]
    with pytest.raises(DataPositionError, match=re.escape(
            f"split 'train' of {data} is not the data the saved data-loader state was read from (shard {shard}'s "
            "token checksum was ") + r"\d+, is \d+\): resume with the data the checkpoint was trained on, or name the "
            r"checkpoint in checkpoint.resume=PATH to train this data from its first sample$"):
        loader.load_state_dict(state)
    assert loader.consumed_samples == 0
    meta = json.loads((data / "meta.json").read_text())
    meta["vocab_size"] += 1
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as err:  # never resumed, even from a named checkpoint (a DataPositionError)
        make_loader(data).load_state_dict(state)
    assert not isinstance(err.value, DataPositionError)
    assert str(err.value) == (f"the checkpoint's data was tokenized by byte (vocab 258), {data} by byte (vocab 259): "
                              "the model's token ids would mean other text; train on data preprocessed with the "
                              "checkpoint's tokenizer (tools/preprocess_data.py --tokenizer byte), or start without "
                              "the checkpoint")


def append_shard_to(data):
    """Documents added to the corpus and preprocessed again at its path: one more training shard (a copy of the
    last one), more samples."""
    meta = json.loads((data / "meta.json").read_text())
    last = meta["splits"]["train"][-1]
    added = {**last, "file": last["file"].replace(".bin", "_added.bin")}
    shutil.copyfile(data / last["file"], data / added["file"])
    meta["splits"]["train"].append(added)
    (data / "meta.json").write_text(json.dumps(meta))
    return len(meta["splits"]["train"])


def test_a_corpus_grown_at_its_path_is_refused_saying_how_to_train_it(corpus_dir, tmp_path):
    """Documents added to the corpus at the same data.path: its number of samples differs, and the relaunch was told
    only to resume with the same data (no directory named, nor the way to train the grown corpus)."""
    state = make_loader(corpus_dir).state_dict()
    data = shutil.copytree(corpus_dir, tmp_path / "data")
    shards = append_shard_to(data)
    loader = make_loader(data)
    assert len(loader.dataset) > state["num_samples"]
    how = (r": resume with the data the checkpoint was trained on, or name the checkpoint in checkpoint.resume=PATH to "
           r"train this data from its first sample$")
    with pytest.raises(DataPositionError, match=re.escape(
            f"split 'train' of {data} is not the data the saved data-loader state was read from (it had "
            f"{shards - 1} shards, this data has {shards})") + how):
        loader.load_state_dict(state)
    before_fingerprints = {k: v for k, v in state.items() if k != "fingerprint"}  # told by the counts alone
    with pytest.raises(DataPositionError, match=re.escape(
            f"(it had {state['num_samples']} samples, this data has {len(loader.dataset)})") + how):
        loader.load_state_dict(before_fingerprints)
    assert loader.consumed_samples == 0


def test_the_same_tokens_read_with_the_tokenizer_at_another_path_resume(corpus_dir, tmp_path):
    """The tokenizer's spec is a path: the same tokenizer.json moved gives the same tokens, and resumes."""
    state = make_loader(corpus_dir).state_dict()
    data = shutil.copytree(corpus_dir, tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    meta["tokenizer"] = "/elsewhere/tokenizer.json"
    (data / "meta.json").write_text(json.dumps(meta))
    loader = make_loader(data)
    loader.load_state_dict(state)
    assert loader.consumed_samples == state["consumed_samples"]


def test_a_relaunch_onto_changed_data_is_refused_and_a_named_resume_starts_its_data_afresh(tiny_overrides, corpus_dir,
                                                                                          tmp_path, caplog):
    """The data was preprocessed again between launches (same path, same number of samples, other content): the
    relaunch resumed mid-order of a different dataset without a word."""
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    data = shutil.copytree(corpus_dir, tmp_path / "data")
    common = tiny_overrides + [f"data.path={data}", "training.steps=2", "checkpoint.interval=2",
                               "training.eval_interval=0"]
    Trainer(load_config("tiny_dense", common), ParallelDims.single(), torch.device("cpu")).fit()
    shard = reverse_tokens_of(data)
    with pytest.raises(ConfigError, match=rf"shard {re.escape(str(shard))}'s token checksum was \d+, is \d+\): "
                                          "resume with the data the checkpoint was trained on"):
        Trainer(load_config("tiny_dense", common + ["training.steps=3"]), ParallelDims.single(), torch.device("cpu"))
    path = tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"
    with caplog.at_level("WARNING", logger="megafp8"):
        named = Trainer(load_config("tiny_dense", common + ["training.steps=3", f"checkpoint.resume={path}"]),
                        ParallelDims.single(), torch.device("cpu"))
    assert named.step == 2 and named.loader.consumed_samples == 0
    assert re.search(r"data position of .*step_00000002 \(16 samples consumed\) does not fit this run's data: split "
                     r"'train' of .* is not the data the saved data-loader state was read from \(shard .*00001.bin's "
                     r"token checksum was \d+, is \d+\): this run reads its data from the first sample", caplog.text)
    caplog.clear()
    with caplog.at_level("WARNING", logger="megafp8"):  # `--evaluate` reads no training data: nothing to say
        evaluating = Trainer(load_config("tiny_dense", common + [f"checkpoint.resume={path}"]), ParallelDims.single(),
                             torch.device("cpu"), evaluate_only=True)
        evaluating.evaluate_checkpoint()
    assert evaluating.step == 2 and "data position" not in caplog.text, caplog.text


def test_a_document_count_recorded_on_one_side_only_is_not_a_difference(corpus_dir, tmp_path):
    """Data preprocessed before meta.json counted documents (no num_docs: -1 in the fingerprint) against the same
    data with the count: the same tokens, so the position holds."""
    data = shutil.copytree(corpus_dir, tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    for shard in meta["splits"]["train"]:
        del shard["num_docs"]
    (data / "meta.json").write_text(json.dumps(meta))
    state = make_loader(data).state_dict()
    assert all(shard[1] == -1 for shard in state["fingerprint"]["shards"])
    loader = make_loader(corpus_dir)
    loader.load_state_dict(state)
    assert loader.consumed_samples == state["consumed_samples"]


def test_samples_of_another_length_are_refused_even_where_as_many(tmp_path):
    """A small split holds as many samples of 64 tokens as of some longer length: the position carried over onto
    other tokens (a named resume with another data.seq_len continued mid-order instead of from the first sample)."""
    from megafp8.data.preprocess import preprocess

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 5)
    preprocess([str(tmp_path / "src")], tmp_path / "data", valid_fraction=0.0)
    stream = TokenStream(read_meta(tmp_path / "data"), "train")
    longer = next(n for n in range(65, 128) if (stream.num_tokens - 1) // n == (stream.num_tokens - 1) // 64)
    saved = DistributedLoader(PackedDataset(stream, 64), 2, 1, 0, 1, 3)
    saved.next_step()
    loader = DistributedLoader(PackedDataset(stream, longer), 2, 1, 0, 1, 3)
    assert len(loader.dataset) == saved.state_dict()["num_samples"]
    with pytest.raises(DataPositionError, match=f"samples of data.seq_len 64, but this run's are {longer} tokens long"):
        loader.load_state_dict(saved.state_dict())
    assert loader.consumed_samples == 0
    same = DistributedLoader(PackedDataset(stream, 64), 2, 1, 0, 1, 3)
    same.load_state_dict(saved.state_dict())
    assert same.consumed_samples == 2
