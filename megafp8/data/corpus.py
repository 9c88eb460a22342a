"""Input documents for preprocessing: text files, JSONL files, and the built-in demo corpus.

The demo corpus is the Python standard library's own `.py` sources (about 30 MB of real text
on any machine with Python; nothing to download).
"""
from __future__ import annotations

import json
import logging
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator

from megafp8.config import ConfigError

STDLIB = "stdlib"
log = logging.getLogger(__name__)


def stdlib_files() -> list[Path]:
    """The standard library's `.py` files, sorted, without installed third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def input_files(inputs: list[str]) -> list[Path]:
    """Expand the inputs (files, directories searched for .txt/.jsonl/.json, or `stdlib`) into a sorted file list."""
    files: list[Path] = []
    for item in inputs:
        if item == STDLIB:
            files.extend(stdlib_files())
            continue
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*")
                                if p.suffix.lower() in (".txt", ".jsonl", ".json") and p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"input '{item}' does not exist (give text/JSONL files, directories, or '{STDLIB}')")
    if not files:
        raise ConfigError(_nothing_to_read(inputs))
    unique: dict[Path, Path] = {}
    for path in files:
        unique.setdefault(path.resolve(), path)  # a file's first mention keeps its place
    if len(unique) < len(files):
        log.warning("%d input file(s) named more than once are read once (a directory and a file in it, or "
                    "overlapping names)", len(files) - len(unique))
    return list(unique.values())


def _nothing_to_read(inputs: list[str]) -> str:
    """Why directories gave no documents, and the option that reads the files they do hold."""
    found = Counter(p.suffix.lower() for item in inputs for p in Path(item).rglob("*") if p.is_file() and p.suffix)
    where = " ".join(inputs)
    if not found:
        return f"no input files found in {where}"
    kinds = ", ".join(f"{n} {suffix}" for suffix, n in found.most_common(4))
    return (f"no .txt, .jsonl or .json files in {where} (it holds {kinds} files): to read other text files, add "
            f"--extensions with their endings, e.g. --extensions {found.most_common(1)[0][0]} (each file one document)")


def read_documents(path: Path, json_key: str = "text") -> Iterator[str]:
    """One document per JSONL line (its `json_key` field) or one per other file."""
    if path.suffix.lower() in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[json_key]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ConfigError(
                        f"{path}:{line_no}: not a JSON object with a '{json_key}' string (set --json-key)"
                    ) from None
                if isinstance(text, str) and text:
                    yield text
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text:
            yield text
