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
time accordingly. A second signal gets the action it had before (by default: the process ends at once), unless it
comes within `REPEAT_WINDOW_S` of the first: that is the same stop delivered twice. SLURM signals every process of a
job step (slurmstepd's process tracking reaches torchrun's workers too), and torchrun passes the SIGTERM it received on
to its workers, so each rank gets one stop twice, milliseconds apart.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A repeat of a stop this soon after the first is the same stop delivered again (SLURM's and torchrun's copies; a
# rank's handler can run late, after a blocking collective). 30 s is what torchrun waits for its workers after passing a
# signal on, before it kills them itself, so a sender that will not wait loses nothing by it.
REPEAT_WINDOW_S = 30.0


class StopRequest:
    """Turns SIGTERM and SIGUSR1 into a request to stop at the next agreed point, for as long as it is installed.

    Signal handlers belong to the main thread: elsewhere `install` installs nothing and says why."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.received: Optional[str] = None  # the first signal's name, once one arrived
        self._received_at = 0.0  # `clock()` when it arrived
        self._clock = clock
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
            self._received_at = self._clock()
            return
        if self._clock() - self._received_at < REPEAT_WINDOW_S:
            return  # the first stop again, from another sender (module docstring)
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
