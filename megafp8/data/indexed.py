"""On-disk token format: a directory with `meta.json` and, per split, shards of raw tokens.

    DIR/meta.json          format, tokenizer spec, vocab size, eos id, bos id (or null), dtype, and per split the
                           shard list (each shard with its token count, document count and largest token id)
    DIR/SPLIT/NNNNN.bin    the tokens of whole documents, each followed by the end-of-document token (and begun by
                           the beginning-of-document token where meta.json names one)
    DIR/SPLIT/NNNNN.idx    int64 end offsets of the documents in that shard (the index)

Shards are memory-mapped for reading; a split reads as one token stream across its shards. Opening a shard
checks its size and that its largest token id is below the tokenizer's vocabulary size (recorded at
preprocessing; data written before that is scanned once), so no id outside the vocabulary ever reaches
the embedding. A split's fingerprint (its tokenizer, and per shard the counts and a checksum of a few token
windows) tells a resumed run whether its data is the data its checkpoint was trained on.
"""
from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from megafp8.config import ConfigError

FORMAT = "megafp8-tokens-v1"
META_FILE = "meta.json"
MAX_VOCAB_SIZE = 2**32  # token ids are stored as uint16 or uint32
# A shard's checksum reads 16 evenly spaced windows of 64 tokens: a few pages a shard, cheap for terabytes of
# data, and other documents or another tokenization change them (all but) surely.
CHECKSUM_WINDOWS, CHECKSUM_WINDOW_TOKENS = 16, 64

log = logging.getLogger("megafp8")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


class ShardWriter:
    """Appends tokenized documents to the shards of one split, starting a new shard every `shard_tokens`."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        (root / split).mkdir(parents=True, exist_ok=True)
        self.shards: list[dict[str, Any]] = []
        self._file = None
        self._ends: list[int] = []
        self._tokens = 0
        self._max_id = -1

    def add(self, tokens: np.ndarray) -> None:
        """One document's tokens, end-of-document token included."""
        if self._file is None:
            name = f"{self.split}/{len(self.shards):05d}.bin"
            self._file = open(self.root / name, "wb")
            self.shards.append({"file": name, "num_tokens": 0, "num_docs": 0})
        self._file.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._max_id = max(self._max_id, int(tokens.max()))
        self._tokens += len(tokens)
        self._ends.append(self._tokens)
        if self._tokens >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        shard = self.shards[-1]
        shard["num_tokens"], shard["num_docs"], shard["max_token_id"] = self._tokens, len(self._ends), self._max_id
        np.asarray(self._ends, dtype=np.int64).tofile(self.root / shard["file"].replace(".bin", ".idx"))
        self._ends, self._tokens, self._max_id = [], 0, -1

    def close(self) -> list[dict[str, Any]]:
        self._close_shard()
        return self.shards


def write_meta(root: Path, tokenizer_spec: str, vocab_size: int, eos_id: int, splits: dict[str, list], source: str,
               corpus: dict[str, Any] | None = None, bos_id: int | None = None) -> None:
    """`corpus`: how the documents were found (a text tree's scan figures), kept for the record only. `bos_id`: the
    token every document begins with (None: documents begin with their text)."""
    meta = {
        "format": FORMAT,
        "tokenizer": tokenizer_spec,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "bos_id": bos_id,
        "dtype": token_dtype(vocab_size).name,
        "source": source,
        "splits": splits,
        **({"corpus": corpus} if corpus is not None else {}),
    }
    tmp = root / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(root / META_FILE)  # meta.json appears only once every shard is written


