"""Traces and allocator snapshots of chosen training steps: where a run's time and memory go, without editing code.

`logging.profile_steps: [first, last]` runs `torch.profiler` (host activity, and CUDA's where the run is on a GPU)
around those optimizer steps and writes each rank's trace (`rank<r>.trace.json.gz`, for ui.perfetto.dev or
chrome://tracing) and its operators and kernels by their own time (`rank<r>.top.txt`) into
`<run dir>/profiles/steps_<first>-<last>/`. `logging.memory_snapshot_steps: N` records the CUDA caching allocator's
history (each allocation and free with its Python stack) over the launch's first N steps and writes it to
`<run dir>/profiles/memory_rank<r>.pickle` after them, or at once if the device runs out of memory within them
(pytorch.org/memory_viz reads it). Megatron-LM's `--profile` and `--record-memory-history`, torchtitan's
`profiling` section are the same tools.

The trainer calls `before_step` and `after_step` around each step and `close` when its loop ends however it ends;
nothing runs unless asked. The exports happen outside the timed part of the step (the trainer pauses its clock).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("megafp8")

PROFILES_DIR = "profiles"
# Allocator events the history keeps (the oldest are dropped beyond it): enough for a few steps of a large model.
HISTORY_ENTRIES = 1_000_000
TOP_ROWS = 40  # rows of the own-time table


class StepProfiler:
    """The tracer and the allocator history of one rank, started and stopped around the steps the config names."""

    def __init__(self, profile_steps: Sequence[int], memory_snapshot_steps: int, run_dir: Path, rank: int,
                 device: torch.device, first_step: int) -> None:
        """`first_step`: the step this launch starts after (0, or the resumed checkpoint's)."""
        self.trace_steps = (profile_steps[0], profile_steps[1]) if profile_steps else None
        self.directory = Path(run_dir) / PROFILES_DIR
        self.rank, self.device = rank, device
        self.tracer: Optional[profile] = None
        self.step_range: Optional[torch.profiler.record_function] = None  # the traced step, named in the trace
        self.traced_from = 0
        self.memory_until: Optional[int] = None  # the step after which the allocator history is written
        if self.trace_steps is not None and first_step >= self.trace_steps[1] and rank == 0:
            log.info("logging.profile_steps=%s: this launch starts after step %d, so nothing is traced",
                     list(self.trace_steps), first_step)
        if memory_snapshot_steps > 0:
            if device.type != "cuda":
                if rank == 0:
                    log.warning("logging.memory_snapshot_steps: the run is on %s, whose allocator keeps no history: "
                                "no snapshot is written", device.type)
            else:
                torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
                self.memory_until = first_step + memory_snapshot_steps

    def before_step(self, step: int) -> None:
        """Called before step `step` (numbered as the step lines are, from 1) runs."""
        if self.tracer is None and self.trace_steps is not None and self.trace_steps[0] <= step <= self.trace_steps[1]:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.tracer = profile(activities=activities)
            self.tracer.start()
            self.traced_from = step
        if self.tracer is not None:
            self.step_range = torch.profiler.record_function(f"megafp8 step {step}")
            self.step_range.__enter__()

    def after_step(self, step: int) -> None:
        """Called after step `step` has run (outside the timed part of the step: the exports take a while)."""
        self._end_step_range()
        if self.tracer is not None and step >= self.trace_steps[1]:
            self._export_trace(step)
        if self.memory_until is not None and step >= self.memory_until:
            self._write_memory_history(f"memory_rank{self.rank}.pickle", announce=self.rank == 0)

    def on_out_of_memory(self) -> None:
        """The device ran out of memory: the history recorded so far is written, for the snapshot of that moment."""
        if self.memory_until is not None:  # said by every rank that writes one: it may be one rank of many
            self._write_memory_history(f"memory_rank{self.rank}_out_of_memory.pickle", announce=True)

    def close(self, last_step: int) -> None:
        """The loop ended (done, stopped on a signal, or failed): a trace still running is stopped and written for
        the steps it covered, up to `last_step`; the allocator history is switched off."""
        if self.tracer is not None:
            self._export_trace(last_step)
        if self.memory_until is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory_until = None

    def _end_step_range(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def _export_trace(self, last: int) -> None:
        self._end_step_range()  # (closing after a failed step)
        tracer, self.tracer = self.tracer, None
        tracer.stop()
        if last < self.traced_from:  # stopped before a traced step finished
            return
        where = self.directory / f"steps_{self.traced_from}-{last}"
        by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        try:  # a trace that cannot be written is said, and the run goes on
            where.mkdir(parents=True, exist_ok=True)
            tracer.export_chrome_trace(str(where / f"rank{self.rank}.trace.json.gz"))
            (where / f"rank{self.rank}.top.txt").write_text(tracer.key_averages().table(sort_by=by,
                                                                                        row_limit=TOP_ROWS))
        except OSError as err:
            log.warning("the profile of steps %d-%d could not be written to %s: %s", self.traced_from, last, where,
                        err)
            return
        if self.rank == 0:
            log.info("profile of steps %d-%d written to %s (a trace per rank: ui.perfetto.dev opens it; "
                     "rank<r>.top.txt: operators and kernels by their own time)", self.traced_from, last, where)

    def _write_memory_history(self, name: str, announce: bool) -> None:
        path = self.directory / name
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except OSError as err:
            log.warning("the CUDA allocator history could not be written to %s: %s", path, err)
            return
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory_until = None
        if announce:
            log.info("CUDA allocator history written to %s (pytorch.org/memory_viz opens it)", path)
