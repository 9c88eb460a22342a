"""Throughput and MFU, the console line, and the JSON-lines metrics file (rank 0 only)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch

# Dense BF16 tensor-core peak per GPU (TFLOP/s, no sparsity), matched against the device name.
_PEAK_BF16_TFLOPS = (
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("GH200", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("A10G", 125.0), ("L4", 121.0),
)


def peak_tflops(device: torch.device, override: Optional[float]) -> Optional[float]:
    """Peak dense BF16 TFLOP/s of one device: the configured value, a known GPU's, or None."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in _PEAK_BF16_TFLOPS if key in name), None)


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def format_step_line(record: dict[str, Any], total_steps: int) -> str:
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
    if record.get("skipped_steps"):  # non-finite gradients: the loss is that of the other steps
        parts.insert(2, f"{record['skipped_steps']} step(s) skipped")
    if "moe_load_cv" in record:  # expert balance: spread of tokens per expert, and the busiest expert
        parts.insert(4, f"expert load cv {record['moe_load_cv']:.2f} max {record['moe_load_max_over_mean']:.2f}x")
    return " | ".join(parts)


class MetricsFile:
    """Appends one JSON object per line; a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path if enabled else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