def is_token_directory(path: Path) -> bool:
    """Whether `path` holds a meta.json of this token format (a directory tools/preprocess_data.py wrote)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and str(meta.get("format", "")).startswith("megafp8-tokens")


@dataclass
class DatasetMeta:
    root: Path
    tokenizer: str
    vocab_size: int
    eos_id: int
    dtype: np.dtype
    splits: dict[str, list[dict[str, Any]]]
    bos_id: int | None = None  # the token every document begins with (None: none, or data written before it)


def read_meta(path: str | Path) -> DatasetMeta:
    root = Path(path)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        what = "does not exist" if not root.exists() else f"has no {META_FILE}"
        if not root.is_absolute():  # a run launched from another directory than the data's
            what += f" (relative to the working directory, {Path.cwd()})"
        raise ConfigError(
            f"data.path '{root}' {what}. Create it with: python tools/preprocess_data.py --input <files or 'stdlib'> "
            f"--output {root} (or point data.path at a directory written by that tool)"
        )
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict):
            raise TypeError(f"a JSON {type(meta).__name__}, not an object")
        if meta.get("format") != FORMAT:
            raise ConfigError(f"{meta_path}: format '{meta.get('format')}' is not {FORMAT}; "
                              "re-run tools/preprocess_data.py")
        vocab_size = int(meta["vocab_size"])
        bos_id = meta.get("bos_id")
        parsed = DatasetMeta(root, meta["tokenizer"], vocab_size, int(meta["eos_id"]), np.dtype(meta["dtype"]),
                             _checked_splits(meta["splits"]), None if bos_id is None else int(bos_id))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{meta_path} is corrupt ({err!r}); re-run tools/preprocess_data.py") from None
    if not 0 < vocab_size <= MAX_VOCAB_SIZE:
        raise ConfigError(f"{meta_path}: vocab_size {vocab_size} is not between 1 and 2^32; re-run "
                          "tools/preprocess_data.py")
    if parsed.dtype not in TOKEN_DTYPES or np.iinfo(parsed.dtype).max < vocab_size - 1:
        # Read as another type, the shards' bytes would become other ids (signed, or float) and pass every size check.
        raise ConfigError(f"{meta_path}: dtype '{parsed.dtype.name}' cannot hold token ids of a {vocab_size}-id "
                          f"vocabulary (tools/preprocess_data.py writes {token_dtype(vocab_size).name}); the file was "
                          "edited or written by another tool: re-run tools/preprocess_data.py")
    return parsed


TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32))


def _checked_splits(splits: Any) -> dict[str, list[dict[str, Any]]]:
    """meta.json's splits, each a list of shard entries with a file name and a token count (TypeError/ValueError
    saying which is not, for read_meta's one "is corrupt" error)."""
    if not isinstance(splits, dict):
        raise TypeError(f"'splits' is a JSON {type(splits).__name__}, not an object of split names")
    for name, shards in splits.items():
        if not isinstance(shards, list):
            raise TypeError(f"split '{name}' is a JSON {type(shards).__name__}, not a list of shards")
        for i, shard in enumerate(shards):
            if not isinstance(shard, dict) or not isinstance(shard.get("file"), str):
                raise TypeError(f"shard {i} of split '{name}' is not an object with a 'file' name")
            count, largest = shard.get("num_tokens"), shard.get("max_token_id", 0)  # older data has no largest id
            if not _is_int(count) or count < 0:
                raise ValueError(f"shard {i} of split '{name}': 'num_tokens' is {count!r}, not a count")
            if not _is_int(largest):
                raise ValueError(f"shard {i} of split '{name}': 'max_token_id' is {largest!r}, not a token id")
    return splits


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _largest_id(path: Path, shard: dict[str, Any], tokens: np.ndarray) -> int:
    """The shard's largest token id as preprocessing recorded it; data written before that is scanned."""
    if "max_token_id" in shard:
        return int(shard["max_token_id"])
    log.warning("token shard %s records no largest token id (written by an older tools/preprocess_data.py): "
                "scanning its %d tokens", path, len(tokens))
    return int(tokens.max())


def _check_ids(path: Path, largest: int, meta: DatasetMeta) -> None:
    if largest >= meta.vocab_size:
        raise ConfigError(
            f"token shard {path} holds token id {largest}, but its tokenizer ({meta.tokenizer}) has {meta.vocab_size} "
            f"ids (vocab_size in {meta.root / META_FILE}): the data does not match its tokenizer; re-run "
            "tools/preprocess_data.py with the right --tokenizer")


def shard_checksum(tokens: np.ndarray) -> int:
    """CRC32 of the bytes of `CHECKSUM_WINDOWS` evenly spaced windows of `CHECKSUM_WINDOW_TOKENS` tokens (the whole
    shard when it is shorter than one window)."""
    length = min(CHECKSUM_WINDOW_TOKENS, len(tokens))
    starts = np.linspace(0, len(tokens) - length, CHECKSUM_WINDOWS).astype(np.int64) if len(tokens) else []
    crc = 0
    for start in starts:
        crc = zlib.crc32(np.ascontiguousarray(tokens[start : start + length]).tobytes(), crc)
    return crc


