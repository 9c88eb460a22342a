"""Preprocessing, the token format, packed samples, the data-parallel loader and its resume."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from megafp8.config import ConfigError
from megafp8.data import (
    ByteTokenizer, DistributedLoader, PackedDataset, TokenStream, lockstep_validation_batches, read_meta,
    validation_batches,
)
from megafp8.data.preprocess import preprocess, train_tokenizer, training_documents
from megafp8.data.corpus import input_files, read_documents


def write_docs(folder, docs):
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


def test_preprocess_roundtrip_across_shards(tmp_path):
    docs = [f"document {i}: " + "héllo wörld " * (i + 1) for i in range(20)]
    out = tmp_path / "tok"
    preprocess([str(write_docs(tmp_path / "src", docs))], out, valid_fraction=0.0, shard_tokens=100)
    meta = read_meta(out)
    assert meta.tokenizer == "byte" and meta.eos_id == 256 and meta.dtype == np.uint16
    assert len(meta.splits["train"]) > 3  # several shards
    stream = TokenStream(meta, "train")
    tokens = stream.read(0, stream.num_tokens)
    pieces = np.split(tokens, np.where(tokens == 256)[0] + 1)[:-1]
    assert [ByteTokenizer().decode(p.tolist()) for p in pieces] == docs
    # The index holds each shard's document end offsets.
    first = meta.splits["train"][0]
    ends = np.fromfile(out / first["file"].replace(".bin", ".idx"), dtype=np.int64)
    assert len(ends) == first["num_docs"] and ends[-1] == first["num_tokens"]


def test_held_out_split_is_deterministic(tmp_path):
    src = write_docs(tmp_path / "src", [f"doc {i} " * 20 for i in range(200)])
    a = preprocess([str(src)], tmp_path / "a", valid_fraction=0.1, seed=7)
    b = preprocess([str(src)], tmp_path / "b", valid_fraction=0.1, seed=7)
    assert a == b
    assert 5 <= a["valid"][0]["num_docs"] <= 40


def test_a_draw_that_holds_out_nothing_moves_the_last_document_never_copies_it(tmp_path, caplog):
    """A few documents at --valid-fraction 0.01 used to copy the last training document into `valid`: validation
    measured training data, silently."""
    docs = [f"document {i} " * 30 for i in range(6)]
    with caplog.at_level("INFO"):
        splits = preprocess([str(write_docs(tmp_path / "src", docs))], tmp_path / "out", valid_fraction=0.01)
    assert [splits["train"][0]["num_docs"], splits["valid"][0]["num_docs"]] == [5, 1]
    meta = read_meta(tmp_path / "out")
    valid = TokenStream(meta, "valid").read(0, TokenStream(meta, "valid").num_tokens)
    train = TokenStream(meta, "train").read(0, TokenStream(meta, "train").num_tokens)
    assert ByteTokenizer().decode(valid[:-1].tolist()) == docs[-1]
    assert ByteTokenizer().decode(train.tolist()).count("document 5") == 0
    assert "drew none of the 6 documents: the last one is held out instead" in caplog.text


def test_a_single_document_is_copied_into_valid_with_a_warning(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        splits = preprocess([str(write_docs(tmp_path / "src", ["only " * 50]))], tmp_path / "out")
    assert [splits["train"][0]["num_docs"], splits["valid"][0]["num_docs"]] == [1, 1]
    assert "validation loss is measured on training data" in caplog.text


def test_jsonl_input_and_bad_record(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"content": f"text {i}"}) for i in range(5)) + "\n")
    preprocess([str(good)], tmp_path / "out", valid_fraction=0.0, json_key="content")
    assert TokenStream(read_meta(tmp_path / "out"), "train").num_tokens == sum(len(f"text {i}") + 1 for i in range(5))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON \(Expecting value, column 1\)$"):
        preprocess([str(bad)], tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_text_that_is_not_utf8_is_refused_naming_where_not_read_with_replacement_characters(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes("line one\ncafé au lait\n".encode("latin-1"))  # was read as "caf\ufffd au lait"
    with pytest.raises(ConfigError) as err:
        preprocess([str(src)], tmp_path / "out", valid_fraction=0.0)
    assert str(err.value).startswith(f"{src / 'a.txt'}: not UTF-8 text (line 2, byte 12 is 0xe9): convert it to UTF-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes('{"text": "ok"}\n{"text": "café"}\n'.encode("latin-1"))  # was UnicodeDecodeError's traceback
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not UTF-8 \(byte 13 of the line is 0xe9\)"):
        preprocess([str(bad)], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (src / "a.txt").write_bytes("line one\r\ncafé\rau lait\n".encode("utf-8"))  # line endings made "\n", as before
    preprocess([str(src)], tmp_path / "out", valid_fraction=0.0)
    train = TokenStream(read_meta(tmp_path / "out"), "train")
    assert ByteTokenizer().decode(train.read(0, train.num_tokens).tolist()[:-1]) == "line one\ncafé\nau lait\n"


def test_the_preprocessing_tool_answers_bad_arguments_and_file_system_errors_in_one_line(tmp_path, capsys,
                                                                                       monkeypatch):
    import tools.preprocess_data as tool

    src = write_docs(tmp_path / "src", ["abc " * 50])
    for args, expected in ((["--shard-tokens", "0"], "argument --shard-tokens: 0 must be at least 1"),  # was one shard
                           (["--extensions", ".txt", "--max-bytes", "-5"],                          # per document
                            "argument --max-bytes: -5 must be at least 0 (0: no limit)")):
        with pytest.raises(SystemExit):
            tool.main(["--input", str(src), "--output", str(tmp_path / "out"), *args])
        assert expected in capsys.readouterr().err
    (tmp_path / "tok.txt").write_text("not json")
    for args, expected in ((["--tokenizer", str(tmp_path / "tok.txt")], "is not a Hugging Face tokenizer.json ("),
                           (["--eos-token", "<eos>"], "--eos-token '<eos>' belongs to a tokenizer.json")):
        assert tool.main(["--input", str(src), "--output", str(tmp_path / "out"), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system", str(tmp_path / "out"))

    monkeypatch.setattr(tool, "preprocess", read_only)
    assert tool.main(["--input", str(src), "--output", str(tmp_path / "out")]) == 2  # was OSError's traceback
    assert capsys.readouterr().err == f"error: {tmp_path / 'out'}: Read-only file system\n"


def test_upper_case_endings_are_read_as_their_kind(tmp_path):
    """A directory of .TXT and .JSONL files: read as text and JSON lines, not refused as holding '.txt' files."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "A.TXT").write_text("plain text document " * 20)
    (src / "b.JSONL").write_text('{"text": "one"}\n{"text": "two"}\n')
    files = input_files([str(src)])
    assert [p.name for p in files] == ["A.TXT", "b.JSONL"]
    assert list(read_documents(files[1])) == ["one", "two"]


