#!/usr/bin/env python
"""Two trees' whole training steps, interleaved, to tell a change of ~1% from the drift between runs.

Each run is a fresh process of `benchmarks/train_step.py` with the same arguments, in the old tree (`--old`) or the
new one (`--new`, default the current directory). The runs alternate in ABBA order (old, new, new, old, old, ...),
so a drift over the job (clocks, temperature, the power cap) reaches both trees alike. Printed: every run's tokens/s
per recipe (for MoE models with the routing's balance over its timed steps, train_step.py's "expert load" column),
then per recipe the median and range of each tree and the ratio of the medians, and where runs time
both BF16 and FP8, each tree's FP8 / BF16 within a run (median and range over its runs); last, each tree's memory
as train_step.py reports it (peak with the warm-up, and held in the steady state: the figure to compare under CUDA
graphs), median and range per recipe.

    PYTHONPATH=. python benchmarks/ab_steps.py --old old_tree --repeats 3 -- --model 1b \
        training.compile=true training.compile_mode=reduce-overhead --recipes fp8

(Everything after `--` goes to train_step.py: its `section.key=value` overrides before `--recipes`.) A run that
fails is listed with its exit status and the end of its error output, and left out of the medians.

`--prime` first runs each tree once, untimed and short (the same arguments, then `--warmup 1 --steps 2`): on a
fresh machine Triton and Inductor compile the kernels there, into their on-disk caches, rather than inside the
first timed run, which otherwise needs the compilation's time too within `--timeout` (job GF lost its first run so).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path


MEMORY_COLUMNS = ("peak GiB, with warm-up", "held GiB, steady")  # train_step.py's, compared where it prints them
LOAD_COLUMN = "expert load: cv, busiest / mean, idle"  # train_step.py's, for MoE models: shown with each run's figures


def parse_column(table: str, column: str) -> dict[str, float]:
    """{recipe: value of `column`} from train_step.py's Markdown table (the first table whose header names both
    "recipe" and "tokens/s"); {} where it has no such column."""
    return {recipe: float(cell.replace(",", "")) for recipe, cell in parse_cells(table, column).items()}


def parse_cells(table: str, column: str) -> dict[str, str]:
    """{recipe: the cell of `column`, as printed} from the same table; {} where it has no such column."""
    columns, found = None, {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            if "recipe" in cells and "tokens/s" in cells:
                if column not in cells:
                    return {}
                columns = cells
            continue
        if len(cells) != len(columns) or set(line.strip()) <= set("|-: "):
            if found:
                break
            continue
        found[cells[columns.index("recipe")]] = cells[columns.index(column)]
    return found


def parse_tokens_per_s(table: str) -> dict[str, float]:
    """{recipe: tokens/s} from train_step.py's Markdown table."""
    return parse_column(table, "tokens/s")


PRIME_ARGS = ("--warmup", "1", "--steps", "2")  # appended to a priming run's arguments: the last value counts


def prime(trees: dict[str, Path], train_step_args: list[str], timeout: float) -> str:
    """One short untimed run of each tree (`--prime`), so that the timed runs find the compiled kernels in the
    caches; a line saying how each went (a failed priming run is reported, and the timed runs still go ahead)."""
    done = []
    for tree in ("old", "new"):
        found, error, _, _ = run_once(trees[tree], [*train_step_args, *PRIME_ARGS], timeout)
        done.append(f"{tree} {'ok' if found else f'FAILED ({error})'}")
    return "primed (untimed, " + " ".join(PRIME_ARGS) + "): " + ", ".join(done)


def order(repeats: int) -> list[str]:
    """The trees in ABBA order: old, new, new, old, old, new, ... (2 x repeats runs)."""
    pairs = [("old", "new") if i % 2 == 0 else ("new", "old") for i in range(repeats)]
    return [tree for pair in pairs for tree in pair]


