"""benchmarks/ab_steps.py, the interleaved A/B of two trees' training steps (ABBA order, each tree's median and
range, FP8 / BF16 within each run, memory and MoE expert load from train_step.py's table), over stand-in trees on
CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


# A stand-in for benchmarks/train_step.py in a tree of its own: it logs which tree ran to $AB_LOG and prints the
# table row of its next rate from rates.txt ("fail": exit 1 without a table).
STAND_IN_TRAIN_STEP = '''import os, pathlib, sys
tree = pathlib.Path.cwd()
with open(os.environ["AB_LOG"], "a") as log:
    log.write(tree.name + " " + " ".join(sys.argv[1:]) + "\\n")
rates = (tree / "rates.txt").read_text().split()
calls = tree / "calls.txt"
n = int(calls.read_text()) if calls.exists() else 0
calls.write_text(str(n + 1))
if rates[n] == "fail":
    sys.exit("CUDA out of memory")
print("| model | recipe | ranks | tokens/s | vs BF16 |")
print("|---|---|---|---|---|")
print(f"| 1b | fp8 | 1 | {float(rates[n]):,.0f} | - |")
'''


def ab_tree(root: Path, name: str, rates: list[str]) -> Path:
    tree = root / name
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "benchmarks" / "train_step.py").write_text(STAND_IN_TRAIN_STEP)
    (tree / "rates.txt").write_text(" ".join(rates))
    return tree


def run_ab_steps(root: Path, old_rates: list[str], new_rates: list[str], ours: list[str],
                 train_step: list[str]) -> tuple[subprocess.CompletedProcess, list[tuple[str, str]]]:
    """ab_steps.py over two stand-in trees giving these tokens/s run by run ("fail": a failed run), with its own
    arguments `ours` and `train_step` after `--`; (its result, (tree, arguments) of each run in order)."""
    old, new = ab_tree(root, "old", old_rates), ab_tree(root, "new", new_rates)
    log = root / "ab.log"
    cmd = [sys.executable, str(REPO / "benchmarks/ab_steps.py"), "--old", str(old), "--new", str(new), *ours, "--",
           *train_step]
    result = subprocess.run(cmd, env=dict(os.environ, AB_LOG=str(log)), capture_output=True, text=True, timeout=120)
    ran = [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()] if log.exists() else []
    return result, ran


def test_ab_steps_alternates_the_trees_and_compares_their_medians(tmp_path):
    """ABBA order (old, new, new, old, old, new), every run's figure, each tree's median and range, new / old of the
    medians; the train_step.py arguments after `--` reach every run unchanged."""
    result, ran = run_ab_steps(tmp_path, ["100000", "101000", "99000"], ["103000", "102000", "110000"],
                               ["--repeats", "3"], ["--model", "1b", "training.compile=true", "--recipes", "fp8"])
    assert result.returncode == 0, result.stderr
    assert [tree for tree, _ in ran] == ["old", "new", "new", "old", "old", "new"]
    assert all(args == "--model 1b training.compile=true --recipes fp8" for _, args in ran)
    assert "| 6 | new | fp8 110,000 |" in result.stdout
    assert "| fp8 | 100,000 (99,000-101,000, 3) | 103,000 (102,000-110,000, 3) | 1.0300 | apart |" in result.stdout


def test_ab_steps_primes_each_tree_once_untimed_before_the_timed_runs(tmp_path):
    """`--prime`: one short run in each tree first (the same arguments, then `--warmup 1 --steps 2`), left out of
    the table and the medians; then the ABBA runs with the arguments unchanged."""
    result, ran = run_ab_steps(tmp_path, ["1", "100000", "101000"], ["fail", "103000", "102000"],
                               ["--repeats", "2", "--prime"], ["--model", "moe", "--recipes", "fp8"])
    assert result.returncode == 0, result.stderr
    assert ran[:2] == [("old", "--model moe --recipes fp8 --warmup 1 --steps 2"),
                       ("new", "--model moe --recipes fp8 --warmup 1 --steps 2")]
    assert [tree for tree, _ in ran[2:]] == ["old", "new", "new", "old"]
    assert all(args == "--model moe --recipes fp8" for _, args in ran[2:])
    assert "primed (untimed, --warmup 1 --steps 2): old ok, new FAILED (rc 1: CUDA out of memory)" in result.stdout
    assert "| fp8 | 100,500 (100,000-101,000, 2) | 102,500 (102,000-103,000, 2) | 1.0199 | apart |" in result.stdout


def test_ab_steps_gives_each_trees_fp8_over_bf16_within_its_runs():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import ab_steps
    results = [("old", {"bf16": 100.0, "fp8": 120.0}), ("new", {"bf16": 100.0, "fp8": 125.0}),
               ("new", {"bf16": 90.0, "fp8": 117.0}), ("old", {"bf16": 90.0, "fp8": 106.2})]
    text = ab_steps.summary(results)
    assert "| bf16 | 95 (90-100, 2) | 95 (90-100, 2) | 1.0000 | overlap |" in text
    one_each = ab_steps.summary([("old", {"fp8": 100.0}), ("new", {"fp8": 110.0})])
    assert "| 1.1000 | one run |" in one_each  # one run a tree says nothing about the spread
    assert "FP8 / BF16 within each run: old: median 1.190x (1.180-1.200, 2 runs); new: median 1.275x " \
           "(1.250-1.300, 2 runs)" in text


def test_ab_steps_reports_a_failed_run_and_leaves_it_out(tmp_path):
    result, _ = run_ab_steps(tmp_path, ["100000"], ["fail"], ["--repeats", "1"], ["--recipes", "fp8"])
    assert result.returncode == 1
    assert "| 2 | new | FAILED (rc 1: CUDA out of memory) |" in result.stdout
    assert "| fp8 | 100,000 (100,000-100,000, 1) | no run | - | - |" in result.stdout


def test_ab_steps_reads_train_steps_own_table():
    """`parse_tokens_per_s` on the table train_step.py prints (its "tokens/s", not "tokens/s per GPU")."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import ab_steps
    import train_step
    row = dict(model="1b", ranks=2, step_s=0.15, tflops=600.0, mfu=0.6, peak_gib=20.0, warmup_peak_gib=30.0,
               loss=3.1, graph_breaks=0, planned_gib=21.0, per_rank=[(20.0, 21.0)], held_gib=40.0, bubble=None,
               skipped=0)
    table = train_step.table([dict(row, recipe="bf16", tokens_per_s=88479.4), dict(row, recipe="fp8",
                                                                                      tokens_per_s=107150.2)])
    assert ab_steps.parse_tokens_per_s("log line\n" + table + "\n\ntrailing text") == {"bf16": 88479.0,
                                                                                       "fp8": 107150.0}


