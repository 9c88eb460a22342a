"""Stopping on a scheduler's signal without losing the work since the last checkpoint.

A scheduler about to stop a job sends a signal first: SLURM sends SIGTERM, then SIGKILL after `KillWait`; with
`--signal=USR1@120` it sends SIGUSR1 120 s before the time limit; `timeout` and Kubernetes send SIGTERM. Left to
its default action the signal kills the process mid-step and everything since the last checkpoint is lost.

With `checkpoint.save_on_signal` (and checkpoints on: `checkpoint.interval` > 0), the training loop instead records
the signal (`StopRequest`) and carries on to its next logging step, where every rank already waits for the device.
There the ranks agree whether any of them was signalled (`stop_agreed`: one all-reduce; ranks may receive the signal
at different times, and all must stop at the same step), then save a checkpoint of that step and leave the loop; the
launcher then exits with 128 + the signal's number, as a process the signal had ended would (a wrapper or
Kubernetes sees an interrupted run, not a finished one). A relaunch resumes from the checkpoint. The wait is at
most `logging.log_interval` steps, an evaluation falling on the stop step, and the save: choose the signal's lead
time accordingly. A second signal gets the action it had before (by default: the process ends at once).
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
            return
        # A second signal: whoever sends it will not wait. It gets the action it had before (by default, the end).
        self.restore()
        signal.raise_signal(signum)

    def restore(self) -> None:
        """Put back the handlers that were there before `install` (those set outside Python, which `signal` cannot
        name, become the default action)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def exit_status(received: Optional[str]) -> int:
    """The exit status of a run stopped on `received` (a signal's name; None: another rank's signal, SIGTERM's)."""
    return 128 + int(getattr(signal, received or "SIGTERM"))


def stop_agreed(requested: bool, device: torch.device) -> bool:
    """Whether any rank asked to stop (a MAX all-reduce over every rank; a single process answers for itself)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return requested
    flag = torch.tensor([int(requested)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
