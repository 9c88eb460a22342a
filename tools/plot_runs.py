#!/usr/bin/env python
"""Plot metrics of several runs on one figure (PNG), e.g. FP8 against BF16.

Example:
    python tools/plot_runs.py runs/tiny_dense runs/tiny_dense_fp8 --labels BF16 FP8 \\
        --metrics loss val_loss --out runs/fp8_vs_bf16.png
A metric is a field of the train records (`loss`, `grad_norm`, `lr`, `tokens_per_s`, ...), of the eval
records when it starts with `val_`, or any `kind:field`.

FP8-vs-BF16 parity (issue 22): three curves, and under them each run's relative gap to the first in %:
    python tools/plot_runs.py runs/bf16_a runs/fp8_a runs/bf16_b --labels "BF16 seed A" "FP8 seed A" \\
        "BF16 seed B" --metrics loss val_loss --gaps --smooth 10 --from-step 100 --out parity.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config import ConfigError  # noqa: E402
from megafp8.train.plots import plot_runs  # noqa: E402
from megafp8.config.arguments import run_tool  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    parser.add_argument("--labels", nargs="+", default=None, help="one label per run (default: the paths)")
    parser.add_argument("--metrics", nargs="+", default=["loss"], help="metrics to plot, one panel each")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--gaps", action="store_true",
                        help="add a row of panels: each other run's relative gap (%%) to the first run")
    parser.add_argument("--smooth", type=int, default=1, help="draw trailing means over this many logged points")
    parser.add_argument("--from-step", type=int, default=0, help="leave out the steps before this one")
    args = parser.parse_args(argv)
    labels = args.labels or args.runs
    if len(labels) != len(args.runs):
        print(f"error: {len(args.runs)} runs but {len(labels)} labels", file=sys.stderr)
        return 2
    try:
        for warning in plot_runs(args.runs, labels, args.metrics, args.out, args.gaps, max(1, args.smooth),
                                 args.from_step):
            print(f"warning: {warning}", file=sys.stderr)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError:
        print("error: plotting needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    for label, run in zip(labels, args.runs):  # which curve is which run, for whoever reads the log
        print(f"- {label}: {run}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
