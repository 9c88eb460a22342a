"""Stopping on a scheduler's signal without losing the work since the last checkpoint.

A scheduler about to stop a job sends a signal first: SLURM sends SIGTERM, then SIGKILL after `KillWait`; with
`--signal=USR1@120` it sends SIGUSR1 120 s before the time limit; `timeout` and Kubernetes send SIGTERM. Left to
its default action the signal kills the process mid-step and everything since the last checkpoint is lost.

With `checkpoint.save_on_signal`, the training loop instead records the signal (`StopRequest`) and carries on to
its next logging step, where every rank already waits for the device. There the ranks agree whether any of them
was signalled (`stop_agreed`: one all-reduce; ranks may receive the signal at different times, and all must stop at
the same step), then save a checkpoint of that step and leave the loop. A relaunch resumes from it. The wait is at
most `logging.log_interval` steps, plus the save: choose the signal's lead time accordingly.
"""
from __future__ import annotations

import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Turns SIGTERM and SIGUSR1 into a request to stop at the next agreed point, for as long as it is installed.

    Signal handlers belong to the main thread: elsewhere `install` installs nothing and says why."""

    def __init__(self) -> None:
        self.received: Optional[str] = None  # the first signal's name, once one arrived
        self._previous: dict[int, object] = {}

    def install(self) -> Optional[str]:
        """Handle the stop signals from now on; returns why not, if they cannot be handled here."""
        if threading.current_thread() is not threading.main_thread():
            return "signal handlers can only be installed by the main thread"
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return None

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def restore(self) -> None:
        """Put back the handlers that were there before `install`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def stop_agreed(requested: bool, device: torch.device) -> bool:
    """Whether any rank asked to stop (a MAX all-reduce over every rank; a single process answers for itself)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return requested
    flag = torch.tensor([int(requested)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
