#!/usr/bin/env python
"""What the GPU's clocks and power did while a benchmark ran: reads the CSV that `nvidia-smi --query-gpu=... -lms N`
sampled (the `clocks_8b` part of `benchmarks/gpu_e2e.sh`) and prints one row per run, counting only the samples
where the GPU was busy (utilization >= 90%), so compilation and warm-up do not dilute the figures.

    python benchmarks/clocks_summary.py bf16=clocks_bf16.csv fp8=clocks_fp8.csv

The question it answers (`docs/performance.md`): the FP8 GEMMs run ~15% slower inside a training step than alone;
is that the SM clock dropping under sustained load (power cap, thermal) or something else (L2, overlap)?
"""
from __future__ import annotations

import csv
import statistics
import sys

# NVML's clock event reasons (nvml.h, nvmlClocksEventReason*): the bits of `clocks_event_reasons.active`.
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
           0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clocks"}


def _number(text: str) -> float | None:
    """'1980 MHz' -> 1980.0, '512.35 W' -> 512.35; None for '[N/A]' and the like."""
    try:
        return float(text.strip().split()[0])
    except (ValueError, IndexError):
        return None


def reasons(mask: int) -> str:
    """A bitmask of clock event reasons in words ('none' for 0)."""
    named = [name for bit, name in REASONS.items() if mask & bit]
    return ", ".join(named) or "none"


def summarize(path: str) -> dict:
    """Busy samples' median and lowest SM clock, the max clock, median power and its limit, the highest temperature,
    and how often each combination of clock event reasons was active."""
    with open(path, newline="") as f:
        rows = [{key.strip(): value.strip() for key, value in row.items() if key}
                for row in csv.DictReader(f, skipinitialspace=True)]

    def column(row: dict, prefix: str) -> float | None:
        key = next((k for k in row if k.startswith(prefix)), None)
        return _number(row[key]) if key else None

    busy = [r for r in rows if (column(r, "utilization.gpu") or 0) >= 90]
    if not busy:
        return {"samples": len(rows), "busy": 0}
    clocks = [c for c in (column(r, "clocks.current.sm") or column(r, "clocks.sm") for r in busy) if c]
    power = [p for p in (column(r, "power.draw") for r in busy) if p is not None]
    events: dict[str, int] = {}
    for r in busy:
        key = next((k for k in r if k.startswith("clocks_event_reasons") or k.startswith("clocks_throttle_reasons")),
                   None)
        if key:
            text = r[key]
            name = reasons(int(text, 16)) if text.lower().startswith("0x") else text
            events[name] = events.get(name, 0) + 1
    return {"samples": len(rows), "busy": len(busy),
            "sm_median": statistics.median(clocks) if clocks else None, "sm_min": min(clocks) if clocks else None,
            "sm_max": column(busy[0], "clocks.max.sm"),
            "power_median": statistics.median(power) if power else None,
            "power_limit": column(busy[0], "power.limit"),
            "temp_max": max((column(r, "temperature.gpu") or 0) for r in busy),
            "events": events}


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def main(argv: list[str]) -> None:
    if not argv or any("=" not in a for a in argv):
        sys.exit(__doc__.split("\n\n")[1])
    print("| run | busy samples | SM clock, median / lowest (max) MHz | power, median (limit) W | hottest C | "
          "clock event reasons while busy (share of samples) |\n|---|---|---|---|---|---|")
    for arg in argv:
        label, path = arg.split("=", 1)
        s = summarize(path)
        if not s["busy"]:
            print(f"| {label} | 0 of {s['samples']} | - | - | - | - |")
            continue
        events = "; ".join(f"{name} {count / s['busy']:.0%}"
                           for name, count in sorted(s["events"].items(), key=lambda kv: -kv[1])) or "-"
        print(f"| {label} | {s['busy']} of {s['samples']} | {_fmt(s['sm_median'])} / {_fmt(s['sm_min'])} "
              f"({_fmt(s['sm_max'])}) | {_fmt(s['power_median'])} ({_fmt(s['power_limit'])}) | "
              f"{_fmt(s['temp_max'])} | {events} |")


if __name__ == "__main__":
    main(sys.argv[1:])
