"""tools/preprocess_data.py's output directory: never clobbered, replaced only when asked and only where preprocessing
wrote it, one writer at a time, published whole (a run killed while writing or replacing leaves no half dataset)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from megafp8.config import ConfigError
from megafp8.data import ByteTokenizer, TokenStream, read_meta
from megafp8.data.preprocess import preprocess
from tests.test_data import write_docs


def test_existing_output_is_not_clobbered(tmp_path):
    src = write_docs(tmp_path / "src", ["abc " * 50])
    preprocess([str(src)], tmp_path / "out", valid_fraction=0.0)
    with pytest.raises(ConfigError, match="already exists; pass --overwrite"):
        preprocess([str(src)], tmp_path / "out")
    assert read_meta(tmp_path / "out").splits


def test_overwrite_replaces_only_a_directory_preprocessing_wrote(tmp_path):
    """`--output data --overwrite` (meant: data/new) deleted the whole data/ directory, every other dataset in it."""
    src = write_docs(tmp_path / "src", ["abc " * 50, "def " * 50])
    parent = tmp_path / "data"
    preprocess([str(src)], parent / "old", valid_fraction=0.0)
    (parent / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"output '.*data' is not a directory written by tools/preprocess_data.py "
                                          r"\(it has no meta.json\): --overwrite replaces only those"):
        preprocess([str(src)], parent, overwrite=True)
    assert (parent / "notes.txt").read_text() == "mine" and read_meta(parent / "old").splits
    preprocess([str(src)], parent / "old", valid_fraction=0.5, overwrite=True)  # a dataset is replaced
    assert "valid" in read_meta(parent / "old").splits
    (tmp_path / "empty").mkdir()
    preprocess([str(src)], tmp_path / "empty", overwrite=True)  # so is an empty directory
    assert read_meta(tmp_path / "empty").splits


def test_a_second_preprocessing_into_the_same_output_is_refused_while_the_first_writes(tmp_path, monkeypatch):
    """Both wrote OUT.partial: the second deleted the first's files and renamed its own output into place, the first
    then died with FileNotFoundError (or, finishing first, published a directory holding the other's half-written
    shards, which the other kept appending to)."""
    import megafp8.data.preprocess as pre

    docs = [f"first corpus {i} " * 20 for i in range(3)]
    src, other = write_docs(tmp_path / "src", docs), write_docs(tmp_path / "other", ["second corpus " * 40])
    out, refusals, real_read = tmp_path / "out", [], pre.read_documents

    def read_while_another_starts(path, json_key="text"):
        if not refusals:
            refusals.append(None)
            with pytest.raises(ConfigError) as err:
                preprocess([str(other)], out, valid_fraction=0.0)
            refusals.append(str(err.value))
        yield from real_read(path, json_key)

    monkeypatch.setattr(pre, "read_documents", read_while_another_starts)
    preprocess([str(src)], out, valid_fraction=0.0)
    assert re.fullmatch(rf"output '{out}' is being written by another tools/preprocess_data.py \(pid \d+ on .*\) in "
                        rf"{out}.partial: wait for it to end, or choose another --output", refusals[1])
    stream = TokenStream(read_meta(out), "train")
    assert ByteTokenizer().decode(stream.read(0, stream.num_tokens).tolist()) == "".join(docs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out", "src"]  # no lock or partial left behind
    assert ".lock" not in [p.name for p in out.iterdir()]


def test_what_an_interrupted_preprocessing_left_is_cleared_not_published(tmp_path):
    src = write_docs(tmp_path / "src", ["abc " * 50])
    partial = tmp_path / "out.partial"
    (partial / "train").mkdir(parents=True)
    (partial / "train" / "00007.bin").write_bytes(b"\x01\x00" * 9)  # a shard of a killed run, and its lock file
    (partial / ".lock").write_text("pid 1 on gone")
    preprocess([str(src)], tmp_path / "out", valid_fraction=0.0)
    assert not partial.exists() and sorted(p.name for p in (tmp_path / "out" / "train").iterdir()) == [
        "00000.bin", "00000.idx"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n[1]\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        preprocess([str(bad)], tmp_path / "out2")
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out2.partial").exists()


def test_a_kill_while_overwrite_deletes_the_old_output_leaves_the_new_one_published(tmp_path, monkeypatch):
    """--overwrite deleted the earlier output before renaming the new one into place: a kill during that deletion
    (seconds for a large dataset) left OUT half deleted (no meta.json) and the new output unpublished. The old one is
    now renamed aside first and deleted last, and what a kill leaves aside is cleared by the next run."""
    import megafp8.data.preprocess as pre

    src, out = write_docs(tmp_path / "src", ["abc " * 50]), tmp_path / "out"
    preprocess([str(src)], out, valid_fraction=0.0)
    write_docs(tmp_path / "src2", ["xyz " * 80])
    deleting = shutil.rmtree

    def killed_while_deleting(path, *args, **kwargs):
        if not Path(path).name.startswith("out") or Path(path).name == "out.partial":
            return deleting(path, *args, **kwargs)
        (Path(path) / "meta.json").unlink()  # the earlier output, part of the way through
        raise KeyboardInterrupt

    monkeypatch.setattr(pre.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        preprocess([str(tmp_path / "src2")], out, valid_fraction=0.0, overwrite=True)
    monkeypatch.setattr(pre.shutil, "rmtree", deleting)
    stream = TokenStream(read_meta(out), "train")  # the new output, whole
    assert ByteTokenizer().decode(stream.read(0, stream.num_tokens).tolist()) == "xyz " * 80
    assert (tmp_path / "out.replaced" / "train").is_dir()  # the old one, aside
    preprocess([str(src)], out, valid_fraction=0.0, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src", "src2"]
