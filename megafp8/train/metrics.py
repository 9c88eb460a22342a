"""The metrics records of a run: step time, throughput and MFU, the console line, and the JSON-lines file.

A training record covers a logging window: the steps since the last one. Its time is measured once the window's
loss has reached the host, so on a GPU it is the device's time, and evaluation and checkpoints are left out.
"""
from __future__ import annotations

import json
import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megafp8.parallel import ParallelDims

# Dense BF16 tensor-core peak per GPU (TFLOP/s, no sparsity), matched against the device name as a whole word (the
# first that matches: the variants of a name come before it). As a substring, "L4" matched the L40's name and "H100"
# the H100 NVL's, and their MFU was taken against another card's peak.
_PEAK_BF16_TFLOPS = (
    ("H200", 989.4), ("GH200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H800", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("A10G", 125.0),
    ("L4", 121.0),
)


def peak_tflops(device: torch.device, override: Optional[float]) -> Optional[float]:
    """Peak dense BF16 TFLOP/s of one device: the configured value, a known GPU's, or None."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(device_name: str) -> Optional[float]:
    """The dense BF16 peak of the GPU `device_name` names (e.g. "NVIDIA H100 80GB HBM3"), or None for one unknown."""
    return next((tf for key, tf in _PEAK_BF16_TFLOPS
                 if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name)), None)


@dataclass(frozen=True)
class Throughput:
    """What turns a step's time into tokens/s, TFLOP/s per device and MFU."""

    tokens_per_step: int
    flops_per_token: float
    world_size: int
    peak_tflops: Optional[float]  # per device; None: MFU unknown

    def rates(self, step_s: float) -> dict[str, Any]:
        tokens_per_s = self.tokens_per_step / step_s
        achieved_tflops = tokens_per_s * self.flops_per_token / self.world_size / 1e12
        return {"tokens_per_s": tokens_per_s, "tflops_per_device": achieved_tflops,
                "mfu": achieved_tflops / self.peak_tflops if self.peak_tflops else None}


@dataclass(frozen=True)
class WindowTime:
    """A logging window's time: seconds per step, and seconds since the loop began and (extrapolated) left."""

    step_s: float
    elapsed_s: float
    remaining_s: float


class StepClock:
    """Times logging windows from the loop's first step to `total_steps`, leaving out the `paused` time."""

    def __init__(self, first_step: int, total_steps: int) -> None:
        self.first_step, self.total_steps = first_step, total_steps
        self.started = self.window_start = time.perf_counter()
        self.paused_s = 0.0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time that is not training time (evaluation, checkpoints)."""
        pause_start = time.perf_counter()
        yield
        self.paused_s += time.perf_counter() - pause_start

    def lap(self, step: int, window_steps: int) -> WindowTime:
        """End the window of `window_steps` steps that ends at `step`, and start the next."""
        now = time.perf_counter()
        window_s, elapsed_s = now - self.window_start - self.paused_s, now - self.started
        self.window_start, self.paused_s = now, 0.0
        steps_done = step - self.first_step
        return WindowTime(window_s / window_steps, elapsed_s, elapsed_s / steps_done * (self.total_steps - step))


class LogWindow:
    """The steps since the last metrics record, added up on the device as they run (no host sync until the record):
    the loss terms of the steps whose update was applied (a skipped step's loss, inf or nan under overflow, is not
    the model's), how many were, the last step's grad norm, and the learning rate of the last applied update (kept
    from window to window: `lr`, that of the last update before the window, is where none is applied)."""

    def __init__(self, terms: int, device: torch.device, lr: float) -> None:
        self.steps = 0
        self._loss_sums = torch.zeros(terms, device=device)
        self._applied = torch.zeros((), dtype=torch.int64, device=device)
        self._grad_norm = torch.full((), math.nan, device=device)
        self._lr = torch.tensor(lr, dtype=torch.float64, device=device)

    def add(self, losses: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """A step's mean loss terms (`terms`,), its global grad norm (not finite: the step was skipped) and the
        learning rate its update ran at (where applied)."""
        applied = torch.isfinite(grad_norm)
        self._loss_sums += torch.where(applied, losses, 0.0)
        self._applied += applied
        self._grad_norm = grad_norm
        self._lr = torch.where(applied, lr, self._lr)
        self.steps += 1

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean loss terms over the applied steps, nan where none was; steps skipped; the last grad norm; the last
        applied update's learning rate), on the device; the window starts again."""
        taken = (self._loss_sums / self._applied, self.steps - self._applied, self._grad_norm, self._lr)
        self._loss_sums, self._applied = torch.zeros_like(self._loss_sums), torch.zeros_like(self._applied)
        self.steps = 0
        return taken


def device_peak_bytes(device: torch.device) -> Optional[int]:
    """The allocator's high-water mark on `device` since the start (a host-side counter, no sync); None off CUDA."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def peak_memory(device: torch.device, dims: ParallelDims) -> dict[str, Any]:
    """The busiest rank's peak memory (`peak_memory_gib`) and that rank (`peak_memory_rank`): under pipeline or
    expert parallelism rank 0 is seldom the one. One all-gather of a number per rank (collective: call it on every
    rank, at logging steps only); nulls off CUDA."""
    local = device_peak_bytes(device)
    if local is None:
        return {"peak_memory_gib": None, "peak_memory_rank": None}
    mine = every = torch.tensor([local], dtype=torch.int64, device=device)
    if dims.is_distributed:
        every = mine.new_empty(dims.world_size)
        dist.all_gather_into_tensor(every, mine)
    peaks = every.tolist()
    rank = peaks.index(max(peaks))  # the first of equal ones
    return {"peak_memory_gib": peaks[rank] / 2**30, "peak_memory_rank": rank}


def train_record(step: int, losses: dict[str, float], lr: float, grad_norm: float, skipped: int,
                 window: WindowTime, throughput: Throughput, memory: dict[str, Any],
                 consumed_tokens: int) -> dict[str, Any]:
    """The record of a logging window ending at `step`, with `losses` (`loss`, and its parts `lm_loss`, ...: their
    means over the window's applied steps, nan if none was; `skipped` were not), the last step's `lr` and
    `grad_norm`, the tokens the run's steps read up to it (`consumed_tokens`, counted: steps of another global
    batch or data.seq_len before a new stage read others) and the busiest rank's peak `memory` (`peak_memory`)."""
    return {
        "kind": "train",
        "step": step,
        **losses,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_time_s": window.step_s,
        **throughput.rates(window.step_s),
        "skipped_steps": skipped,
        "consumed_tokens": consumed_tokens,
        "elapsed_s": window.elapsed_s,
        "remaining_s": window.remaining_s,
        **memory,
    }


def eval_record(step: int, loss: float) -> dict[str, Any]:
    """The record of an evaluation at `step` with held-out loss `loss`."""
    return {"kind": "eval", "step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def format_step_line(record: dict[str, Any], total_steps: int) -> str:
    """The console line of a training record."""
    mfu = record.get("mfu")
    parts = [
        f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"grad norm {record['grad_norm']:.3f}",
        f"{record['tokens_per_s'] / 1e3:.1f}k tok/s",
        f"mfu {mfu * 100:.1f}%" if mfu is not None else "mfu n/a",
        f"elapsed {_duration(record['elapsed_s'])}",
        f"left {_duration(record['remaining_s'])}",
    ]
    if "mtp_loss" in record:  # the training loss is lm_loss + model.mtp_loss_weight x mtp_loss
        parts[1] += f" (lm {record['lm_loss']:.4f}, mtp {record['mtp_loss']:.4f})"
    if record.get("skipped_steps"):  # non-finite gradients: the loss is that of the other steps
        parts.insert(2, f"{record['skipped_steps']} step(s) skipped")
    if "moe_load_cv" in record:  # expert balance: spread of tokens per expert, the busiest, the share without any
        idle = f" idle {100 * record['moe_idle_experts']:.0f}%" if record.get("moe_idle_experts") else ""
        parts.insert(4, f"expert load cv {record['moe_load_cv']:.2f} max {record['moe_load_max_over_mean']:.2f}x{idle}")
    return " | ".join(parts)


def format_eval_line(record: dict[str, Any]) -> str:
    """The console line of an evaluation record."""
    return f"step {record['step']} | validation loss {record['val_loss']:.4f} | perplexity {record['val_ppl']:.2f}"


class MetricsFile:
    """Appends one JSON object per line; a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path if enabled else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_finite_or_null(record), allow_nan=False) + "\n")


def _finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float, nested ones included (an FP8-health record's per-tensor statistics),
    replaced by None: the file stays strict JSON (NaN and Infinity are Python's extensions, which other readers
    refuse), and readers see "no value" rather than a nan that poisons every mean or sort over it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value
