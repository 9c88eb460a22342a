"""Tokenize documents into the on-disk token format (`megafp8.data.indexed`), with a held-out split.

Two input modes. Files and JSONL records (the default): each document (a file, or a JSONL line) goes to the
validation split with probability `valid_fraction`, decided by a seeded generator in document order, so the
same inputs and seed give the same splits (and `train_tokenizer` can leave the held-out documents out); or, with
`valid_inputs` (a held-out file of one's own), those files' documents are the validation split and every document
of `inputs` is trained on. A text
tree (`extensions` given): every file under the input directories whose name ends with one of `extensions` is one
document, duplicates dropped, and whole files are held out by a seeded hash of their content
(`megafp8.data.text_tree`). Every shard records its largest token id, which must be below the tokenizer's
vocabulary size. The output directory appears only when complete (written under a temporary name, locked against
a second run into the same output, then renamed).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import IO, Iterable, Iterator, TypeVar

import numpy as np

from megafp8.config import ConfigError
from megafp8.data.corpus import input_files, read_documents
from megafp8.data.indexed import META_FILE, ShardWriter, is_token_directory, token_dtype, write_meta
from megafp8.data.text_tree import TextTree, read_text
from megafp8.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)
LOCK_FILE = ".lock"  # in OUT.partial while a run writes it
REPLACED_SUFFIX = ".replaced"  # OUT.replaced: an earlier output, renamed aside until the new one is in place
Document = TypeVar("Document")  # a document's text, or its tokens


def _encode_all(tokenizer: Tokenizer, docs: Iterable[str], batch: int = 256) -> Iterator[np.ndarray]:
    """Token arrays (the beginning-of-document token first where the tokenizer has one, the end-of-document token
    appended), in document order."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    if isinstance(tokenizer, ByteTokenizer):
        for doc in docs:
            yield np.concatenate([np.frombuffer(tokenizer.encode_bytes(doc), dtype=np.uint8).astype(dtype), eos])
        return
    bos = np.array([] if tokenizer.bos_id is None else [tokenizer.bos_id], dtype=dtype)

    def framed(texts: list[str]) -> Iterator[np.ndarray]:
        return (np.concatenate([bos, np.asarray(ids, dtype=dtype), eos]) for ids in tokenizer.encode_batch(texts))

    pending: list[str] = []
    for doc in docs:
        pending.append(doc)
        if len(pending) == batch:
            yield from framed(pending)
            pending = []
    if pending:
        yield from framed(pending)


def preprocess(
    inputs: list[str],
    output: str | Path,
    tokenizer_spec: str = "byte",
    valid_fraction: float = 0.01,
    seed: int = 1234,
    shard_tokens: int = 100_000_000,
    json_key: str = "text",
    eos_token: str | None = None,
    overwrite: bool = False,
    tree: TextTree | None = None,
    valid_inputs: list[str] | None = None,
    bos_token: str | None = None,
) -> dict[str, list]:
    """Write `output/` and return its split table. See `tools/preprocess_data.py` for the command line.

    With `tree` (from `scan_text_tree(inputs, ...)`), its files are the documents, split by file as the scan
    decided (`valid_fraction` and `seed` are then the scan's); its figures go into meta.json under `corpus`.
    With `valid_inputs` (files or directories, as `inputs`), their documents make the validation split and those of
    `inputs` all go to training (`valid_fraction` must then be 0: nothing else is held out). With `bos_token`,
    every document begins with that token (a tokenizer.json's)."""
    if not 0 <= valid_fraction < 1:
        raise ConfigError(f"--valid-fraction must be in [0, 1), got {valid_fraction}")
    out = Path(output)
    if out.name in ("", ".."):  # '.', '', '/', 'x/..': no name to write OUT.partial beside and rename (a ValueError)
        raise ConfigError(f"--output '{output}' names no directory of its own: give the directory to write, e.g. "
                          "--output data/mycorpus")
    _check_replaceable(out, overwrite)
    tokenizer = load_tokenizer(tokenizer_spec, eos_token, bos_token)
    _note_template(tokenizer)
    files = input_files(inputs) if tree is None else []
    valid_files = _valid_files(valid_inputs, files, valid_fraction, tree) if valid_inputs else []
    started = time.time()
    tmp = out.with_name(out.name + ".partial")
    lock = _claim(tmp, out)
    try:
        splits, num_docs, num_tokens = _write_splits(tmp, tokenizer, files, valid_fraction, seed, shard_tokens,
                                                     json_key, tree, valid_files)
        if "train" not in splits:
            raise ConfigError(f"no training documents in {inputs} (all inputs empty, or --valid-fraction too high)")
        if valid_files and "valid" not in splits:
            raise ConfigError(f"no documents in --valid-input {' '.join(valid_inputs or [])} (empty files, or JSONL "
                              f"records whose '{json_key}' is empty): give it the held-out documents")
        largest = max(shard["max_token_id"] for shards in splits.values() for shard in shards)
        if largest >= tokenizer.vocab_size:
            raise ConfigError(f"tokenizer {tokenizer.spec} produced token id {largest} but reports a vocabulary of "
                              f"{tokenizer.vocab_size}: use a tokenizer whose ids fit its vocabulary size")
        source = " ".join(inputs) + (f" (valid: {' '.join(valid_inputs or [])})" if valid_files else "")
        write_meta(tmp, tokenizer.spec, tokenizer.vocab_size, tokenizer.eos_id, splits, source=source,
                   corpus=tree.summary() if tree is not None else None, bos_id=tokenizer.bos_id)
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: the lock says no one else writes there
        raise
    finally:
        lock.close()  # drops the lock
    log.info("%d documents, %d tokens -> %s in %.1fs", num_docs, num_tokens, out, time.time() - started)
    return splits


