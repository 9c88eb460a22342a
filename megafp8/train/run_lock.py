"""One writer per run directory: rank 0 holds a lock on the run and the checkpoint directory for the run's life.

The lock (`megafp8.checkpoint.lock.RunLock`: a POSIX record lock on `<directory>/.lock` naming its holder, dropped by
the kernel when the process ends) lives in the checkpoint layer, where the conversions that publish into a run's
checkpoint directory take it too. A second run aimed at a locked directory is refused on every rank in one line,
before it writes anything. Until the run is validated, the lock is taken only where its file exists already, and
nothing is written (a start that fails leaves the directories as they were); then the directories are created,
locked and the holder named.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

from megafp8.checkpoint.local import remove_leftovers
from megafp8.checkpoint.lock import RunLock
from megafp8.config import ConfigError
from megafp8.parallel import ParallelDims
from megafp8.train.resume import from_rank0

log = logging.getLogger("megafp8")


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
