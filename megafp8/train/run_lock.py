"""One writer per run directory: rank 0 holds a lock on the run (and checkpoint) directory for the run's life.

The lock is a POSIX record lock (`fcntl.lockf`) on `<directory>/.lock`, which names its holder. The kernel
drops it when the process ends, however it ends, so a killed run never leaves a stale lock; on NFS the lock
manager (NLM) extends it across nodes. A second run aimed at a locked directory is refused on every rank in
one line, before it writes anything. Locks belong to a process: several trainers of one process (tests) share
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
from typing import IO, Optional

import torch.distributed as dist

from megafp8.checkpoint.local import remove_leftovers
from megafp8.config import ConfigError
from megafp8.parallel import ParallelDims

log = logging.getLogger("megafp8")
LOCK_FILE = ".lock"
_TAKEN = (errno.EACCES, errno.EAGAIN)


class RunLock:
    """Exclusive locks on directories, held until `release` (or the end of the process)."""

    def __init__(self, directories: list[Path]) -> None:
        self._files: list[IO[str]] = []
        try:
            for directory in directories:
                self._files.append(_lock(directory))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for f in self._files:
            f.close()  # closing the file drops the lock
        self._files = []


def _lock(directory: Path) -> IO[str]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    f = open(path, "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        if err.errno in _TAKEN:
            raise ConfigError(f"{directory} is in use by another run ({holder}): wait for it to end, or give this run "
                              "another run_name, logging.output_dir or checkpoint.dir") from None
        raise ConfigError(f"cannot lock {path} ({err.strerror}): put the run on a file system with POSIX locks "
                          "(local, or NFS with its lock manager)") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {datetime.datetime.now():%Y-%m-%d %H:%M:%S}\n")
    f.flush()
    return f


def claim_run_directories(run_dir: Path, checkpoint_dir: Path, dims: ParallelDims) -> Optional[RunLock]:
    """Rank 0 locks the run directory (and the checkpoint directory, if outside it) and removes what interrupted
    saves left in the latter; every rank raises the same ConfigError if another run holds one (collective).
    Returns rank 0's lock (None elsewhere)."""
    lock, error = None, None
    if dims.rank == 0:
        directories = [run_dir] + ([] if checkpoint_dir.resolve().is_relative_to(run_dir.resolve())
                                   else [checkpoint_dir])
        try:
            lock = RunLock(directories)
        except ConfigError as err:
            error = str(err)
    if dims.is_distributed:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error is not None:
        raise ConfigError(error)
    if lock is not None:
        removed = remove_leftovers(checkpoint_dir)
        if removed:
            log.warning("removed what interrupted checkpoint saves left in %s: %s", checkpoint_dir, ", ".join(removed))
    return lock