def test_missing_inputs_and_data_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        preprocess([str(tmp_path / "nope.txt")], tmp_path / "out")
    notes = tmp_path / "notes"
    notes.mkdir()
    for name in ("a.md", "b.md", "c.rst"):
        (notes / name).write_text("some text")
    with pytest.raises(ConfigError) as err:  # was "no input files found in [...]", not naming --extensions
        preprocess([str(notes)], tmp_path / "out")
    assert str(err.value) == (f"no .txt, .jsonl or .json files in {notes} (it holds 2 .md, 1 .rst files): to read "
                              "other text files, add --extensions with their endings, e.g. --extensions .md (each "
                              "file one document)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^no input files found in .*empty$"):
        preprocess([str(tmp_path / "empty")], tmp_path / "out")
    with pytest.raises(ConfigError, match=r"data.path '.*missing' does not exist. Create it with: python tools/preprocess_data.py"):
        read_meta(tmp_path / "missing")


def test_a_missing_relative_data_path_names_the_working_directory(tmp_path, monkeypatch):
    """Launched from outside the repository, 'data/pystdlib does not exist' did not say where it was looked for."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"data.path 'data/x' does not exist \(relative to the working directory, "
                                          rf"{tmp_path}\)\. Create it with"):
        read_meta("data/x")


def test_truncated_shard_is_reported(tmp_path, corpus_dir):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(corpus_dir, copy)
    meta = read_meta(copy)
    shard = copy / meta.splits["train"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ConfigError, match=r"00000.bin has \d+ bytes, but meta.json says .* incomplete or corrupt"):
        TokenStream(meta, "train")


def test_unknown_split_and_too_short_split(corpus_dir):
    meta = read_meta(corpus_dir)
    with pytest.raises(ConfigError, match="split 'test' is not in"):
        TokenStream(meta, "test")
    valid = TokenStream(meta, "valid")
    with pytest.raises(ConfigError, match="fewer than data.seq_len"):
        PackedDataset(valid, valid.num_tokens)


def test_packed_samples_shift_by_one(corpus_dir):
    stream = TokenStream(read_meta(corpus_dir), "train")
    ds = PackedDataset(stream, seq_len=64)
    assert len(ds) == (stream.num_tokens - 1) // 64
    tokens, targets = ds.batch(np.array([0, 5]))
    assert tokens.shape == (2, 64) and tokens.dtype == torch.int64
    assert torch.equal(tokens[1, 1:], targets[1, :-1])
    assert torch.equal(tokens[1], torch.from_numpy(stream.read(5 * 64, 64)))


def make_loader(corpus_dir, rank=0, size=1, seed=3, global_batch=8, micro=2):
    ds = PackedDataset(TokenStream(read_meta(corpus_dir), "train"), 64)
    return DistributedLoader(ds, global_batch, micro, rank, size, seed)


def test_loader_is_deterministic_and_seeded(corpus_dir):
    a = [t for _ in range(3) for t, _ in make_loader(corpus_dir).next_step()]
    b = [t for _ in range(3) for t, _ in make_loader(corpus_dir).next_step()]
    c = [t for _ in range(3) for t, _ in make_loader(corpus_dir, seed=4).next_step()]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_data_parallel_ranks_split_the_global_batch(corpus_dir):
    whole = torch.cat([t for t, _ in make_loader(corpus_dir).next_step()])
    shares = [torch.cat([t for t, _ in make_loader(corpus_dir, rank=r, size=2).next_step()]) for r in range(2)]
    assert torch.equal(torch.cat(shares), whole)


def test_loader_resumes_exactly(corpus_dir):
    straight = make_loader(corpus_dir)
    expected = [straight.next_step() for _ in range(5)][3:]
    first = make_loader(corpus_dir)
    for _ in range(3):
        first.next_step()
    resumed = make_loader(corpus_dir)
    resumed.load_state_dict(first.state_dict())
    for want in expected:
        got = resumed.next_step()
        assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want))
    other = make_loader(corpus_dir, seed=9)
    with pytest.raises(ConfigError, match="resume with the same data \\(data.path, or data.paths and data.weights\\)"):
        other.load_state_dict(first.state_dict())


def test_loader_crosses_epochs_with_a_new_order(corpus_dir):
    loader = make_loader(corpus_dir)
    n = len(loader.dataset)
    epoch0 = loader._indices(0, n)
    epoch1 = loader._indices(n, n)
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert not np.array_equal(epoch0, epoch1)


def test_validation_batches_are_the_same_set_for_any_layout(corpus_dir):
    ds = PackedDataset(TokenStream(read_meta(corpus_dir), "valid"), 64)
    whole = torch.cat([t for t, _ in validation_batches(ds, 2, 5, 0, 1)])
    r0 = validation_batches(ds, 2, 5, 0, 2)
    r1 = validation_batches(ds, 2, 5, 1, 2)
    assert (len(r0), len(r1)) == (3, 2)  # micro-batches 0, 2, 4 and 1, 3
    assert torch.equal(torch.cat([r0[0][0], r1[0][0], r0[1][0], r1[1][0], r0[2][0]]), whole)


@pytest.mark.parametrize("num_micro", [1, 3, 4])
def test_every_rank_runs_as_many_validation_micro_batches_and_the_counted_ones_are_the_set(corpus_dir, num_micro):
    """Expert parallelism pairs each forward's all-to-alls across ranks, so every rank runs the same number of
    held-out micro-batches; the counted ones are, together, the set one rank would evaluate."""
    ds = PackedDataset(TokenStream(read_meta(corpus_dir), "valid"), 64)
    whole = validation_batches(ds, 2, num_micro, 0, 1)
    per_rank = [lockstep_validation_batches(ds, 2, num_micro, r, 3) for r in range(3)]
    assert {len(batches) for batches, _ in per_rank} == {-(-num_micro // 3)}
    counted = {m: per_rank[m % 3][0][m // 3][0] for m in range(num_micro)}
    assert [sum(c) for _, c in per_rank] == [len(range(r, num_micro, 3)) for r in range(3)]
    assert all(torch.equal(counted[m], whole[m][0]) for m in range(num_micro))


def test_validation_micro_batches_are_read_as_they_are_used(corpus_dir):
    """training.eval_iters=-1 scores a whole held-out split: its micro-batches were all read into one list first
    (seq_len x 16 bytes a sample, gigabytes on every rank for a split of millions of samples); one at a time now."""
    ds = PackedDataset(TokenStream(read_meta(corpus_dir), "valid"), 64)
    reads = []
    original = ds.batch
    ds.batch = lambda indices: reads.append(indices.tolist()) or original(indices)  # type: ignore[method-assign]
    batches, counted = lockstep_validation_batches(ds, 2, 10**5, 1, 3)  # 100k micro-batches: none read yet
    assert reads == [] and len(batches) == len(counted) == 33334 and counted[-1] is False
    first = next(iter(batches))
    assert reads == [[2, 3]] and torch.equal(first[0], original(np.array([2, 3]))[0])  # micro-batch 1: rank 1's first
    assert torch.equal(batches[-1][0], original(np.array([0, 1]))[0])  # the filler: micro-batch 0, not counted


def test_eval_iters_minus_one_evaluates_every_whole_micro_batch_of_the_split(tiny_overrides):
    """Validation read the first eval_iters x micro_batch_size samples only (a 366-sample held-out file was scored
    on 8), with no way to ask for all of it: -1 reads every whole micro-batch of the split, the same loss as giving
    that count."""
    from megafp8.config import load_config
    from megafp8.data import validation_micro_batches
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    assert [validation_micro_batches(-1, 4, n) for n in (3, 4, 11, 12)] == [1, 1, 2, 3]
    assert validation_micro_batches(5, 4, 11) == 5

    def validation_loss(eval_iters: int) -> float:
        cfg = load_config("tiny_dense", tiny_overrides + [f"training.eval_iters={eval_iters}",
                                                          f"run_name=eval{eval_iters}"])
        trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
        return trainer.evaluate(), len(trainer.valid_set)

    whole, samples = validation_loss(-1)
    micro = samples // 2  # tiny_overrides: micro_batch_size=2
    assert micro > 4  # more than the default pass reads
    assert whole == validation_loss(micro)[0] != validation_loss(micro - 1)[0]


def test_hf_tokenizer_train_and_preprocess(tmp_path):
    pytest.importorskip("tokenizers")
    src = write_docs(tmp_path / "src", [f"def function_{i}(x):\n    return x * {i}\n" * 10 for i in range(50)])
    tok_path = tmp_path / "tokenizer.json"
    train_tokenizer([str(src)], tok_path, vocab_size=400)
    out = tmp_path / "tok"
    preprocess([str(src)], out, tokenizer_spec=str(tok_path), valid_fraction=0.0)
    meta = read_meta(out)
    assert 257 < meta.vocab_size <= 400 and meta.eos_id == 0  # <|endoftext|> is the first special token
    from megafp8.data import load_tokenizer
    tok = load_tokenizer(str(tok_path))
    stream = TokenStream(meta, "train")
    first_doc = stream.read(0, stream.num_tokens)
    first_doc = first_doc[: int(np.argmax(first_doc == 0))]
    assert tok.decode(first_doc.tolist()) == (src / "000.txt").read_text()
    assert stream.num_tokens < sum(len(p.read_text()) for p in src.iterdir())  # BPE compresses
    trained = tok_path.read_bytes()  # the data names it: it was replaced without a word
    with pytest.raises(ConfigError, match=r"tokenizer.json' already exists .*pass --overwrite to replace it"):
        train_tokenizer([str(src)], tok_path, vocab_size=300)
    assert tok_path.read_bytes() == trained
    train_tokenizer([str(src)], tok_path, vocab_size=300, overwrite=True)
    assert tok_path.read_bytes() != trained


def _split_texts(out):
    """The documents of each split of a byte-tokenized directory, as texts."""
    meta, texts = read_meta(out), {}
    for split in meta.splits:
        tokens = TokenStream(meta, split).read(0, TokenStream(meta, split).num_tokens)
        documents = np.split(tokens, np.where(tokens == 256)[0] + 1)[:-1]
        texts[split] = [ByteTokenizer().decode(doc.tolist()) for doc in documents]
    return texts


@pytest.mark.parametrize("num_docs, valid_fraction", [(60, 0.2), (6, 0.01), (1, 0.01), (5, 0.0)])
def test_the_tokenizer_trains_on_the_documents_preprocessing_keeps_for_training(tmp_path, num_docs, valid_fraction):
    """Outside the text-tree mode the tokenizer trained on every document, the ones preprocessing then held out for
    validation among them. The cases: a seeded draw; a draw of none, which moves the last document to `valid`;
    one document, copied into both splits; no held-out split."""
    src = write_docs(tmp_path / "src", [f"document {i} " * (i % 7 + 1) for i in range(num_docs)])
    if num_docs > 1:  # JSONL records are drawn one by one too
        (src / "more.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(3)))
    preprocess([str(src)], tmp_path / "out", valid_fraction=valid_fraction, seed=5)
    splits = _split_texts(tmp_path / "out")
    assert list(training_documents([str(src)], valid_fraction=valid_fraction, seed=5)) == splits["train"]
    held_out = {(60, 0.2): 10, (6, 0.01): 1, (1, 0.01): 1, (5, 0.0): 0}[num_docs, valid_fraction]  # seed 5 draws 10
    assert len(splits.get("valid", [])) == held_out
    if num_docs > 1:
        assert not set(splits.get("valid", [])) & set(splits["train"])


def test_train_tokenizer_leaves_the_held_out_documents_out(tmp_path):
    pytest.importorskip("tokenizers")
    src = write_docs(tmp_path / "src", [f"def f_{i}(x):\n    return x + {i}\n" * (i % 5 + 1) for i in range(40)])
    preprocess([str(src)], tmp_path / "out", valid_fraction=0.25, seed=9)
    train = _split_texts(tmp_path / "out")["train"]
    assert 0 < len(train) < 40
    used = train_tokenizer([str(src)], tmp_path / "tok.json", 300, valid_fraction=0.25, seed=9)
    assert used == (len(train), sum(len(doc.encode()) for doc in train))


def test_preprocessing_records_each_shard_s_largest_token_id(tmp_path):
    docs = ["abc", "xyz~", "a"]  # '~' (126) is the largest byte; each document ends with eos (256)
    out = tmp_path / "tok"
    preprocess([str(write_docs(tmp_path / "src", docs))], out, valid_fraction=0.0, shard_tokens=4)
    shards = read_meta(out).splits["train"]
    assert [s["max_token_id"] for s in shards] == [256] * len(shards)
    assert TokenStream(read_meta(out), "train").num_tokens == 11


def _with_bad_ids(corpus_dir, tmp_path, how):
    """A copy of the test corpus whose token ids do not fit its tokenizer, in one of three ways."""
    import shutil

    data = shutil.copytree(corpus_dir, tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    shard = meta["splits"]["train"][0 if how == "vocab_size_below_the_ids" else 1]  # the first bad one is named
    if how == "vocab_size_below_the_ids":  # meta.json's vocab_size smaller than the ids it holds
        meta["vocab_size"] = 200
    else:  # id 300: above the byte tokenizer's 257 ids, below the padded vocabulary (384)
        tokens = np.memmap(data / shard["file"], dtype=np.uint16, mode="r+")
        tokens[1000] = 300
        tokens.flush()
        if how == "recorded":
            shard["max_token_id"] = 300
        elif how == "changed_since":  # meta.json as preprocessing wrote it: the shard's bytes changed after
            pass
        else:  # data from before the largest id was recorded: it is scanned
            for split in meta["splits"].values():
                for s in split:
                    del s["max_token_id"]
    (data / "meta.json").write_text(json.dumps(meta))
    return data, data / shard["file"]


def test_a_token_id_outside_the_vocabulary_in_a_shard_changed_since_preprocessing_stops_its_read(corpus_dir,
                                                                                                    tmp_path):
    """meta.json's largest id is trusted at start-up (no scan of every shard), so a shard whose bytes changed after
    (a flipped bit, a partial copy) passes it; the read of the sample holding the bad id stops with one error naming
    the shard and the token. Read on, the id (300, below the padded vocabulary of 384) trained a padding row of the
    embedding, silently."""
    from megafp8.data.dataset import PackedDataset

    data, shard = _with_bad_ids(corpus_dir, tmp_path, "changed_since")
    stream = TokenStream(read_meta(data), "train")
    dataset = PackedDataset(stream, seq_len=64)
    shard_index = [data / s["file"] for s in read_meta(data).splits["train"]].index(shard)
    bad = int(stream.starts[shard_index]) + 1000  # the shards are all non-empty here
    dataset.sample(bad // 64 - 2)  # samples without it still read
    with pytest.raises(ConfigError, match=rf"token shard {shard} holds token id 300 at token 1000, but its tokenizer "
                                          r"has \d+ ids and preprocessing recorded none that large: the shard changed "
                                          "since it was written") as err:
        dataset.sample(bad // 64)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("how", ["vocab_size_below_the_ids", "recorded", "scanned"])
def test_token_ids_outside_the_vocabulary_are_refused_before_step_1(tiny_overrides, corpus_dir, tmp_path, how):
    """0800a78 trained on ids between the tokenizer's vocabulary and the padded one, and crashed a few steps in
    (rank 0 in F.embedding) when meta.json's vocab_size was below the ids."""
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    data, shard = _with_bad_ids(corpus_dir, tmp_path, how)
    cfg = load_config("tiny_dense", tiny_overrides + [f"data.path={data}"])
    with pytest.raises(ConfigError, match=rf"token shard {shard} holds token id \d+, but its tokenizer \(byte\) has "
                                          r"\d+ ids \(vocab_size in .*meta.json\): the data does not match its "
                                          "tokenizer") as err:
        Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    assert "\n" not in str(err.value)