def _note_template(tokenizer: Tokenizer) -> None:
    """Say where a tokenizer.json's template begins texts with a token that the data's documents will not begin with
    (no --bos-token): a model trained so (Llama's, DeepSeek's), continued on this data, sees its documents start
    otherwise than it was trained."""
    if not isinstance(tokenizer, HFTokenizer) or tokenizer.bos_id is not None:
        return
    bos = tokenizer.template_bos()
    if bos is not None:
        log.warning("tokenizer %s begins each text with %s (its template), which these documents will not begin "
                    "with: to continue a model trained so (Llama, DeepSeek) add --bos-token %s", tokenizer.spec,
                    " ".join(tokenizer.template_prefix()), bos)


def _valid_files(valid_inputs: list[str], files: list[Path], valid_fraction: float, tree: TextTree | None
                 ) -> list[Path]:
    """The files of `valid_inputs`, refused where they cannot be a held-out split of their own: in the text-tree
    mode, beside a `valid_fraction` that would hold out more, or where a file is also among the training inputs."""
    if tree is not None:
        raise ConfigError("--valid-input belongs to the default mode: drop --extensions, or hold files out with "
                          "--valid-fraction")
    if valid_fraction != 0:
        raise ConfigError(f"--valid-input is the held-out split, so --valid-fraction {valid_fraction:g} would hold "
                          "out training documents as well: drop --valid-fraction (or set it to 0)")
    valid_files = input_files(valid_inputs)
    training = {path.resolve() for path in files}
    for path in valid_files:
        if path.resolve() in training:
            raise ConfigError(f"{path} is in both --input and --valid-input: validation would read training data; "
                              "move it out of the training inputs")
    return valid_files


def _write_splits(tmp: Path, tokenizer: Tokenizer, files: list[Path], valid_fraction: float, seed: int,
                  shard_tokens: int, json_key: str, tree: TextTree | None, valid_files: list[Path]
                  ) -> tuple[dict[str, list], int, int]:
    """Tokenize every document into the shards of `tmp`; returns the split table, documents and tokens."""
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "valid")}
    counts = [0, 0, 0]  # documents, tokens, documents holding the end-of-document token's text

    def count(tokens: np.ndarray) -> np.ndarray:
        counts[0], counts[1] = counts[0] + 1, counts[1] + len(tokens)
        counts[2] += bool((tokens[:-1] == tokenizer.eos_id).any())
        return tokens

    def counted() -> Iterator[tuple[str, np.ndarray]]:
        for split, tokens in _split_documents(tokenizer, files, valid_fraction, seed, json_key, tree):
            yield split, count(tokens)

    for split, tokens in place_last_document(counted(), valid_fraction):
        writers[split].add(tokens)
    valid_docs = (doc for path in valid_files for doc in read_documents(path, json_key))
    for tokens in _encode_all(tokenizer, valid_docs):
        writers["valid"].add(count(tokens))
    if counts[2]:
        eos = getattr(tokenizer, "eos_token", tokenizer.eos_id)
        log.warning("%d of %d documents hold the text %r, which the tokenizer reads as its end-of-document token: "
                    "training sees each of them as several documents (remove that text from the corpus, or give "
                    "--eos-token another token)", counts[2], counts[0], eos)
    return {s: w.close() for s, w in writers.items() if w.shards}, counts[0], counts[1]


