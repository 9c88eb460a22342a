#!/usr/bin/env python
"""Scaling against one GPU, from the tables `benchmarks/train_step.py` printed into a GPU session's summary.

    python benchmarks/scaling_table.py OUT/summary.md [MORE/summary.md ...] --baselines one_gpu_8b one_gpu_1b

The summary holds sections `## NAME` (one per `step` of a `benchmarks/gpu_*.sh` script), each with the table of
one `train_step.py` run, or a line saying why it has none (failed, skipped). For every row of every table this
prints one row: tokens/s per GPU, the efficiency against one GPU, FP8 / BF16, MFU, the steady peak memory of the
busiest rank and, under pipeline parallelism, the measured bubble beside the schedule's theoretical one.

- Efficiency: the row's TFLOP/s per device over the one-GPU row's, same model, recipe and card (the one-GPU rows
  are those of the `--baselines` sections; the card is the first GPU the summary's head names, `gpu_lib.sh`'s
  start_summary, and where the joined summaries name more than one, each row's section names its card). Model
  FLOPs per token are counted the same way for every row (recomputed forwards not counted), so for the same model
  this is the ratio of tokens/s per GPU; for a model of more layers (PP over 16 layers of the 8B-layer shape
  against one GPU's 8) it compares the work each GPU does per second.
- Measured bubble: 1 - efficiency, i.e. the share of one GPU's throughput each pipeline rank loses, which is the
  bubble plus whatever else the layout costs (the stages' sends, a smaller micro-batch). The theoretical one is the
  schedule's, as the training loop's start-up line logs it (forward = input-gradient = weight-gradient time).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Row:
    section: str
    cells: dict[str, str]  # train_step.py's column name -> cell
    run: tuple[int, int] = (0, 0)  # (summary, table in it): the train_step.py run that printed the row
    card: str = ""  # the GPU's name, from the summary's head (nvidia-smi's list of the machine's GPUs)

    def number(self, column: str) -> float | None:
        """The cell as a number (thousands separators, % and x dropped); None for n/a, - or a missing column."""
        text = self.cells.get(column, "").replace(",", "").rstrip("%x").strip()
        try:
            return float(text)
        except ValueError:
            return None


def read_rows(summary: str, index: int = 0) -> list[Row]:
    """Every row of every train_step.py table in the summary (the `index`th joined), with the section it sits in."""
    rows, section, header, tables, card, cards_next = [], "", None, 0, "", False
    for line in summary.splitlines():
        if cards_next:  # the first GPU of the head that a script's start_summary writes (each script its own)
            card, cards_next = line.split(",")[0].strip(), False
        if line.startswith("name, memory.total"):
            cards_next = True
        elif line.startswith("## "):
            section, header = line[3:].strip(), None
        elif not line.startswith("|"):
            header = None
        elif header is None:
            header = [cell.strip() for cell in line.strip("|").split("|")]
            tables += 1
        elif not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if "TFLOP/s per device" in header and len(cells) == len(header):
                rows.append(Row(section, dict(zip(header, cells)), (index, tables), card))
    return rows


def percent(value: float | None) -> str:
    return f"{100 * value:.1f}%" if value is not None else "-"


def scaling_table(rows: list[Row], baseline_sections: list[str]) -> str:
    """The Markdown table, rows grouped by model (in the order the models first appear), then as printed."""
    # A one-GPU row is the yardstick only on its own card: a later call joined to the first may have got other cards
    # (an H100 pair where H200s were asked for), and its rows over the first call's would read as a scaling loss
    baselines = {(r.card, r.cells["model"], r.cells["recipe"]): r for r in rows
                 if r.section in baseline_sections and r.cells["ranks"] == "1"}
    several_cards = len({r.card for r in rows}) > 1
    # FP8 / BF16 within one run's table: a section's name is not unique where summaries are joined (a part timed
    # again in a later call), and the last BF16 row of that name would stand beside the first call's FP8 row
    bf16 = {(r.run, r.cells["model"]): r for r in rows if r.cells["recipe"] == "bf16"}
    models = list(dict.fromkeys(r.cells["model"] for r in rows))
    lines = ["| layout (section) | model | recipe | GPUs | tokens/s per GPU | efficiency vs 1 GPU | FP8 / BF16 | MFU | "
             "peak GiB, steady (busiest rank) | bubble: measured / theoretical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: models.index(r.cells["model"])):
        model, recipe = r.cells["model"], r.cells["recipe"]
        base = baselines.get((r.card, model, recipe))
        missing = ("n/a (the one-GPU row ran on another card)"
                   if any(key[1:] == (model, recipe) for key in baselines) else "n/a (no one-GPU row)")
        tflops, base_tflops = r.number("TFLOP/s per device"), base.number("TFLOP/s per device") if base else None
        efficiency = tflops / base_tflops if tflops is not None and base_tflops else None
        same_bf16 = bf16.get((r.run, model))
        fp8_ratio = (f"{r.number('tokens/s') / same_bf16.number('tokens/s'):.2f}x"
                     if recipe != "bf16" and same_bf16 is not None and same_bf16.number("tokens/s") else "")
        theoretical = r.number("bubble, theoretical")
        bubble = "-"
        if theoretical is not None:
            measured = percent(1 - efficiency) if efficiency is not None else missing
            bubble = f"{measured} / {percent(theoretical / 100)}"
        layout = f"{r.section} ({r.card})" if several_cards else r.section
        lines.append(f"| {layout} | {model} | {recipe} | {r.cells['ranks']} | {r.cells['tokens/s per GPU']} | "
                     f"{percent(efficiency) if efficiency is not None else missing} | {fp8_ratio} | "
                     f"{r.cells['MFU']} | {r.cells['peak GiB, steady']} | {bubble} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summaries", type=Path, nargs="+",
                        help="GPU sessions' summary.md files (e.g. a second call's, against the first's baselines)")
    parser.add_argument("--baselines", nargs="+", required=True, metavar="SECTION",
                        help="the sections whose one-GPU rows are the yardstick (one per model)")
    args = parser.parse_args(argv)
    rows = [row for i, summary in enumerate(args.summaries) for row in read_rows(summary.read_text(), i)]
    if not rows:
        print(f"no train_step.py table in {' '.join(map(str, args.summaries))}")
        return 1
    print(scaling_table(rows, args.baselines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