def _word_level_tokenizer(path, vocab):
    """A tokenizer.json mapping whitespace-separated words to the ids of `vocab` (which may leave gaps)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.parametrize("eos_id", [70_000, 65_600])
def test_a_tokenizer_whose_ids_leave_gaps_keeps_every_id(tmp_path, eos_id):
    """A tokenizer.json whose ids are not 0..n-1 (here 4 tokens, the end-of-text one at `eos_id`) reported n as its
    vocabulary: the tokens were stored as uint16 and preprocessing died in numpy with "OverflowError: Python integer
    70000 out of bounds for uint16" (under numpy 1.x, which setup.py allows, id 65600 wrapped silently to 64)."""
    pytest.importorskip("tokenizers")
    tok_path = _word_level_tokenizer(tmp_path / "gaps.json", {"a": 0, "b": 1, "[UNK]": 2, "<|endoftext|>": eos_id})
    src = write_docs(tmp_path / "src", ["a b a", "b b"])
    preprocess([str(src)], tmp_path / "out", tokenizer_spec=str(tok_path), valid_fraction=0.0)
    meta = read_meta(tmp_path / "out")
    assert (meta.vocab_size, meta.eos_id, meta.dtype) == (eos_id + 1, eos_id, np.uint32)
    stream = TokenStream(meta, "train")
    assert stream.read(0, stream.num_tokens).tolist() == [0, 1, 0, eos_id, 1, 1, eos_id]


