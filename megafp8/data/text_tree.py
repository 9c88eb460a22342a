"""Every text file under some directories as a corpus: one document per file, de-duplicated by content, split
into train and valid by file.

Each file's bytes are hashed (SHA-256); a file whose content was seen before is a duplicate and dropped. From the
content hash and the seed come two numbers in [0, 1): the split key (the file is held out when it is below
`valid_fraction`) and the order key (files are written, sampled and capped in this order). So a file's split
depends only on its content and the seed, never on which other files are there or in what order they are found,
identical files can never land on both sides, and the written order mixes the directories (validation reads the
first samples of its split, so a path-sorted order would validate on one package only).

Files that hold a NUL byte (binary), are not UTF-8, are empty (or whitespace only), are larger than
`max_file_bytes` or cannot be read are skipped and counted by reason.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from megafp8.config import ConfigError
from megafp8.data.corpus import STDLIB, stdlib_files
from megafp8.data.indexed import is_token_directory

log = logging.getLogger(__name__)

SKIP_REASONS = ("binary", "not UTF-8", "empty", "too large", "unreadable")


@dataclass(frozen=True)
class TextFile:
    path: Path
    num_bytes: int
    split_key: float  # in [0, 1): held out when below the valid fraction
    order_key: float  # in [0, 1): position in the written (and sampled) order


@dataclass
class TextTree:
    """The unique text files of each split (in order-key order) and what the scan left out."""

    train: list[TextFile]
    valid: list[TextFile]
    files_seen: int
    duplicates: int
    duplicate_bytes: int
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    capped: int = 0  # unique files left out by `max_bytes`

    def split_bytes(self, split: str) -> int:
        return sum(f.num_bytes for f in getattr(self, split))

    def summary(self) -> dict:
        """The scan's figures (stored in meta.json under `corpus`)."""
        return {"files_seen": self.files_seen, "duplicates_dropped": self.duplicates,
                "duplicate_bytes": self.duplicate_bytes, "skipped": dict(self.skipped), "capped": self.capped,
                "train_files": len(self.train), "valid_files": len(self.valid),
                "train_bytes": self.split_bytes("train"), "valid_bytes": self.split_bytes("valid")}


def normalize_extensions(extensions: list[str]) -> tuple[str, ...]:
    """`py`, `.py` and `.PY` all mean `.py`; `tar.gz` is `.tar.gz`."""
    out = tuple("." + e.lower().lstrip(".") for e in extensions if e.strip("."))
    if not out:
        raise ConfigError(f"--extensions {extensions} names no extension; give e.g. --extensions .py .md .rst .txt")
    return out


def tree_files(inputs: list[str], extensions: tuple[str, ...]) -> Iterator[Path]:
    """Files given by name, `stdlib`'s sources, and the files under each directory whose name ends with one of
    `extensions` (walked in sorted order; symlinked directories are not followed)."""
    for item in inputs:
        if item == STDLIB:
            yield from stdlib_files()
            continue
        path = Path(item)
        if path.is_file():
            yield path
        elif path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not _token_directory(Path(root) / d))
                for name in sorted(names):
                    if name.lower().endswith(extensions):
                        yield Path(root) / name
        else:
            raise ConfigError(f"input '{item}' does not exist (give directories, files, or '{STDLIB}')")


def _token_directory(path: Path) -> bool:
    """Whether `path` is a tokenized directory (an earlier --output inside an input directory), which is no text:
    its meta.json was read as a document of an --extensions .json run."""
    if not is_token_directory(path):
        return False
    log.warning("%s is a tokenized directory (tools/preprocess_data.py's output), not text: left out of the inputs",
                path)
    return True


def _keys(digest: bytes, seed: int) -> tuple[float, float]:
    """Two independent uniform numbers in [0, 1) from a file's content hash and the seed."""
    mixed = hashlib.sha256(f"megafp8-split-{seed}:".encode() + digest).digest()
    return int.from_bytes(mixed[:8], "big") / 2**64, int.from_bytes(mixed[8:16], "big") / 2**64


def _why_skipped(data: bytes) -> Optional[str]:
    if b"\x00" in data:
        return "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    return "empty" if not text.strip() else None


def scan_text_tree(inputs: list[str], extensions: list[str], valid_fraction: float, seed: int,
                   max_file_bytes: int = 0, max_bytes: int = 0) -> TextTree:
    """Find, read, check and hash every file of the inputs; split the unique ones by file.

    `max_file_bytes` > 0 skips larger files; `max_bytes` > 0 keeps the unique files, in order-key order (a seeded
    random sample of files), until that many bytes: a smaller corpus with the same mix.
    """
    if not 0 <= valid_fraction < 1:
        raise ConfigError(f"--valid-fraction must be in [0, 1), got {valid_fraction}")
    seen: set[bytes] = set()
    unique: list[TextFile] = []
    tree = TextTree([], [], files_seen=0, duplicates=0, duplicate_bytes=0)
    for path in tree_files(inputs, normalize_extensions(extensions)):
        tree.files_seen += 1
        try:
            too_large = max_file_bytes and path.stat().st_size > max_file_bytes
            data = b"" if too_large else path.read_bytes()
        except OSError:
            tree.skipped["unreadable"] += 1
            continue
        reason = "too large" if too_large else _why_skipped(data)
        if reason:
            tree.skipped[reason] += 1
            continue
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            tree.duplicates += 1
            tree.duplicate_bytes += len(data)
            continue
        seen.add(digest)
        unique.append(TextFile(path, len(data), *_keys(digest, seed)))
    if not tree.files_seen:
        raise ConfigError(f"no files ending in {' '.join(normalize_extensions(extensions))} found in {inputs}")
    unique.sort(key=lambda f: f.order_key)
    if max_bytes:
        total, kept = 0, 0
        while kept < len(unique) and total + unique[kept].num_bytes <= max_bytes:
            total, kept = total + unique[kept].num_bytes, kept + 1
        tree.capped, unique = len(unique) - kept, unique[:kept]
    tree.valid = [f for f in unique if f.split_key < valid_fraction]
    tree.train = [f for f in unique if f.split_key >= valid_fraction]
    if valid_fraction > 0 and not tree.valid and len(tree.train) > 1:
        # Few files: hold out the one with the lowest split key rather than none (moved, never copied).
        held = min(tree.train, key=lambda f: f.split_key)
        tree.valid, tree.train = [held], [f for f in tree.train if f is not held]
    return tree


def read_text(file: TextFile) -> str:
    """A scanned file's text (checked to be UTF-8 by the scan)."""
    return file.path.read_bytes().decode("utf-8")


def summary_lines(tree: TextTree, tokens: Optional[dict[str, int]] = None) -> list[str]:
    """The scan (and, after tokenizing, each split's tokens) in a few lines for people."""
    skipped = sum(tree.skipped.values())
    reasons = ", ".join(f"{n} {why}" for why, n in tree.skipped.items() if n)
    lines = [f"files seen: {tree.files_seen:,}",
             f"duplicates dropped: {tree.duplicates:,} ({tree.duplicate_bytes:,} bytes)",
             f"files skipped: {skipped:,}" + (f" ({reasons})" if reasons else "")]
    if tree.capped:
        lines.append(f"files left out by --max-bytes: {tree.capped:,}")
    for split in ("train", "valid"):
        files = getattr(tree, split)
        line = f"{split}: {len(files):,} files, {tree.split_bytes(split):,} bytes"
        if tokens is not None:
            line += f", {tokens.get(split, 0):,} tokens"
        lines.append(line)
    return lines