class TokenStream:
    """The tokens of one split as a single read-only sequence over memory-mapped shards."""

    def __init__(self, meta: DatasetMeta, split: str) -> None:
        if split not in meta.splits:
            raise ConfigError(
                f"split '{split}' is not in {meta.root / META_FILE} (it has: {', '.join(meta.splits) or 'none'}); "
                "set data.train_split / data.valid_split, or re-run preprocessing with --valid-fraction > 0"
            )
        self.meta, self.split = meta, split
        self._all_shards = [self._open(meta, shard) for shard in meta.splits[split]]
        self.shards = [s for s in self._all_shards if len(s)]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.num_tokens = int(self.starts[-1])

    @cached_property
    def fingerprint(self) -> dict[str, Any]:
        """What identifies this split's data, cheaply: the tokenizer and, per shard, [tokens, documents, checksum]
        (`shard_checksum`). Data preprocessed again from other documents or with another tokenizer differs in it
        even where the number of samples is the same."""
        entries = self.meta.splits[self.split]
        return {"tokenizer": self.meta.tokenizer, "vocab_size": self.meta.vocab_size, "eos_id": self.meta.eos_id,
                "bos_id": self.meta.bos_id,
                "shards": [[int(entry["num_tokens"]), int(entry.get("num_docs", -1)), shard_checksum(tokens)]
                           for entry, tokens in zip(entries, self._all_shards)]}

    def tokenizer_difference(self, saved: dict[str, Any]) -> str | None:
        """How this split's tokenizer differs from the one of a saved `fingerprint` where it surely does (another
        vocabulary size), else None. A tokenizer's spec is a path (or `byte`), and the same tokens may come from a
        tokenizer.json moved: the shards' checksums tell data of other tokens apart (`fingerprint_difference`)."""
        if saved.get("vocab_size") is None or saved["vocab_size"] == self.meta.vocab_size:
            return None
        return (f"the checkpoint's data was tokenized by {saved.get('tokenizer')} (vocab {saved['vocab_size']}), "
                f"{self.meta.root} by {self.meta.tokenizer} (vocab {self.meta.vocab_size})")

    def fingerprint_difference(self, saved: dict[str, Any]) -> str | None:
        """The first way in which this split differs from a saved `fingerprint`, or None where it does not."""
        own = self.fingerprint
        # The tokenizer's spec (a path) is recorded, not compared: the same tokenizer.json at another path gives the
        # same tokens, and another tokenizer changes the checksums (another vocabulary size: `tokenizer_difference`).
        saved_shards = [list(shard) for shard in saved.get("shards", [])]
        if len(saved_shards) != len(own["shards"]):
            return f"it had {len(saved_shards)} shards, this data has {len(own['shards'])}"
        for entry, was, now in zip(self.meta.splits[self.split], saved_shards, own["shards"]):
            for what, a, b in zip(("token count", "document count", "token checksum"), was, now):
                unrecorded = what == "document count" and -1 in (a, b)  # data written before meta.json counted them
                if a != b and not unrecorded:
                    return f"shard {self.meta.root / entry['file']}'s {what} was {a}, is {b}"
        return None

    @staticmethod
    def _open(meta: DatasetMeta, shard: dict[str, Any]) -> np.ndarray:
        path = meta.root / shard["file"]
        expected = int(shard["num_tokens"]) * meta.dtype.itemsize
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            found = "is missing" if size is None else f"has {size} bytes"
            raise ConfigError(
                f"token shard {path} {found}, but meta.json says {shard['num_tokens']} {meta.dtype.name} tokens "
                f"({expected} bytes): the data is incomplete or corrupt; re-run tools/preprocess_data.py"
            )
        if expected == 0:
            return np.empty(0, dtype=meta.dtype)
        tokens = np.memmap(path, dtype=meta.dtype, mode="r")
        _check_ids(path, _largest_id(path, shard, tokens), meta)
        return tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, reading across shard edges."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"token range [{start}, {start + length}) outside stream of {self.num_tokens}")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self.starts[shard])
            take = min(length - filled, len(self.shards[shard]) - offset)
            out[filled : filled + take] = self.shards[shard][offset : offset + take]
            filled += take
            shard += 1
        if length and int(out.max()) >= self.meta.vocab_size:
            self._refuse_bad_id(start, out)
        return out

    def _refuse_bad_id(self, start: int, tokens: np.ndarray) -> None:
        """Stop on a token id the vocabulary does not hold, read where preprocessing recorded none that large (the
        shard's bytes changed since: a flipped bit, a partial copy). Read on, an id below the padded vocabulary
        trains a padding row, silently; one past it indexes past the embedding (a device-side assert on a GPU) or,
        under TP, falls outside every rank's rows of the vocab-parallel embedding and loss: a zero embedding and a
        wrong loss, silently."""
        where = start + int(np.argmax(tokens >= self.meta.vocab_size))
        shard = int(np.searchsorted(self.starts, where, side="right")) - 1
        kept = [entry for entry, tokens in zip(self.meta.splits[self.split], self._all_shards) if len(tokens)]
        path, position = self.meta.root / kept[shard]["file"], where - int(self.starts[shard])
        raise ConfigError(
            f"token shard {path} holds token id {int(tokens[where - start])} at token {position}, "
            f"but its tokenizer has {self.meta.vocab_size} ids and preprocessing recorded none that large: the shard "
            "changed since it was written (corrupt or partly copied); copy it again or re-run "
            "tools/preprocess_data.py")