def test_a_named_checkpoint_starts_a_run_of_other_data_settings_from_its_first_sample(tiny_overrides, tmp_path,
                                                                                      caplog):
    """checkpoint.resume=PATH may start a run of other settings (docs/checkpoints.md), a context-extension stage
    among them, but the loader refused any other data.seq_len, data.path or data seed: "resume with the same
    data.path, data.seq_len and data order seed", right after the warning that the run continues under them."""
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    common = tiny_overrides + ["training.steps=2", "checkpoint.interval=2", "training.eval_interval=0"]
    Trainer(load_config("tiny_dense", common), ParallelDims.single(), torch.device("cpu")).fit()
    path = tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"
    with caplog.at_level("WARNING", logger="megafp8"):
        longer = Trainer(load_config("tiny_dense", common + ["run_name=long", f"checkpoint.resume={path}",
                                                            "data.seq_len=128", "training.steps=3"]),
                         ParallelDims.single(), torch.device("cpu"))
    assert longer.step == 2 and longer.loader.consumed_samples == 0
    assert re.search(r"data position of .*step_00000002 \(16 samples consumed\) does not fit this run's data: the "
                     r"saved data-loader state is for samples of data.seq_len 64, but this run's are 128 tokens long: "
                     r"this run reads its data from the first sample of its own order", caplog.text)
    fresh = make_loader(longer.cfg.data.path, seed=longer.loader.seed)
    fresh.dataset = longer.loader.dataset
    assert all(torch.equal(a[0], b[0]) for a, b in zip(longer.loader.next_step(), fresh.next_step()))


