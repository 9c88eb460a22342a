"""Bad input to preprocessing and to the data reader: each a single error naming where and what to change, with
nothing written and no record dropped unsaid (JSONL records, meta.json, tokenizer paths)."""
from __future__ import annotations

import argparse
import gzip
import importlib
import json
import re

import numpy as np
import pytest

from megafp8.config import ConfigError
from megafp8.data import ByteTokenizer, TokenStream, read_meta
from megafp8.data.corpus import read_documents
from megafp8.data.preprocess import preprocess, train_tokenizer
from megafp8.data.text_tree import scan_text_tree
from tests.test_data import write_docs


@pytest.mark.parametrize("name, content, expected", [
    ("number.jsonl", '{"text": "ok"}\n{"text": 12345}\n', ":2: 'text' is a number, not a string"),  # was dropped
    ("list.jsonl", '{"text": ["a", "b"]}\n', ":1: 'text' is an array, not a string"),                 # unsaid
    ("object.jsonl", '{"text": "ok"}\n{"text": {"en": "x"}}\n', ":2: 'text' is an object, not a string"),
    ("key.jsonl", '{"content": "x", "id": 3}\n', ":1: no 'text' key (its keys: 'content', 'id'): set --json-key"),
    ("array.jsonl", '[1, 2]\n', ":1: an array, not a JSON object with a 'text' string"),
    ("cut.jsonl", '{"text": "ok"}\n{"text": "doc tw', ":2: not valid JSON (Unterminated string starting at, column 10)"),
    ("pretty.json", '[{"text": "a"},\n {"text": "b"}]\n', ".json files are read as JSON lines, one object per line"),
    ("surrogate.jsonl", '{"text": "bad \\ud800 x"}\n',  # json accepts it; the tokenizers raised tracebacks
     ":1: 'text' is not valid Unicode text (a lone surrogate \\ud800 at character 4)")])
def test_a_jsonl_record_without_text_is_refused_naming_its_line_and_what_is_wrong(tmp_path, caplog, name, content,
                                                                                  expected):
    """Records whose text is a number, an array or an object (a wrong key or schema) were skipped without a word;
    bad JSON was blamed on --json-key; a lone surrogate reached the tokenizer. Each is now one error naming the file,
    the line and the fault, and nothing is written. Empty and null texts are skipped and counted in a warning, and a
    leading byte-order mark is read."""
    bad = tmp_path / name
    bad.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        preprocess([str(bad)], tmp_path / "out", valid_fraction=0.0)
    assert str(err.value).startswith(str(bad)) and expected in str(err.value), str(err.value)
    assert not (tmp_path / "out").exists()
    bom = tmp_path / "bom.jsonl"
    bom.write_text('\ufeff{"text": "first"}\n{"text": ""}\n{"text": null}\n{"text": "fourth"}\n', encoding="utf-8")
    with caplog.at_level("WARNING"):
        assert list(read_documents(bom)) == ["first", "fourth"]
    assert "bom.jsonl: 2 record(s) with an empty or null 'text' skipped" in caplog.text


@pytest.mark.parametrize("edit, expected", [
    (lambda meta: [meta], "is corrupt (TypeError('a JSON list, not an object'))"),  # was AttributeError's traceback
    (lambda meta: {**meta, "splits": list(meta["splits"])}, "'splits' is a JSON list, not an object of split names"),
    (lambda meta: {**meta, "splits": {"train": ["train/00000.bin"]}}, "shard 0 of split 'train' is not an object"),
    (lambda meta: {**meta, "splits": {"train": [{"file": "train/00000.bin"}]}},  # was KeyError at the first batch
     "shard 0 of split 'train': 'num_tokens' is None, not a count"),
    (lambda meta: {**meta, "splits": {"train": [{**meta["splits"]["train"][0], "max_token_id": None}]}},
     "'max_token_id' is None, not a token id"),
    (lambda meta: {**meta, "dtype": "int16"}, "dtype 'int16' cannot hold token ids of a 258-id vocabulary"),
    (lambda meta: {**meta, "dtype": "float16"}, "dtype 'float16' cannot hold token ids"),
])
def test_a_meta_json_of_the_wrong_shape_or_token_type_is_one_clear_error(tmp_path, edit, expected):
    """meta.json edited by hand or written by another tool: a wrong structure was a KeyError/TypeError traceback at
    the first batch, and a signed or float dtype read the shards' bytes as other ids (negative, or garbage) past
    every size check. Each is refused when the data is opened, naming the file and what to re-run."""
    out = tmp_path / "out"
    preprocess([str(write_docs(tmp_path / "src", ["abc " * 50, "def " * 50]))], out, valid_fraction=0.0)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["dtype"] == "uint16" and read_meta(out).dtype == np.uint16
    meta_path.write_text(json.dumps(edit(meta)))
    with pytest.raises(ConfigError) as err:
        read_meta(out)
    assert str(err.value).startswith(str(meta_path)) and expected in str(err.value), str(err.value)
    assert "re-run tools/preprocess_data.py" in str(err.value)
    meta_path.write_text(json.dumps({**meta, "dtype": "uint32"}))  # a width tokens may be written in, not these
    assert read_meta(out).dtype == np.uint32
    with pytest.raises(ConfigError, match=r"00000.bin has \d+ bytes, but meta.json says \d+ uint32 tokens"):
        TokenStream(read_meta(out), "train")  # and the shards' sizes say they were not


