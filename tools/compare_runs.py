#!/usr/bin/env python
"""Compare runs step by step against a reference run: loss agreement and speed, as a Markdown table.

Example (TP=2 against TP=1 on the same seed):
    python tools/compare_runs.py runs/1b_tp1 runs/1b_tp2 runs/1b_tp2_sp --skip 10
For each run: the largest |loss - reference loss| and grad-norm relative difference over the steps
both logged, the final loss, and the median step time and tokens/s over steps after `--skip`
(warm-up, allocator growth and autotuning excluded).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config import ConfigError  # noqa: E402
from megafp8.train.plots import read_series  # noqa: E402


def _by_step(run: str, metric: str) -> dict[int, float]:
    steps, values = read_series(run, "train", metric)
    return dict(zip(steps, values))


def compare(runs: list[str], skip: int) -> str:
    ref_loss, ref_norm = _by_step(runs[0], "loss"), _by_step(runs[0], "grad_norm")
    lines = ["| run | steps compared | max abs loss diff | max grad-norm rel diff | final loss | step time (s) | "
             "tokens/s |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        loss, norm = _by_step(run, "loss"), _by_step(run, "grad_norm")
        times, tokens = _by_step(run, "step_time_s"), _by_step(run, "tokens_per_s")
        common = sorted(set(loss) & set(ref_loss))
        loss_diff = max(abs(loss[s] - ref_loss[s]) for s in common) if common else float("nan")
        norm_diff = max(abs(norm[s] - ref_norm[s]) / ref_norm[s] for s in common if s in norm and s in ref_norm) \
            if common else float("nan")
        late = [s for s in sorted(times) if s > skip] or sorted(times)
        lines.append(f"| {Path(run).name} | {len(common)} | {loss_diff:.4f} | {norm_diff:.2%} | "
                     f"{loss[max(loss)]:.4f} | {statistics.median(times[s] for s in late):.4f} | "
                     f"{statistics.median(tokens[s] for s in late):,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files; the first is the reference")
    parser.add_argument("--skip", type=int, default=0, help="leave steps up to this one out of the timing")
    args = parser.parse_args(argv)
    try:
        print(compare(args.runs, args.skip))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