def test_no_checkpoint_resumes_on_data_of_another_tokenizer_even_when_named(tiny_overrides, corpus_dir, tmp_path):
    """The byte-tokenized run's checkpoint, named in checkpoint.resume over data that another tokenizer wrote (the
    model's vocabulary holds both): its embedding's rows would mean other text. It trained on, with only a warning
    that data.path differed."""
    import shutil

    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    common = tiny_overrides + ["training.steps=2", "checkpoint.interval=2", "training.eval_interval=0"]
    Trainer(load_config("tiny_dense", common), ParallelDims.single(), torch.device("cpu")).fit()
    other = tmp_path / "other"
    shutil.copytree(corpus_dir, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "tokenizer": "/data/tok300.json", "vocab_size": 300}))
    path = tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"
    with pytest.raises(ConfigError) as err:  # (auto-resume refuses any other data.path before this)
        Trainer(load_config("tiny_dense", common + ["run_name=other", f"checkpoint.resume={path}",
                                                    f"data.path={other}"]), ParallelDims.single(), torch.device("cpu"))
    assert str(err.value) == (
        f"the checkpoint's data was tokenized by byte (vocab 258), {other} by /data/tok300.json (vocab 300): the "
        "model's token ids would mean other text; train on data preprocessed with the checkpoint's tokenizer "
        "(tools/preprocess_data.py --tokenizer byte), or start without the checkpoint")


