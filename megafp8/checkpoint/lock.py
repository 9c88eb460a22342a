"""One writer per directory of checkpoints: an exclusive lock that a training run holds for its life, and that a
conversion publishing into a run's checkpoint directory holds while it writes.

The lock is a POSIX record lock (`fcntl.lockf`) on `<directory>/.lock`, which names its holder. The kernel drops it
when the process ends, however it ends, so a killed run never leaves a stale lock; on NFS the lock manager (NLM)
extends it across nodes. Locks belong to a process: several trainers of one process (tests) share them, and closing
any of the process's files of a lock drops its lock. It lives here, in the checkpoint layer, so that the conversions
(`megafp8.checkpoint.convert`) take it themselves, whoever calls them; `megafp8.train.run_lock` takes it for a run.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional

from megafp8.config import ConfigError

LOCK_FILE = ".lock"
_TAKEN = (errno.EACCES, errno.EAGAIN)
RUN_ADVICE = "wait for it to end, or give this run another run_name, logging.output_dir or checkpoint.dir"
CONVERSION_ADVICE = ("wait for it to end, or convert into another --out (a checkpoint directory of its own; the run "
                     "can resume it by path, checkpoint.resume=PATH)")


class RunLock:
    """Exclusive locks on directories, held until `release` (or the end of the process). `create=False` locks only
    the directories that already hold a lock file, and writes nothing (a start that fails later leaves no trace);
    `note_holder` then names this process in every lock file."""

    def __init__(self, directories: list[Path], create: bool = True, advice: str = RUN_ADVICE) -> None:
        self._files: dict[Path, IO[str]] = {}
        self._advice = advice  # what a refusal tells the user to do where another process holds a directory
        try:
            self.add(directories, create)
        except BaseException:
            self.release()
            raise
        if create:
            self.note_holder()

    def add(self, directories: list[Path], create: bool = True) -> None:
        """Lock `directories` not locked yet (with `create=False`, only those whose lock file exists)."""
        for directory in directories:
            if directory not in self._files:
                f = _lock(directory, create, self._advice)
                if f is not None:
                    self._files[directory] = f

    def note_holder(self) -> None:
        """Write this process's id, host and start time into every lock file (shown to a run that is refused)."""
        for f in self._files.values():
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {datetime.datetime.now():%Y-%m-%d %H:%M:%S}\n")
            f.flush()

    def release(self) -> None:
        for f in self._files.values():
            f.close()  # closing the file drops the lock
        self._files = {}


def _lock(directory: Path, create: bool, advice: str) -> Optional[IO[str]]:
    path = directory / LOCK_FILE
    if not create and not path.is_file():
        return None
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+" if create else "r+")
    except OSError as err:
        raise ConfigError(f"cannot write in {directory} ({err.strerror}): point logging.output_dir (or checkpoint.dir) "
                          "at a directory this run may write") from None
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        if err.errno in _TAKEN:
            raise ConfigError(f"{directory} is in use by another run ({holder}): {advice}") from None
        raise ConfigError(f"cannot lock {path} ({err.strerror}): put the run on a file system with POSIX locks "
                          "(local, or NFS with its lock manager)") from None
    return f


@contextmanager
def lock_for_conversion(out: Path) -> Iterator[Optional[RunLock]]:
    """Held while a conversion publishes into `out`: where `out` is a run's checkpoint directory (its lock file is
    there), that run's lock, naming this process. A run training there holds it, so the conversion is refused in one
    line (its saves, pruning and `latest` would race the conversion's); a run launched meanwhile is refused in turn.
    None where `out` holds no lock file (a directory of the conversion's own)."""
    if not (out / LOCK_FILE).is_file():
        yield None
        return
    lock = RunLock([out], create=False, advice=CONVERSION_ADVICE)
    try:
        lock.note_holder()
        yield lock
    finally:
        lock.release()