def _claim(tmp: Path, out: Path) -> IO[str]:
    """Lock the temporary output directory `tmp` (created if need be) and empty it of what an interrupted run left.
    Two preprocessings into one output would otherwise write the same files: the second deleted the first's, and
    either could publish a directory of the other's half-written shards. The lock (`flock`: per open file, so even
    within one process) is dropped by the kernel however the process ends: an interrupted run leaves no stale one."""
    tmp.mkdir(parents=True, exist_ok=True)
    lock = open(tmp / LOCK_FILE, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        if err.errno in (errno.EACCES, errno.EAGAIN):
            raise ConfigError(f"output '{out}' is being written by another tools/preprocess_data.py ({holder}) in "
                              f"{tmp}: wait for it to end, or choose another --output") from None
        raise ConfigError(f"cannot lock {tmp / LOCK_FILE} ({err.strerror}): write --output on a file system with "
                          "file locks") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
    lock.flush()
    for leftover in tmp.iterdir():
        if leftover.name != LOCK_FILE:
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    return lock


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the complete `tmp` to `out` (replacing an earlier output only with `overwrite`), lock file left out.
    An earlier output is renamed aside first and deleted only once the new one is in place: deleted first, a kill
    during its (long) deletion left `out` half gone and the new output unpublished."""
    replaced = out.with_name(out.name + REPLACED_SUFFIX)
    if replaced.exists():  # what a run killed right after renaming aside left (this run holds the lock)
        shutil.rmtree(replaced)
    if out.exists() or out.is_symlink():
        if not overwrite:  # it appeared while this run wrote
            raise ConfigError(f"output '{out}' appeared while this run wrote it (another tools/preprocess_data.py?): "
                              "pass --overwrite to replace it, or choose another --output")
        out.rename(replaced)
    tmp.rename(out)
    (out / LOCK_FILE).unlink()  # still held: a run that opened it meanwhile is refused, then finds no .partial
    if replaced.exists():
        shutil.rmtree(replaced)


def _check_replaceable(out: Path, overwrite: bool) -> None:
    """Refuse an existing `out` unless `overwrite`, and even then unless it is an earlier output of this tool (or an
    empty directory): `--output data --overwrite`, meant as data/new, would delete every dataset under data/."""
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise ConfigError(f"output '{out}' already exists; pass --overwrite to replace it, or choose another --output")
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    if out.is_dir() and not out.is_symlink() and is_token_directory(out):
        foreign = next(_files_not_written_here(out), None)
        if foreign is None:
            return
        raise ConfigError(f"output '{out}' holds {foreign}, which tools/preprocess_data.py did not write: --overwrite "
                          "would delete it with the old data; move it out of the directory, or choose another "
                          "--output")
    why = "a symbolic link" if out.is_symlink() else f"it has no {META_FILE}"
    raise ConfigError(f"output '{out}' is not a directory written by tools/preprocess_data.py ({why}): --overwrite "
                      "replaces only those; choose another --output (a new directory)")


_SHARD_NAME = re.compile(r"\d+\.(bin|idx)")


def _files_not_written_here(out: Path) -> Iterator[Path]:
    """What an earlier output holds beyond this tool's files (meta.json, and the splits' shards): a tokenizer.json
    kept beside its data (the one `--tokenizer` names, even), notes. --overwrite deleted them with the directory."""
    for entry in sorted(out.iterdir()):
        if entry.name in (META_FILE, META_FILE + ".tmp", LOCK_FILE):
            continue
        if entry.name not in ("train", "valid") or not entry.is_dir() or entry.is_symlink():
            yield entry
            continue
        yield from (shard for shard in sorted(entry.iterdir())
                    if not (_SHARD_NAME.fullmatch(shard.name) and shard.is_file() and not shard.is_symlink()))


def place_last_document(labelled: Iterable[tuple[str, Document]], valid_fraction: float
                        ) -> Iterator[tuple[str, Document]]:
    """The (split, document) pairs as drawn, but for the last training document: where the draw held out no
    document, it is moved to the held-out split instead (as the text-tree mode moves a file), or, being the only
    document, also copied there, with a warning that validation then reads training data. The training documents
    come one behind (the last is known only at the end); `train_tokenizer` applies the same rule."""
    held: list[Document] = []  # the latest training document, not yet given
    num_docs, some_valid, some_train = 0, False, False
    for split, doc in labelled:
        num_docs += 1
        if split == "valid":
            some_valid = True
            yield split, doc
            continue
        if held:
            some_train = True
            yield "train", held.pop()
        held.append(doc)
    if not held:
        return
    last = held.pop()
    if valid_fraction == 0 or some_valid:
        yield "train", last
    elif some_train:
        log.info("--valid-fraction %g drew none of the %d documents: the last one is held out instead",
                 valid_fraction, num_docs)
        yield "valid", last
    else:
        log.warning("one document only: the held-out split is a copy of it, so validation loss is measured "
                    "on training data (give more documents for a real held-out split)")
        yield "train", last
        yield "valid", last


def split_by_draw(docs: Iterable[Document], valid_fraction: float, seed: int) -> Iterator[tuple[str, Document]]:
    """The default mode's split, before `place_last_document`: each document to `valid` with probability
    `valid_fraction`, by a draw of a generator seeded with `seed`, in document order."""
    rng = np.random.default_rng(seed)
    for doc in docs:
        yield ("valid" if rng.random() < valid_fraction else "train"), doc


def _split_documents(tokenizer: Tokenizer, files: list[Path], valid_fraction: float, seed: int, json_key: str,
                     tree: TextTree | None) -> Iterator[tuple[str, np.ndarray]]:
    """(split, tokens) of every document: a text tree's files split by file, else each document by a seeded draw."""
    if tree is not None:
        for split in ("train", "valid"):
            for tokens in _encode_all(tokenizer, map(read_text, getattr(tree, split))):
                yield split, tokens
        return
    docs = (doc for path in files for doc in read_documents(path, json_key))
    yield from split_by_draw(_encode_all(tokenizer, docs), valid_fraction, seed)