def test_ab_steps_compares_the_trees_memory_from_train_steps_table():
    """Each tree's held and peak GiB (train_step.py's columns), median and range per recipe; a table without those
    columns gives no memory table."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import ab_steps
    import train_step
    row = dict(model="1b", ranks=1, step_s=0.15, tflops=600.0, mfu=0.6, peak_gib=20.0, loss=3.1, graph_breaks=0,
               planned_gib=21.0, per_rank=[(20.0, 21.0)], bubble=None, tokens_per_s=1.0, skipped=0)

    def run(held_bf16, held_fp8, warmup):
        table = train_step.table([dict(row, recipe="bf16", held_gib=held_bf16, warmup_peak_gib=warmup),
                                  dict(row, recipe="fp8", held_gib=held_fp8, warmup_peak_gib=warmup)])
        return {column: ab_steps.parse_column(table, column) for column in ab_steps.MEMORY_COLUMNS}

    memory = [("old", run(67.6, 68.0, 64.0)), ("new", run(65.5, 65.9, 62.0)), ("new", run(65.5, 66.1, 62.0)),
              ("old", run(67.6, 67.9, 64.0))]
    text = ab_steps.memory_summary(memory)
    assert "| held GiB, steady | fp8 | 67.95 (67.90-68.00) | 66.00 (65.90-66.10) |" in text
    assert "| held GiB, steady | bf16 | 67.60 (67.60-67.60) | 65.50 (65.50-65.50) |" in text
    assert "| peak GiB, with warm-up | fp8 | 64.00 (64.00-64.00) | 62.00 (62.00-62.00) |" in text
    assert ab_steps.memory_summary([("old", {c: {} for c in ab_steps.MEMORY_COLUMNS})]) == ""
    assert ab_steps.parse_column("| recipe | tokens/s |\n|---|---|\n| fp8 | 5 |", "held GiB, steady") == {}


def test_ab_steps_shows_each_moe_runs_expert_load_beside_its_figure():
    """train_step.py's "expert load" cell (MoE models) is read as printed and shown with the run's tokens/s; a
    dense model's "-" is left out, and a float column still parses as before."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import ab_steps
    import train_step
    row = dict(model="moe", ranks=1, step_s=0.15, tflops=600.0, mfu=0.6, peak_gib=20.0, warmup_peak_gib=30.0,
               loss=3.1, graph_breaks=0, planned_gib=21.0, per_rank=[(20.0, 21.0)], held_gib=40.0, bubble=None,
               skipped=0)
    table = train_step.table([dict(row, recipe="bf16", tokens_per_s=95482.0, expert_load=(1.16, 7.97, 0.625)),
                              dict(row, recipe="fp8", tokens_per_s=122413.0, expert_load=None)])
    assert ab_steps.parse_cells(table, ab_steps.LOAD_COLUMN) == {"bf16": "1.16, 7.97x, 62%", "fp8": "-"}
    assert ab_steps.parse_column(table, "held GiB, steady") == {"bf16": 40.0, "fp8": 40.0}


def test_ab_steps_prints_a_moe_runs_expert_load_with_its_tokens_per_s(tmp_path):
    stand_in = '''print("| model | recipe | ranks | tokens/s | expert load: cv, busiest / mean, idle |")
print("|---|---|---|---|---|")
print("| moe | bf16 | 1 | 95,000 | 1.16, 7.97x |")
print("| moe | fp8 | 1 | 120,000 | 0.20, 1.40x |")
'''
    trees = []
    for name in ("old", "new"):
        tree = tmp_path / name
        (tree / "benchmarks").mkdir(parents=True)
        (tree / "benchmarks" / "train_step.py").write_text(stand_in)
        trees.append(tree)
    cmd = [sys.executable, str(REPO / "benchmarks/ab_steps.py"), "--old", str(trees[0]), "--new", str(trees[1]),
           "--repeats", "1", "--", "--model", "moe", "--recipes", "bf16", "fp8"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| 1 | old | bf16 95,000 (expert load 1.16, 7.97x), fp8 120,000 (expert load 0.20, 1.40x) |" \
        in result.stdout, result.stdout