def test_a_tokenizer_path_that_is_a_directory_says_so(tmp_path):
    """A directory given as --tokenizer was reported as a file that "does not exist"."""
    pytest.importorskip("tokenizers")
    from megafp8.data.tokenizer import load_tokenizer

    with pytest.raises(ConfigError, match=r"tokenizer '.*' is a directory; pass its tokenizer.json path or 'byte'"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a directory \(it holds one: pass that file\)"):
        load_tokenizer(str(tmp_path))


def test_a_tokenizer_output_that_is_a_directory_or_in_a_missing_one_is_refused_before_training(tmp_path):
    """--output DIR --overwrite trained, then failed with IsADirectoryError's traceback and left DIR.partial."""
    pytest.importorskip("tokenizers")
    src = write_docs(tmp_path / "src", ["abc " * 50])
    (tmp_path / "tok").mkdir()
    with pytest.raises(ConfigError, match=r"output '.*tok' is a directory: give the tokenizer.json file to write, "
                                          r"e.g. --output .*tok/tokenizer.json"):
        train_tokenizer([str(src)], tmp_path / "tok", 300, overwrite=True)
    with pytest.raises(ConfigError, match=r"the directory .*missing does not exist: create it first"):
        train_tokenizer([str(src)], tmp_path / "missing" / "tok.json", 300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "tok"]


@pytest.mark.parametrize("tool_name", ["preprocess_data", "train_tokenizer"])
def test_a_negative_seed_is_a_usage_error_and_a_large_one_is_kept_exactly(tmp_path, capsys, tool_name):
    """--seed -1 reached numpy's generator: a ValueError traceback ("expected non-negative integer") after the
    tokenizer was loaded. A seed beyond a float's 53 bits is taken as written, not rounded to another."""
    tool = importlib.import_module(f"tools.{tool_name}")
    src = write_docs(tmp_path / "src", ["abc " * 50])
    with pytest.raises(SystemExit):
        tool.main(["--input", str(src), "--output", str(tmp_path / "out"), "--seed", "-1"])
    assert "argument --seed: -1 must be at least 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    parser = argparse.ArgumentParser()
    importlib.import_module("tools.preprocess_data").add_text_tree_options(parser)
    assert parser.parse_args(["--seed", "12345678901234567891"]).seed == 12345678901234567891
    assert parser.parse_args(["--seed", "1e3"]).seed == 1000


@pytest.mark.parametrize("tree", [False, True])
def test_a_tokenizer_is_not_trained_on_no_documents(tmp_path, capsys, tree):
    """Empty inputs trained a tokenizer of the 256 bytes alone and exited 0 ("trained on 0 documents")."""
    pytest.importorskip("tokenizers")
    from tools.train_tokenizer import main

    src = write_docs(tmp_path / "src", ["", ""])
    out = tmp_path / "tok.json"
    assert main(["--input", str(src), "--output", str(out), "--vocab-size", "300",
                 *(["--extensions", ".txt"] if tree else [])]) == 2
    err = capsys.readouterr().err
    assert err == f"error: no training documents in {src} (all inputs empty, or --valid-fraction too high): give the " \
                  "tokenizer documents to train on\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no tokenizer, no partial file


def test_an_unwritable_tokenizer_output_is_one_line_before_the_training(tmp_path, capsys, monkeypatch):
    """Saving into a directory that cannot be written failed after the whole training, in the Rust library's bare
    Exception ("Permission denied (os error 13)"): a traceback. The output is now tried first, an OSError's line."""
    pytest.importorskip("tokenizers")
    import tokenizers
    from tools.train_tokenizer import main

    def never_trained(*args, **kwargs):
        raise AssertionError("trained before the output was found unwritable")

    monkeypatch.setattr(tokenizers.Tokenizer, "train_from_iterator", never_trained)
    src = write_docs(tmp_path / "src", ["abc " * 50])
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "tok.json.partial").mkdir()  # cannot be written as a file, even by root
    assert main(["--input", str(src), "--output", str(tmp_path / "ro" / "tok.json"), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tok.json.partial" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("output", [".", "", "sub/.."])
def test_an_output_naming_no_directory_of_its_own_is_refused(tmp_path, monkeypatch, output):
    """`--output . --overwrite` in an empty directory passed the checks, then died in a ValueError traceback
    ("PosixPath('.') has an empty name") when naming OUT.partial ('sub/..', its parent, is refused alike)."""
    src = write_docs(tmp_path / "src", ["abc " * 50])
    (tmp_path / "here" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(ConfigError, match=rf"--output '{re.escape(output)}' names no directory of its own: give the "
                                          r"directory to write, e.g. --output data/mycorpus"):
        preprocess([str(src)], output, overwrite=True)
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["sub"]


def test_a_tokenized_directory_inside_the_input_is_left_out_not_read_as_text(tmp_path, caplog):
    """`--input corpus --output corpus/tok` worked once; every later run over corpus (another --output, or the same
    with --overwrite) read corpus/tok/meta.json as JSON lines and was refused: "not valid JSON ... .json files are
    read as JSON lines", advice about a file that is no input. In the text-tree mode with .json it was a document."""
    docs = ["first document " * 20, "second document " * 20]
    src = write_docs(tmp_path / "corpus", docs)
    preprocess([str(src)], src / "tok", valid_fraction=0.0)
    with caplog.at_level("WARNING"):
        preprocess([str(src)], src / "tok", valid_fraction=0.0, overwrite=True)
        preprocess([str(src)], src / "again", valid_fraction=0.0)
    assert f"{src / 'tok'} is a tokenized directory (tools/preprocess_data.py's output), not text: left out" \
           in caplog.text
    for out in ("tok", "again"):
        stream = TokenStream(read_meta(src / out), "train")
        assert ByteTokenizer().decode(stream.read(0, stream.num_tokens).tolist()) == "".join(docs)
    (src / "notes.json").write_text('{"a": 1}\n')
    tree = scan_text_tree([str(src)], [".json", ".txt"], 0.0, 0)
    assert sorted(f.path.name for f in tree.train) == ["000.txt", "001.txt", "notes.json"]


def test_compressed_inputs_are_named_as_such_with_the_command_that_makes_them_text(tmp_path):
    """crawl.jsonl.gz given by name was "not UTF-8 text ...: convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), or
    read the inputs as a text tree (--extensions)"; a directory of them advised --extensions .gz, which skips every
    one of them (binary). Neither fits a compressed file."""
    packed = tmp_path / "crawl.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"text": "hello"}\n' * 100))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(packed))} is a gzip-compressed file, not text: "
                                          rf"decompress it first \(gunzip -k {re.escape(str(packed))}\), then give "
                                          "the text or JSONL file$"):
        preprocess([str(packed)], tmp_path / "out")
    (tmp_path / "dir").mkdir()
    packed.rename(tmp_path / "dir" / packed.name)
    with pytest.raises(ConfigError, match=r"\(it holds 1 .gz files\): gzip-compressed files are not read: decompress "
                                          r"them first \(gunzip -k \*.gz\), then give the .txt/.jsonl files$"):
        preprocess([str(tmp_path / "dir")], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("foreign", ["tokenizer.json", "train/notes.txt"])
def test_overwrite_keeps_files_preprocessing_did_not_write(tmp_path, foreign):
    """--overwrite replaced a directory with a meta.json whole: a tokenizer.json kept beside its data (the very one
    --tokenizer named: the new meta.json then named a deleted file) or notes in it were deleted unsaid."""
    src = write_docs(tmp_path / "src", ["abc " * 50, "def " * 50])
    out = tmp_path / "out"
    preprocess([str(src)], out, valid_fraction=0.0)
    (out / foreign).write_text("mine")
    with pytest.raises(ConfigError, match=rf"^output '{re.escape(str(out))}' holds {re.escape(str(out / foreign))}, "
                                          r"which tools/preprocess_data.py did not write: --overwrite would delete it "
                                          r"with the old data; move it out of the directory, or choose another "
                                          r"--output$"):
        preprocess([str(src)], out, valid_fraction=0.5, overwrite=True)
    assert (out / foreign).read_text() == "mine" and "valid" not in read_meta(out).splits
    (out / foreign).unlink()
    preprocess([str(src)], out, valid_fraction=0.5, overwrite=True)  # the tool's own files alone: replaced
    assert "valid" in read_meta(out).splits