def training_documents(inputs: list[str], json_key: str = "text", valid_fraction: float = 0.01,
                       seed: int = 1234) -> Iterator[str]:
    """The texts of the documents that `preprocess` (default mode) writes to the training split with the same
    inputs, `json_key`, `valid_fraction` and `seed`, in order: its held-out documents are left out."""
    docs = (doc for path in input_files(inputs) for doc in read_documents(path, json_key))
    return (doc for split, doc in place_last_document(split_by_draw(docs, valid_fraction, seed), valid_fraction)
            if split == "train")


def train_tokenizer(inputs: list[str], output: str | Path, vocab_size: int, json_key: str = "text",
                    tree: TextTree | None = None, sample_bytes: int = 0, overwrite: bool = False,
                    valid_fraction: float = 0.01, seed: int = 1234) -> tuple[int, int]:
    """Train a byte-level BPE `tokenizer.json` on local files with Hugging Face `tokenizers`; returns the
    (documents, bytes) it was trained on. An existing `output` is replaced only with `overwrite` (data tokenized
    with it names it in its meta.json).

    The documents are those `preprocess` puts in the training split (its held-out documents stay unseen): with
    `tree` (from `scan_text_tree`), the tree's train split's files, in its seeded order; otherwise the documents
    of `inputs` that the seeded draw of `valid_fraction` and `seed` keeps (`training_documents`).
    `sample_bytes` > 0 stops after the document that reaches that many bytes (with a tree a seeded random
    sample of files, otherwise the first training documents)."""
    try:
        from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError("training a tokenizer needs `tokenizers`: pip install 'megafp8[hf]'") from None
    if vocab_size < 257:
        raise ConfigError(f"--vocab-size must be at least 257 (256 bytes + end-of-text), got {vocab_size}")
    if not 0 <= valid_fraction < 1:
        raise ConfigError(f"--valid-fraction must be in [0, 1), got {valid_fraction}")
    if Path(output).is_dir():  # checked before training: saving over it failed after all the work
        raise ConfigError(f"output '{output}' is a directory: give the tokenizer.json file to write, e.g. "
                          f"--output {Path(output) / 'tokenizer.json'}")
    if not Path(output).parent.is_dir():
        raise ConfigError(f"output '{output}': the directory {Path(output).parent} does not exist: create it first")
    if Path(output).exists() and not overwrite:
        raise ConfigError(f"output '{output}' already exists (data tokenized with it would no longer match it): pass "
                          "--overwrite to replace it, or choose another --output")
    docs: Iterable[str] = (map(read_text, tree.train) if tree is not None
                           else training_documents(inputs, json_key, valid_fraction, seed))
    used = [0, 0]  # documents, UTF-8 bytes

    def sample() -> Iterator[str]:
        for doc in docs:
            used[0], used[1] = used[0] + 1, used[1] + len(doc.encode("utf-8"))
            yield doc
            if sample_bytes and used[1] >= sample_bytes:
                return

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(f"{output}.partial")  # renamed once whole: a kill while saving leaves an earlier file as it was
    with open(partial, "ab"):  # an unwritable output fails here (OSError), not after the training in the Rust save
        pass
    try:
        tok.train_from_iterator(sample(), trainer=trainer)
        if not used[0]:  # the trainer made a tokenizer of the 256 bytes alone, without a word
            raise ConfigError(f"no training documents in {' '.join(inputs)} (all inputs empty, or --valid-fraction too "
                              "high): give the tokenizer documents to train on")
        tok.save(str(partial))
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)
    return used[0], used[1]
