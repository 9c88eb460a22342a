"""One writer per run directory: rank 0 holds a lock on the run and the checkpoint directory for the run's life.

The lock is a POSIX record lock (`fcntl.lockf`) on `<directory>/.lock`, which names its holder. The kernel
drops it when the process ends, however it ends, so a killed run never leaves a stale lock; on NFS the lock
manager (NLM) extends it across nodes. A second run aimed at a locked directory is refused on every rank in
one line, before it writes anything. Until the run is validated, the lock is taken only where its file exists
already, and nothing is written (a start that fails leaves the directories as they were); then the directories
are created, locked and the holder named. Locks belong to a process: several trainers of one process (tests) share
them.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import IO, Callable, Optional

from megafp8.checkpoint.local import remove_leftovers
from megafp8.config import ConfigError
from megafp8.parallel import ParallelDims
from megafp8.train.resume import from_rank0

log = logging.getLogger("megafp8")
LOCK_FILE = ".lock"
_TAKEN = (errno.EACCES, errno.EAGAIN)
RUN_ADVICE = "wait for it to end, or give this run another run_name, logging.output_dir or checkpoint.dir"


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


def lock_for_conversion(out: Path) -> Optional[RunLock]:
    """A conversion publishing into `out`: where `out` is a run's checkpoint directory (its lock file is there),
    its lock, held while converting. A run training there holds it, so the conversion is refused (its saves and
    pruning would race the conversion's rename and its `latest`), and a run launched meanwhile is refused in turn.
    None where `out` holds no lock file (a directory of the conversion's own)."""
    if not (out / LOCK_FILE).is_file():
        return None
    lock = RunLock([out], create=False, advice="wait for it to end, or convert into another --out (a checkpoint "
                   "directory of its own; the run can resume it by path, checkpoint.resume=PATH)")
    lock.note_holder()
    return lock


def _directories(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """Both directories, each with a lock of its own, even where the checkpoints sit inside the run directory: a
    second run pointed at this run's `checkpoints` (its own run directory elsewhere) finds their lock taken. With
    the run directory's lock alone, it took them over and removed this run's save in flight as a leftover."""
    same = checkpoint_dir.resolve() == run_dir.resolve()
    return [run_dir] + ([] if same else [checkpoint_dir])


def _on_rank0(what: str, act: Callable[[], None], dims: ParallelDims) -> None:
    """`act()` on rank 0 only (collective). A ConfigError or an OSError it raised there (a full disk, a directory
    it may not stat) is the same ConfigError on every rank (`from_rank0`): rank 0 failing alone would leave its
    peers waiting in the broadcast, or in the next collective."""
    def act_or_explain() -> None:
        try:
            act()
        except OSError as err:
            raise ConfigError(f"rank 0 could not {what} ({err}): point logging.output_dir (or checkpoint.dir) at a "
                              "directory this run may write") from None
    from_rank0(act_or_explain, dims)


def claim_run_directories(run_dir: Path, checkpoint_dir: Path, dims: ParallelDims) -> Optional[RunLock]:
    """Before anything is validated: rank 0 locks the run directory and the checkpoint directory
    where a lock file exists already, writing nothing; every rank raises the same ConfigError if another run holds
    one, or if rank 0 cannot look (collective). Returns rank 0's lock (None elsewhere); `open_run_directories`
    completes it."""
    claimed: list[RunLock] = []  # filled on rank 0 (a lock holds open files: it is not sent to the other ranks)
    _on_rank0("check the locks of its run directories",
              lambda: claimed.append(RunLock(_directories(run_dir, checkpoint_dir), create=False)), dims)
    return claimed[0] if claimed else None


def open_run_directories(lock: Optional[RunLock], run_dir: Path, checkpoint_dir: Path, dims: ParallelDims) -> None:
    """Once the run is validated: rank 0 creates and locks the directories `claim_run_directories` could not lock
    yet, names itself in the lock files and removes what interrupted saves left in the checkpoint directory
    (collective; every rank raises the same ConfigError if another run took a directory meanwhile, or if rank 0
    cannot write there)."""
    def prepare() -> None:
        if lock is None:
            return
        lock.add(_directories(run_dir, checkpoint_dir))
        lock.note_holder()
        removed = remove_leftovers(checkpoint_dir)
        if removed:
            log.warning("removed what interrupted checkpoint saves left in %s: %s", checkpoint_dir, ", ".join(removed))
    _on_rank0("create, lock and prepare its run directories", prepare, dims)