def run_once(tree: Path, train_step_args: list[str], timeout: float) -> tuple[dict[str, float], str, dict, dict]:
    """({recipe: tokens/s}, error text, {memory column: {recipe: GiB}}, {recipe: expert load cell}): one
    train_step.py process in `tree` (the expert load only for MoE models of a tree that prints it)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    try:
        done = subprocess.run([sys.executable, "benchmarks/train_step.py", *train_step_args], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, f"timed out after {timeout:.0f} s", {}, {}
    found = parse_tokens_per_s(done.stdout)
    if done.returncode != 0 or not found:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        return {}, f"rc {done.returncode}: {tail[-300:]}", {}, {}
    loads = {recipe: cell for recipe, cell in parse_cells(done.stdout, LOAD_COLUMN).items() if cell != "-"}
    return found, "", {column: parse_column(done.stdout, column) for column in MEMORY_COLUMNS}, loads


def _spread(values: list[float], spec: str) -> tuple[str, str]:
    """(median, "min-max") of `values`, each formatted with `spec`."""
    return format(statistics.median(values), spec), f"{format(min(values), spec)}-{format(max(values), spec)}"


def _ranges(old: list[float], new: list[float]) -> str:
    """"apart" when every run of one tree beat every run of the other, "overlap" otherwise; with a single run of
    either tree the spread between runs is unknown, so the two cannot be told apart ("one run")."""
    if not old or not new:
        return "-"
    if min(len(old), len(new)) < 2:
        return "one run"
    return "apart" if max(old) < min(new) or max(new) < min(old) else "overlap"


def summary(results: list[tuple[str, dict[str, float]]]) -> str:
    """Per recipe: each tree's median (min-max, runs), new / old of the medians, and whether the two trees' ranges
    are apart (every run of one faster than every run of the other) or overlap."""
    recipes = sorted({r for _, found in results for r in found})
    lines = ["| recipe | old: median tokens/s (range, runs) | new: median tokens/s (range, runs) | new / old | "
             "ranges |", "|---|---|---|---|---|"]
    for recipe in recipes:
        cells, medians, runs = [], {}, {}
        for tree in ("old", "new"):
            values = [found[recipe] for t, found in results if t == tree and recipe in found]
            runs[tree] = values
            if values:
                medians[tree] = statistics.median(values)
                median, spread = _spread(values, ",.0f")
                cells.append(f"{median} ({spread}, {len(values)})")
            else:
                cells.append("no run")
        ratio = f"{medians['new'] / medians['old']:.4f}" if len(medians) == 2 else "-"
        lines.append(f"| {recipe} | {cells[0]} | {cells[1]} | {ratio} | {_ranges(runs['old'], runs['new'])} |")
    ratios = []  # FP8 / BF16 within each run, where a run timed both
    for tree in ("old", "new"):
        within = [found["fp8"] / found["bf16"] for t, found in results if t == tree and {"fp8", "bf16"} <= set(found)]
        if within:
            median, spread = _spread(within, ".3f")
            ratios.append(f"{tree}: median {median}x ({spread}, {len(within)} runs)")
    if ratios:
        lines += ["", "FP8 / BF16 within each run: " + "; ".join(ratios)]
    return "\n".join(lines)


def memory_summary(memory: list[tuple[str, dict]]) -> str:
    """Per recipe and memory column (train_step.py's, GiB): each tree's median and range over its runs; "" if no
    run printed one. Within one tree these vary little between runs; the table shows whether they moved."""
    rows = []
    for column in MEMORY_COLUMNS:
        recipes = sorted({r for _, found in memory for r in found.get(column, {})})
        for recipe in recipes:
            cells = []
            for tree in ("old", "new"):
                values = [found[column][recipe] for t, found in memory if t == tree and recipe in found.get(column, {})]
                cells.append("{} ({})".format(*_spread(values, ".2f")) if values else "no run")
            rows.append(f"| {column} | {recipe} | {cells[0]} | {cells[1]} |")
    if not rows:
        return ""
    return "\n".join(["| memory | recipe | old: median GiB (range) | new: median GiB (range) |", "|---|---|---|---|",
                      *rows])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_step_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="the tree to compare against")
    parser.add_argument("--new", type=Path, default=Path("."), help="the tree under test (default: here)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tree")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--prime", action="store_true",
                        help="first one short untimed run in each tree, to fill the compilers' caches")
    args = parser.parse_args(ours)
    for tree in (args.old, args.new):
        if not (tree / "benchmarks" / "train_step.py").is_file():
            parser.error(f"{tree} has no benchmarks/train_step.py: give the root of a megafp8 tree")
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    results, memory = [], []
    if args.prime:
        print(prime(trees, train_step_args, args.timeout) + "\n", flush=True)
    print("| run | tree | tokens/s by recipe |\n|---|---|---|")
    for i, tree in enumerate(order(args.repeats), 1):
        found, error, gib, loads = run_once(trees[tree], train_step_args, args.timeout)
        # (a MoE run's routing balance beside its figure: collapsed and balanced routing time differently)
        shown = ", ".join(f"{r} {v:,.0f}" + (f" (expert load {loads[r]})" if r in loads else "")
                          for r, v in found.items()) or f"FAILED ({error})"
        print(f"| {i} | {tree} | {shown} |", flush=True)
        results.append((tree, found))
        memory.append((tree, gib))
    print()
    print(summary(results))
    memory_table = memory_summary(memory)
    if memory_table:
        print()
        print(memory_table)
    return 0 if all(found for _, found in results) else 1


if __name__ == "__main__":
    sys.exit(main())