def test_batches_larger_than_their_split_are_warned_about(tiny_overrides, tmp_path, caplog):
    """A global batch larger than the training samples holds some of them twice in every step, and validation of
    more samples than the held-out split has reads some twice: both happened without a word."""
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train.build import build_data

    preprocess([str(write_docs(tmp_path / "src", ["x" * 300, "y" * 200]))], tmp_path / "small", valid_fraction=0.5)
    cfg = load_config("tiny_dense", tiny_overrides + [f"data.path={tmp_path / 'small'}", "training.eval_iters=3"])
    with caplog.at_level("WARNING", logger="megafp8"):
        loader, valid = build_data(cfg, [read_meta(tmp_path / "small")], ParallelDims.single())
    assert (len(loader.dataset), len(valid)) == (4, 3)  # 301 and 201 tokens: samples of 64 + 1
    assert ("training.global_batch_size=8 is more than the 4 samples of split 'train': every step holds some samples "
            "more than once (add data, or lower training.global_batch_size or data.seq_len)") in caplog.text
    assert ("validation reads training.eval_iters x training.micro_batch_size = 6 samples, more than the 3 of split "
            "'valid': it reads some more than once (add held-out data, or lower training.eval_iters)") in caplog.text


def test_a_file_named_twice_in_the_inputs_is_read_once(tmp_path, caplog):
    """`--input corpus/ corpus/extra.jsonl` (or a shell glob overlapping a name) trained on the file twice."""
    src = write_docs(tmp_path / "src", ["alpha " * 20, "beta " * 20])
    with caplog.at_level("WARNING"):
        files = input_files([str(src), str(src / "001.txt"), str(tmp_path / "src" / ".." / "src" / "000.txt")])
    assert [p.name for p in files] == ["000.txt", "001.txt"]
    assert "2 input file(s) named more than once are read once" in caplog.text
