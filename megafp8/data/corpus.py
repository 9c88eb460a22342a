"""Input documents for preprocessing: text files, JSONL files, and the built-in demo corpus.

The demo corpus is the Python standard library's own `.py` sources (about 30 MB of real text
on any machine with Python; nothing to download).
"""
from __future__ import annotations

import json
import logging
import re
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator, NamedTuple

from megafp8.config import ConfigError
from megafp8.data.indexed import META_FILE, is_token_directory

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
            files.extend(_without_token_directories(sorted(
                p for p in path.rglob("*") if p.suffix.lower() in (".txt", ".jsonl", ".json") and p.is_file())))
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


def _without_token_directories(found: list[Path]) -> list[Path]:
    """`found` less the meta.json of every tokenized directory among them (an earlier --output written inside the
    input directory): read as JSON lines, it failed every later run over that directory, blamed on its format."""
    kept = []
    for path in found:
        if path.name == META_FILE and is_token_directory(path.parent):
            log.warning("%s is a tokenized directory (tools/preprocess_data.py's output), not text: left out of the "
                        "inputs", path.parent)
        else:
            kept.append(path)
    return kept


def _nothing_to_read(inputs: list[str]) -> str:
    """Why directories gave no documents, and the option that reads the files they do hold."""
    found = Counter(p.suffix.lower() for item in inputs for p in Path(item).rglob("*") if p.is_file() and p.suffix)
    where = " ".join(inputs)
    if not found:
        return f"no input files found in {where}"
    kinds = ", ".join(f"{n} {suffix}" for suffix, n in found.most_common(4))
    suffix = found.most_common(1)[0][0]
    packed = next((kind for kind in _PACKED.values() if kind.suffix == suffix), None)
    if packed is not None:  # --extensions would read them as text: each skipped, as binary or not UTF-8
        return (f"no .txt, .jsonl or .json files in {where} (it holds {kinds} files): {packed.kind} files are not "
                f"read: {packed.fix} them first ({packed.command.format('*' + suffix)}), then give the "
                ".txt/.jsonl files")
    return (f"no .txt, .jsonl or .json files in {where} (it holds {kinds} files): to read other text files, add "
            f"--extensions with their endings, e.g. --extensions {suffix} (each file one document)")


class Packed(NamedTuple):
    """A compressed or columnar file format, which neither mode reads, and how to make text of it."""

    suffix: str
    article: str
    kind: str
    fix: str
    command: str  # an example, `{}` for the file


# Named as inputs, such files read as text that is not UTF-8, whose advice (iconv, --extensions) fits none of them.
_PACKED = {b"\x1f\x8b": Packed(".gz", "a", "gzip-compressed", "decompress", "gunzip -k {}"),
           b"\x28\xb5\x2f\xfd": Packed(".zst", "a", "zstd-compressed", "decompress", "zstd -d {}"),
           b"BZh": Packed(".bz2", "a", "bzip2-compressed", "decompress", "bunzip2 -k {}"),
           b"\xfd7zXZ\x00": Packed(".xz", "an", "xz-compressed", "decompress", "unxz -k {}"),
           b"PK\x03\x04": Packed(".zip", "a", "zip", "extract", "unzip {}"),
           b"PAR1": Packed(".parquet", "a", "Parquet", "convert",
                           "e.g. pandas.read_parquet, then to_json with orient='records', lines=True: JSON lines")}


def _packed_kind(data: bytes) -> Packed | None:
    """The `_PACKED` format of a file beginning with `data`, or None for another file."""
    return next((kind for magic, kind in _PACKED.items() if data.startswith(magic)), None)


def read_documents(path: Path, json_key: str = "text") -> Iterator[str]:
    """One document per JSONL line (its `json_key` field) or one per other file. Text must be UTF-8: a file that is
    not is refused (ConfigError naming the file, the line and the byte), never read with replacement characters,
    except the standard library's few sources in legacy encodings (PEP 263), which `stdlib` has always read so.
    A JSONL record whose text is empty or null is skipped, and the file's count of them logged; a line that is not
    JSON, not an object, has no such key, or whose value is another type (a number, an array, an object: a wrong
    key or schema) or not valid Unicode is refused, naming the line: a dataset loses no record unsaid."""
    if path.suffix.lower() in (".jsonl", ".json"):
        skipped = 0
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a leading byte-order mark is read
                except UnicodeDecodeError as err:
                    raise ConfigError(f"{path}:{line_no}: not UTF-8 (byte {err.start} of the line is "
                                      f"0x{raw[err.start]:02x}); JSONL must be UTF-8: convert the file") from None
                if not line.strip():
                    continue
                text = _record_text(line, json_key, f"{path}:{line_no}", path.suffix.lower() == ".json")
                if text:
                    yield text
                else:
                    skipped += 1
        if skipped:
            log.warning("%s: %d record(s) with an empty or null '%s' skipped", path, skipped, json_key)
    else:
        text = _read_text(path)
        if text:
            yield text


def _json_kind(value: object) -> str:
    """What a decoded JSON value was written as: "null", "a number", "an array", ..."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}
    return kinds.get(type(value), f"a {type(value).__name__}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _record_text(line: str, json_key: str, where: str, dot_json: bool) -> str:
    """The `json_key` string of one JSONL line, or a ConfigError at `where` that says what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        hint = (" (.json files are read as JSON lines, one object per line: write the records so, or convert an "
                "array with e.g. jq -c '.[]')") if dot_json else ""
        raise ConfigError(f"{where}: not valid JSON ({err.msg}, column {err.colno}){hint}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: {_json_kind(record)}, not a JSON object with a '{json_key}' string")
    if json_key not in record:
        keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise ConfigError(f"{where}: no '{json_key}' key (its keys: {keys}): set --json-key to the text's key")
    text = record[json_key]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise ConfigError(f"{where}: '{json_key}' is {_json_kind(text)}, not a string: fix or drop the record "
                          "(only an empty string or null is skipped)")
    bad = _SURROGATE.search(text)
    if bad:  # JSON's \ud800 escapes decode to lone surrogates, which no UTF-8 tokenizer can encode
        raise ConfigError(f"{where}: '{json_key}' is not valid Unicode text (a lone surrogate "
                          f"\\u{ord(bad.group()):04x} at character {bad.start()}): fix or drop the record")
    return text


def _read_text(path: Path) -> str:
    """The file's UTF-8 text with its line endings made "\\n" (as `Path.read_text` reads them)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        packed = _packed_kind(data)
        if packed is not None:
            raise ConfigError(f"{path} is {packed.article} {packed.kind} file, not text: {packed.fix} it first "
                              f"({packed.command.format(path)}), then give the text or JSONL file") from None
        if not _in_stdlib(path):
            line = data.count(b"\n", 0, err.start) + 1
            raise ConfigError(f"{path}: not UTF-8 text (line {line}, byte {err.start} is 0x{data[err.start]:02x}): "
                              "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), or read the inputs as a text "
                              "tree (--extensions), which skips files that are not UTF-8") from None
        text = data.decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _in_stdlib(path: Path) -> bool:
    return Path(sysconfig.get_paths()["stdlib"]).resolve() in path.resolve().parents
