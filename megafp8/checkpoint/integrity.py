"""Checksums of checkpoint files: computed while each file is written, verified before it is loaded.

Every byte a checkpoint writes passes through a `HashingStream`, which feeds it to an xxHash3-64 digest
(`xxh3_64`, 8-9 GiB/s on one core of the 2-core CPU machine, against 1.5 GiB/s for zlib's CRC32; measured in
docs/checkpoints.md). Once every file of a checkpoint is complete, its writer adds the manifest:

    checksums.json  {"format": "megafp8-checksums-v1", "algorithm": "xxh3_64",
                     "files": {"meta.pt": {"size": 1234, "xxh3_64": "9f3c..."}, ...},
                     "digest": "<xxh3_64 of the JSON of the three fields above>"}

The manifest's own digest makes a damaged manifest detectable too. Two checks read it:
`quick_problem` (the manifest is intact and every file it lists exists at its recorded size: cheap,
for listing checkpoints) and `verify_files` (every listed file re-read and hashed: before loading).
Both return a one-line reason naming the file, or None; `file_problems` yields every such reason (the verify tool).
"""
from __future__ import annotations

import io
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from megafp8.config import ConfigError

MANIFEST_FILE = "checksums.json"
MANIFEST_FORMAT = "megafp8-checksums-v1"
ALGORITHM = "xxh3_64"
_READ_CHUNK = 16 * 2**20  # bytes read at a time when verifying


@dataclass(frozen=True)
class FileRecord:
    """What a checkpoint file should hold: its size in bytes and the hex xxh3_64 digest of its bytes."""

    size: int
    digest: str


class HashingStream(io.RawIOBase):
    """A binary file opened for writing whose every written byte also goes into an xxh3_64 digest."""

    def __init__(self, raw: io.BufferedIOBase) -> None:
        super().__init__()
        self.raw = raw
        self.hash = xxhash.xxh3_64()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self.hash.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()  # flushes
        finally:
            self.raw.close()

    def record(self) -> FileRecord:
        return FileRecord(self.size, self.hash.hexdigest())


@contextmanager
def hashed_file(path: Path, records: dict[str, FileRecord]) -> Iterator[HashingStream]:
    """Open `path` for writing; once the block ends without error the file is flushed, fsynced and closed, and
    `records[path.name]` holds its size and digest."""
    with open(path, "wb") as raw:
        stream = HashingStream(raw)
        yield stream
        stream.flush()
        os.fsync(raw.fileno())
        records[path.name] = stream.record()


class HashingFileSystem(FileSystem):
    """torch.distributed.checkpoint's file system with every file written through a `HashingStream`: the records
    (by file name, after DCP's renames) are this rank's files of the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, FileRecord] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as raw:
            stream = HashingStream(raw)
            yield stream
            stream.close()  # DCP may have closed it already, after its fsync
            self.records[Path(path).name] = stream.record()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        record = self.records.pop(Path(path).name, None)
        if record is not None:
            self.records[Path(new_path).name] = record


def _manifest_digest(body: dict[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def write_manifest(directory: Path, records: dict[str, FileRecord]) -> None:
    """Write (and fsync) `checksums.json`, the last file of a complete checkpoint."""
    body = {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM,
            "files": {name: {"size": r.size, ALGORITHM: r.digest} for name, r in sorted(records.items())}}
    with hashed_file(directory / MANIFEST_FILE, {}) as f:
        f.write(json.dumps({**body, "digest": _manifest_digest(body)}, indent=1).encode())


def read_manifest(directory: Path) -> Optional[dict[str, FileRecord]]:
    """The recorded files of a checkpoint, or None if it has no manifest (written before checksums existed, or
    never completed). A manifest that is damaged or cannot be read raises ConfigError naming it."""
    path = directory / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_bytes())
        body = {k: manifest[k] for k in ("format", "algorithm", "files")}
        intact = manifest["digest"] == _manifest_digest(body) and body["format"] == MANIFEST_FORMAT
        files = {name: FileRecord(int(v["size"]), str(v[ALGORITHM])) for name, v in body["files"].items()}
    except FileNotFoundError:
        return None
    except OSError as err:  # present but unreadable (an I/O error, permissions): this checkpoint cannot be trusted
        raise ConfigError(f"checkpoint file {path} cannot be read ({err.strerror or err})") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        intact = False
    if not intact:
        raise ConfigError(f"checkpoint file {path} is corrupt (its content does not match its own digest)")
    return files


def _size_problem(path: Path, record: FileRecord) -> Optional[str]:
    """Why `path` is not there at its recorded size (None if it is)."""
    if not path.is_file():
        return f"checkpoint file {path} is missing"
    size = path.stat().st_size
    if size != record.size:
        return f"checkpoint file {path} has {size} bytes, {record.size} were written: it is truncated or damaged"
    return None


def _digest_problem(path: Path, record: FileRecord) -> Optional[str]:
    """Why `path`'s bytes are not the ones recorded (None if they are): the file is read whole."""
    try:
        found = file_digest(path)
    except OSError as err:
        # A verdict, not an exception: under `megafp8.train.resume` each rank reads its share of the files, and
        # a rank that raised here alone would leave its peers waiting in the gather of the verdicts.
        return f"checkpoint file {path} cannot be read ({err.strerror or err})"
    if found != record.digest:
        return (f"checkpoint file {path} fails its checksum ({ALGORITHM} {found}, {record.digest} was written): "
                "it is corrupt")
    return None


def quick_problem(directory: Path, files: dict[str, FileRecord]) -> Optional[str]:
    """Why the files a manifest lists are not all there at their recorded sizes (None if they are)."""
    return next((p for name, r in sorted(files.items()) if (p := _size_problem(directory / name, r))), None)


def file_problems(directory: Path, files: dict[str, FileRecord]) -> Iterator[str]:
    """Every way `files` (names in `directory`) differ from their records, one line each, as they are found: first
    each file missing or of another size (cheap), then each checksum mismatch among the rest (every one read).
    Lazy, so that a caller that needs only the first problem stops reading there."""
    whole = {}
    for name, record in sorted(files.items()):
        problem = _size_problem(directory / name, record)
        if problem:
            yield problem
        else:
            whole[name] = record
    for name, record in whole.items():
        problem = _digest_problem(directory / name, record)
        if problem:
            yield problem


def file_digest(path: Path) -> str:
    """The hex xxh3_64 digest of a file's bytes."""
    digest, buffer = xxhash.xxh3_64(), bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def verify_files(directory: Path, files: dict[str, FileRecord]) -> Optional[str]:
    """Re-read and hash each of `files` (names in `directory`): the first problem as one line, or None."""
    return next(file_problems(directory, files), None)


def share_of(files: dict[str, FileRecord], rank: int, world_size: int) -> dict[str, FileRecord]:
    """The files rank `rank` of `world_size` verifies: every world_size-th by name (each file once overall)."""
    return {name: files[name] for name in sorted(files)[rank::world_size]}
