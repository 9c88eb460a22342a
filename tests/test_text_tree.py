"""The text-tree input mode of preprocessing: every file with given extensions under some directories, one document
each, identical files once, whole files held out by a seeded content hash, binary and non-UTF-8 files skipped."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from megafp8.config import ConfigError
from megafp8.data import ByteTokenizer, TokenStream, read_meta
from megafp8.data.preprocess import preprocess, train_tokenizer
from megafp8.data.text_tree import scan_text_tree
from tests.conftest import REPO, torchrun_env


def make_tree(root, count=40):
    """`count` distinct .py files in nested packages, three copies of one of them, a .md and a .RST file, and
    files the scan must skip or never see."""
    for i in range(count):
        package = root / f"pkg{i % 4}" / ("sub" if i % 3 else "")
        package.mkdir(parents=True, exist_ok=True)
        (package / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}  # é\n")
    (root / "pkg0" / "copy_a.py").write_text("def f1(x):\n    return x + 1  # é\n")  # = pkg1/sub/mod1.py
    (root / "pkg3" / "copy_b.py").write_text("def f1(x):\n    return x + 1  # é\n")
    (root / "README.md").write_text("# A package\n\nSome documentation.\n")
    (root / "pkg2" / "NOTES.RST").write_text("Notes\n=====\n")
    (root / "pkg1" / "blob.py").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")  # NUL bytes: binary
    (root / "pkg1" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (root / "pkg1" / "__init__.py").write_text("\n")  # whitespace only
    (root / "pkg1" / "data.json").write_text('{"text": "not a wanted extension"}\n')
    (root / "pkg1" / "mod.pyc").write_bytes(b"compiled")
    return root


EXTENSIONS = [".py", "md", ".rst", ".txt"]


def documents(out, split):
    stream = TokenStream(read_meta(out), split)
    tokens = stream.read(0, stream.num_tokens)
    return [ByteTokenizer().decode(p.tolist()) for p in np.split(tokens, np.where(tokens == 256)[0] + 1)[:-1]]


def test_every_unique_text_file_is_one_document_once(tmp_path):
    src = make_tree(tmp_path / "src")
    tree = scan_text_tree([str(src)], EXTENSIONS, valid_fraction=0.2, seed=5)
    assert tree.files_seen == 40 + 2 + 2 + 3  # the .py, .md, .RST and .txt files; not .json or .pyc
    assert (tree.duplicates, tree.duplicate_bytes) == (2, 2 * len("def f1(x):\n    return x + 1  # é\n".encode()))
    assert tree.skipped == {"binary": 1, "not UTF-8": 1, "empty": 1, "too large": 0, "unreadable": 0}
    assert len(tree.train) + len(tree.valid) == 42
    out = tmp_path / "tok"
    splits = preprocess([str(src)], out, valid_fraction=0.2, seed=5, tree=tree)
    train, valid = documents(out, "train"), documents(out, "valid")
    expected = {p.read_text() for p in src.rglob("*") if p.suffix.lower() in (".py", ".md", ".rst")
                and p.read_bytes().strip() and b"\x00" not in p.read_bytes()}
    assert sorted(train + valid) == sorted(expected)  # each unique text exactly once, whole
    assert [f.path.read_text() for f in tree.valid] == valid  # written in the scan's order
    assert sum(s["num_docs"] for s in splits["valid"]) == len(tree.valid) > 0
    assert json.loads((out / "meta.json").read_text())["corpus"] == tree.summary()


def test_the_split_is_by_file_deterministic_and_independent_of_the_other_files(tmp_path):
    src = make_tree(tmp_path / "src", count=400)

    def held_out(seed, root=src):
        return {f.path.read_bytes() for f in scan_text_tree([str(root)], [".py"], 0.1, seed).valid}

    first = held_out(7)
    assert held_out(7) == first and held_out(8) != first
    assert 20 <= len(first) <= 65  # ~10% of 401 unique files
    # A file's side depends on its content and the seed only: removing and renaming files moves no other file.
    for path in list(src.rglob("mod1?.py")):
        path.unlink()
    next(src.rglob("mod5.py")).rename(src / "pkg3" / "renamed.py")
    remaining = {p.read_bytes() for p in src.rglob("*.py")}
    assert held_out(7) == first & remaining
    # Nor does the order of the inputs (it only picks which of two identical files is named).
    a = scan_text_tree([str(src / "pkg0"), str(src / "pkg1")], [".py"], 0.3, 1)
    b = scan_text_tree([str(src / "pkg1"), str(src / "pkg0")], [".py"], 0.3, 1)
    assert [f.path.read_bytes() for f in a.valid] == [f.path.read_bytes() for f in b.valid]


def test_size_limits_and_a_tree_without_matching_files(tmp_path):
    src = make_tree(tmp_path / "src")
    (src / "big.txt").write_text("x" * 5000)
    tree = scan_text_tree([str(src)], EXTENSIONS, 0.0, 1, max_file_bytes=4000)
    assert tree.skipped["too large"] == 1 and not tree.valid
    capped = scan_text_tree([str(src)], EXTENSIONS, 0.0, 1, max_file_bytes=4000, max_bytes=300)
    assert capped.split_bytes("train") <= 300 and capped.capped == len(tree.train) - len(capped.train) > 0
    assert [f.path for f in capped.train] == [f.path for f in tree.train[:len(capped.train)]]  # a prefix
    with pytest.raises(ConfigError, match=r"no files ending in \.rs found"):
        scan_text_tree([str(src)], ["rs"], 0.1, 1)
    few = tmp_path / "few"
    few.mkdir()
    (few / "a.py").write_text("a = 1\n")
    (few / "b.py").write_text("b = 2\n")
    tree = scan_text_tree([str(few)], [".py"], 0.01, 1)  # 1% of 2 files: one is still held out, none copied
    assert len(tree.train) == len(tree.valid) == 1


def test_directories_keep_their_default_search_without_extensions(tmp_path):
    src = make_tree(tmp_path / "src")
    latin1 = next(src.rglob("latin1.txt"))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(latin1))}: not UTF-8 text"):  # was decoded with U+FFFD
        preprocess([str(src)], tmp_path / "out", valid_fraction=0.0)
    latin1.unlink()
    splits = preprocess([str(src)], tmp_path / "out", valid_fraction=0.0)  # .txt/.jsonl/.json only, as before
    assert sum(s["num_docs"] for s in splits["train"]) == 1  # data.json
    assert "corpus" not in json.loads((tmp_path / "out" / "meta.json").read_text())


def test_command_line_dry_run_and_summary(tmp_path):
    src = make_tree(tmp_path / "src")
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(src), "--extensions", *EXTENSIONS,
           "--output", str(tmp_path / "out"), "--valid-fraction", "0.2"]
    dry = subprocess.run(cmd + ["--dry-run"], cwd=REPO, env=torchrun_env(), capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert not (tmp_path / "out").exists()
    assert "files seen: 47\nduplicates dropped: 2 (68 bytes)\nfiles skipped: 3 (1 binary, 1 not UTF-8, 1 empty)\n" \
        in dry.stdout
    full = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert full.returncode == 0, full.stderr
    meta = read_meta(tmp_path / "out")
    train_tokens = sum(s["num_tokens"] for s in meta.splits["train"])
    assert f", {train_tokens:,} tokens\n" in full.stdout and full.stdout.count("files seen: 47") == 1
    no_extensions = [sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output", str(tmp_path / "x")]
    bad = subprocess.run(no_extensions + ["--dry-run"], cwd=REPO, env=torchrun_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "add --extensions" in bad.stderr


def test_the_tokenizer_trains_on_a_sample_of_the_training_files_only(tmp_path):
    pytest.importorskip("tokenizers")
    src = make_tree(tmp_path / "src", count=200)
    tree = scan_text_tree([str(src)], EXTENSIONS, 0.1, 3)
    docs, size = train_tokenizer([str(src)], tmp_path / "all.json", 300, tree=tree)
    assert (docs, size) == (len(tree.train), tree.split_bytes("train"))
    docs, size = train_tokenizer([str(src)], tmp_path / "sample.json", 300, tree=tree, sample_bytes=1000)
    sizes = [f.num_bytes for f in tree.train]
    assert docs == next(n for n in range(1, len(sizes) + 1) if sum(sizes[:n]) >= 1000) and size == sum(sizes[:docs])
    out = tmp_path / "tok"
    preprocess([str(src)], out, tokenizer_spec=str(tmp_path / "sample.json"), valid_fraction=0.1, seed=3, tree=tree)
    assert read_meta(out).vocab_size <= 300
