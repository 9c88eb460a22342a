#!/usr/bin/env python
"""Compare runs step by step against a reference run: loss agreement and speed, as a Markdown table.

Example (TP=2 against TP=1 on the same seed):
    python tools/compare_runs.py runs/1b_tp1 runs/1b_tp2 runs/1b_tp2_sp --skip 10
For each run: the largest |loss - reference loss| and grad-norm relative difference over the steps
both logged, the final loss, and the median step time and tokens/s over steps after `--skip`
(warm-up, allocator growth and autotuning excluded). `--max-loss-gap 0.05` then judges each run: PASS where its
largest |loss gap| over every step the reference logged is within 0.05, else FAIL and exit status 1.

The training loss compared, in every mode, is the language-modelling loss: `lm_loss`, which is `loss` without
multi-token prediction and `loss` less the weighted MTP loss with it, so a run with MTP compares with one without
(a metrics file from before `lm_loss` was logged gives its `loss`; one of those that trained with MTP compares only
with others like it).

Parity mode (FP8 against BF16, with BF16's own seed-to-seed noise as the yardstick):
    python tools/compare_runs.py --parity runs/bf16_a runs/fp8_a runs/bf16_b --window 500
The runs are BF16 seed A, FP8 seed A and (optional) BF16 seed B, trained on the same data in the same order. Per
window of steps: each run's mean training loss, FP8's relative gap to BF16 A and BF16 B's (the seed-to-seed
gap); the same at each evaluation for the validation loss; then the verdict at the last evaluation every run has a
finite loss at: FP8 within `--tolerance` (0.25%) of BF16 A, and |FP8 - BF16 A| <= |BF16 B - BF16 A| (FP8's gap to the
two seeds' mean is printed beside them, not judged), with a line under it for each run without a finite loss at a
later evaluation another run logged (cut short, or a nan or inf there); and the FP8 run's worst tensors in its last
FP8 health record, by quantization SNR and by underflow. `--seeds B A` names the runs for a second pair (BF16 seed B,
FP8 seed B, BF16 seed A).

Gaps mode (many runs against one, e.g. ablations against BF16; a run cut short shows where it got to):
    python tools/compare_runs.py --gaps runs/bf16_b runs/fp8_b runs/fp8_attn_bf16_b --windows 501-750 751-1000 \\
        --labels "BF16 B" "FP8 B" "FP8 B, attention BF16"
Per run, its mean training loss over each window of steps (inclusive) and its validation loss at each of the
reference's evaluations, as its relative gap to the first run's (over the steps both logged); the reference's own
row gives its values. A run that stopped before the reference's last step of a window gets "-" there.

Pooled mode (repeats of one configuration: the same seed, data and settings, run again; on a GPU whose kernels are
not deterministic, each repeat follows its own path):
    python tools/compare_runs.py --pooled runs/bf16_b runs/bf16_b_r2 runs/bf16_b_r3 \\
        --against runs/fp8_b runs/fp8_b_r2 --labels "BF16 B" "FP8 B" --window 250
Per window and evaluation: each arm's runs, their mean, the reference arm's range (max - min over its mean: its
run-to-run spread at one seed), and the other arm's mean as its gap to the reference's; a run is counted where it
got to. Then the verdict at the last evaluation both arms reached (a run without a finite loss there, or at a later
evaluation another run logged, is named under it, with why): the other arm's mean inside the reference's
range or not, the standard error of the two means' difference, and whether the runs can resolve `--tolerance` at
all, with the runs an arm that would take. The bold verdict is Welch's t test of the difference (95%, two-sided,
Student's t at the Welch-Satterthwaite degrees of freedom, since an arm has a handful of runs), not the range: a
range only widens as runs are added, so a mean inside it says less and less. Beside it, a rank check that one
outlying run cannot sway: the Mann-Whitney rank-sum test (exact for arms of a few runs) and the median of the
pairwise differences of runs (Hodges-Lehmann).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config import ConfigError  # noqa: E402
from megafp8.train.plots import lm_loss_field, logged_values, read_records, read_series  # noqa: E402
from megafp8.config.arguments import positive_number, run_tool  # noqa: E402
from megafp8.train.run_statistics import mann_whitney, runs_to_resolve, t_critical, welch  # noqa: E402


def _by_step(run: str, metric: str) -> dict[int, float]:
    steps, values = read_series(run, "train", metric)
    return dict(zip(steps, values))


def loss_fields(runs: list[str]) -> tuple[list[str], str]:
    """Each run's field of its training loss, like with like, and what they hold, for a table's header: the
    language-modelling loss (`lm_loss_field`: `lm_loss`, or `loss` of a run without MTP), or, between runs that all
    trained with MTP before `lm_loss` was logged, every run's `loss`, their total loss; a ConfigError if only some
    are such runs."""
    fields = [lm_loss_field(run) for run in runs]
    if None not in fields:
        return fields, "LM loss"
    alike = [run for run, field in zip(runs, fields) if field is not None]
    if alike:
        raise ConfigError(f"{runs[fields.index(None)]} trained with MTP before lm_loss was logged: its training "
                          f"loss holds the weighted MTP loss, {alike[0]}'s does not; compare their val_loss "
                          "(--gaps, --parity, --pooled), or runs alike")
    return ["loss"] * len(runs), "loss (LM + weighted MTP)"


def train_losses(runs: list[str], fields: list[str] | None = None) -> list[dict[int, float]]:
    """Each run's training loss by step, from `fields` (`loss_fields`' by default)."""
    fields = fields or loss_fields(runs)[0]
    return [_by_step(run, field) for run, field in zip(runs, fields)]


def compare(runs: list[str], skip: int) -> str:
    fields, name = loss_fields(runs)
    losses = train_losses(runs, fields)
    ref_loss, ref_norm = losses[0], _by_step(runs[0], "grad_norm")
    lines = [f"| run | steps compared | max abs {name} diff | max grad-norm rel diff | final {name} | step time (s) | "
             "tokens/s |", "|---|---|---|---|---|---|---|"]
    for run, loss in zip(runs, losses):
        norm = _by_step(run, "grad_norm")
        if not loss:
            raise ConfigError(f"run {run} has no train records with a loss (a run stopped before its first log, or "
                              "not a training run's metrics): leave it out")
        times, tokens = _by_step(run, "step_time_s"), _by_step(run, "tokens_per_s")
        common = sorted(set(loss) & set(ref_loss))
        loss_diff = max((abs(loss[s] - ref_loss[s]) for s in common), default=math.nan)
        norm_diff = max((abs(norm[s] - ref_norm[s]) / ref_norm[s] for s in common
                         if s in norm and ref_norm.get(s)), default=math.nan)  # a norm of 0 is no scale
        lines.append(f"| {Path(run).name} | {len(common)} | {loss_diff:.4f} | {norm_diff:.2%} | "
                     f"{loss[max(loss)]:.4f} | {_late_median(times, skip, '.4f')} | "
                     f"{_late_median(tokens, skip, ',.0f')} |")
    return "\n".join(lines)


def loss_gap_verdict(runs: list[str], limit: float) -> tuple[list[str], bool]:
    """`--max-loss-gap`: one line per run after the first, PASS where its largest |loss - reference loss| is within
    `limit` over every step the reference logged, FAIL where it is not or the run logged fewer of those steps (a
    run cut short would pass on the steps it reached). Returns the lines and whether all passed."""
    ref_loss, *losses = train_losses(runs)
    lines, passed = [], True
    for run, loss in zip(runs[1:], losses):
        common = sorted(set(loss) & set(ref_loss))
        gaps = {step: abs(loss[step] - ref_loss[step]) for step in common}
        worst = max(gaps, key=lambda step: (gaps[step], -step), default=None)
        name = Path(run).name
        if len(common) < len(ref_loss):
            lines.append(f"- **FAIL** {name}: a finite loss at {len(common)} of the reference's {len(ref_loss)} steps "
                         "(cut short, or non-finite losses)")
            passed = False
        elif not gaps[worst] <= limit:  # a NaN gap fails too
            lines.append(f"- **FAIL** {name}: max |loss gap| {gaps[worst]:.4f} at step {worst}, above {limit}")
            passed = False
        else:
            lines.append(f"- **PASS** {name}: max |loss gap| {gaps[worst]:.4f} (step {worst}) within {limit} over "
                         f"{len(common)} steps")
    return lines, passed


def _late_median(series: dict[int, float], skip: int, spec: str) -> str:
    """The median of the values logged after step `skip` (all of them where none is), or "-" where none was."""
    late = [series[s] for s in sorted(series) if s > skip] or list(series.values())
    return format(statistics.median(late), spec) if late else "-"


def roles_of(seeds: tuple[str, str] = ("A", "B")) -> tuple[str, str, str]:
    """The three runs' names: BF16 and FP8 at the reference seed, BF16 at the other (`--seeds`)."""
    ref, other = seeds
    return f"BF16 {ref}", f"FP8 {ref}", f"BF16 {other}"


def _gap(value: float, ref: float) -> float:
    return (value - ref) / ref


def _windows(series: list[dict[int, float]], window: int) -> list[tuple[str, list[float]]]:
    """(steps label, each run's mean) per window of `window` steps, over the steps every run logged."""
    common = sorted(set.intersection(*(set(s) for s in series)))
    groups: dict[int, list[int]] = {}
    for step in common:
        groups.setdefault((step - 1) // window, []).append(step)
    return [(f"{w * window + 1}-{min((w + 1) * window, steps[-1])}",
             [statistics.fmean(run[s] for s in steps) for run in series]) for w, steps in sorted(groups.items())]


def _table(first_column: str, rows: list[tuple[str, list[float]]], roles: tuple[str, ...]) -> list[str]:
    gaps = [f"FP8 vs {roles[0]}"] + ([f"{roles[2]} vs {roles[0]} (seed spread)"] if len(roles) == 3 else [])
    lines = [f"| {first_column} | {' | '.join(roles)} | {' | '.join(gaps)} |",
             "|---" * (1 + len(roles) + len(gaps)) + "|"]
    for label, values in rows:
        cells = [f"{v:.4f}" for v in values] + [f"{_gap(v, values[0]):+.3%}" for v in values[1:]]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines


def verdict(values: list[float], tolerance: float, seeds: tuple[str, str] = ("A", "B")) -> list[str]:
    """The end verdict from the final losses of BF16 A, FP8 A (and BF16 B): FP8 within `tolerance` of BF16 A,
    and |FP8 - BF16 A| no larger than |BF16 B - BF16 A| (BF16's own seed-to-seed spread). `seeds` names the
    reference seed and the other (A and B, or B and A for the second pair)."""
    ref, other = seeds
    fp8_gap = _gap(values[1], values[0])
    close = abs(fp8_gap) <= tolerance
    lines = [f"- FP8 vs BF16 {ref}: {fp8_gap:+.3%}, within {tolerance:.2%}: {'yes' if close else 'NO'}"]
    if len(values) < 3:
        lines += [f"- BF16 seed-to-seed spread: not measured (no BF16 seed {other} run)",
                  f"- **{'PASS' if close else 'FAIL'}** on the {tolerance:.2%} criterion alone (one seed each: FP8's "
                  "gap cannot be told from seed noise)"]
        return lines
    spread = abs(_gap(values[2], values[0]))
    inside = abs(fp8_gap) <= spread
    lines.append(f"- BF16 seed-to-seed spread |BF16 {other} - BF16 {ref}|: {spread:.3%}; |FP8 - BF16 {ref}| = "
                 f"{abs(fp8_gap):.3%}: {'inside' if inside else 'OUTSIDE'} the spread")
    # Not a criterion: with two BF16 seeds far apart, where FP8 sits between them says more than its gap to one.
    lines.append(f"- FP8 vs the mean of the two BF16 seeds: {_gap(values[1], (values[0] + values[2]) / 2):+.3%} "
                 "(for reference, not a criterion)")
    if close and inside:
        lines.append(f"- **PASS**: FP8 is within {tolerance:.2%} of BF16 seed {ref} and inside the BF16 seed-to-seed "
                     "spread")
    else:
        failed = [what for what, ok in ((f"not within {tolerance:.2%} of BF16 seed {ref}", close),
                                        ("outside the BF16 seed-to-seed spread", inside)) if not ok]
        lines.append(f"- **FAIL**: FP8 is {' and '.join(failed)}")
    return lines


def worst_fp8_layers(run: str, count: int) -> list[str]:
    """Two tables from the run's last fp8_health record: the `count` FP8 tensors with the lowest quantization SNR,
    and the `count` whose 1x128 tiles flush the largest share of their nonzero elements to zero (underflow)."""
    records = read_records(run)
    health = [r for r in records if r.get("kind") == "fp8_health" and r.get("layers")]
    if not health:
        return []
    last = health[-1]
    tensors = [(layer, tensor, stats) for layer, by_tensor in last["layers"].items()
               for tensor, stats in by_tensor.items()]
    # A statistic without a finite value (null: a nan or inf in the tensor) ranks as the worst: that tensor is in
    # trouble; but a tensor of zeros (amax 0: an idle expert's gradient) has no SNR to rank (+inf, nothing lost, null)
    lowest_snr = sorted(tensors, key=lambda row: math.inf if row[2].get("amax") == 0
                        else _finite_or(row[2].get("snr_db"), -math.inf))[:count]
    most_underflow = sorted(tensors, key=lambda row: -_finite_or(row[2].get("underflow"), math.inf))[:count]
    return (_health_table(f"FP8 health at step {last['step']}, the {len(lowest_snr)} tensors with the lowest SNR:",
                          lowest_snr)
            + [""] + _health_table(f"The {len(most_underflow)} tensors with the most underflow:", most_underflow))


def _finite_or(value: object, instead: float) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else instead


def _health_table(title: str, rows: list[tuple[str, str, dict]]) -> list[str]:
    def cell(stats: dict, key: str, spec: str) -> str:
        value = stats.get(key)
        return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"

    lines = [title, "", "| layer | tensor | SNR (dB) | underflow | at FP8 max | max-abs |", "|---|---|---|---|---|---|"]
    return lines + [f"| {layer} | {tensor} | {cell(stats, 'snr_db', '.1f')} | {cell(stats, 'underflow', '.2%')} | "
                    f"{cell(stats, 'at_max', '.2%')} | {cell(stats, 'amax', '.3g')} |" for layer, tensor, stats in rows]


def parity(runs: list[str], window: int, tolerance: float, worst: int, seeds: tuple[str, str] = ("A", "B")) -> str:
    """FP8-vs-BF16 parity of `runs` = [BF16 seed A, FP8 seed A, (BF16 seed B)] as Markdown: training loss per
    window of steps, validation loss at each evaluation, the end verdict, the FP8 run's worst layers. `seeds`
    names the runs' seeds (("B", "A"): BF16 B, FP8 B, BF16 A)."""
    if len(runs) not in (2, 3):
        raise ConfigError(f"--parity takes 2 or 3 runs (BF16 seed A, FP8 seed A, [BF16 seed B]), got {len(runs)}")
    roles = roles_of(seeds)[: len(runs)]
    lines = [f"- {role}: {run}" for role, run in zip(roles, runs)] + [""]
    train = train_losses(runs)
    if not set.intersection(*(set(s) for s in train)):
        raise ConfigError(f"runs {runs} have no logged training step in common")
    windows = _windows(train, window)
    lines += [f"Training loss, mean over each window of {window} steps (steps logged by every run):", ""]
    lines += _table("steps", windows, roles)
    valid = [dict(zip(*read_series(run, "eval", "val_loss"))) for run in runs]
    evals = sorted(set.intersection(*(set(v) for v in valid)))
    if evals:
        lines += ["", "Validation loss (held-out split) at each evaluation:", ""]
        lines += _table("step", [(str(s), [v[s] for v in valid]) for s in evals], roles)
        end, values = f"validation loss at step {evals[-1]}", [v[evals[-1]] for v in valid]
        not_judged = _not_judged(runs, roles, "eval", "val_loss", evals[-1])
    else:
        some = "none finite at a step every run logged" if any(logged_values(r, "eval", "val_loss") for r in runs) \
            else "no validation loss logged"
        end, values = f"training loss of the last window (steps {windows[-1][0]}; {some})", windows[-1][1]
        not_judged = _not_judged(runs, roles, "train", "loss", max(set.intersection(*(set(s) for s in train))))
    lines += ["", f"Verdict ({end}):", ""] + verdict(values, tolerance, seeds) + not_judged
    health = worst_fp8_layers(runs[1], worst)
    return "\n".join(lines + ([""] + health if health else []))


def parse_window(text: str) -> tuple[int, int]:
    """'501-750' -> (501, 750): a window of training steps, both ends included."""
    start, sep, end = text.partition("-")
    if not (sep and start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
        raise argparse.ArgumentTypeError(f"'{text}' is not a window of steps FIRST-LAST (e.g. 501-750)")
    return int(start), int(end)


def gaps(runs: list[str], labels: list[str], windows: list[tuple[int, int]]) -> str:
    """Each run's training loss (mean over each window) and validation loss (at each of the reference's
    evaluations) as its relative gap to the first run's, as a Markdown table (see the module's docstring). A
    window's gap compares the two runs over the steps both logged in it; a run that stops before the reference's
    last step of the window gets "-"."""
    if len(labels) != len(runs):
        raise ConfigError(f"{len(labels)} labels for {len(runs)} runs")
    train = train_losses(runs)
    valid = [dict(zip(*read_series(run, "eval", "val_loss"))) for run in runs]
    columns = []
    for a, b in windows:
        steps = [s for s in sorted(train[0]) if a <= s <= b]
        if not steps:
            raise ConfigError(f"the reference {runs[0]} logged no training step in {a}-{b}")
        columns.append((f"train loss, {a}-{min(b, steps[-1])}", steps))  # named by what the reference logged
    lines = [f"| run | {' | '.join(name for name, _ in columns)} | "
             + " | ".join(f"validation loss, step {s}" for s in sorted(valid[0])) + " |",
             "|---" * (1 + len(columns) + len(valid[0])) + "|"]
    for i, (label, loss, val) in enumerate(zip(labels, train, valid)):
        cells = []
        for _, steps in columns:
            both = [s for s in steps if s in loss]
            if i == 0:
                cells.append(f"{statistics.fmean(loss[s] for s in steps):.4f}")
            elif not both or max(loss) < steps[-1]:
                cells.append("-")
            else:
                mean, ref = (statistics.fmean(series[s] for s in both) for series in (loss, train[0]))
                cells.append(f"{_gap(mean, ref):+.2%}")
        for step, ref in sorted(valid[0].items()):
            cells.append("-" if step not in val else f"{val[step]:.4f}" if i == 0 else f"{_gap(val[step], ref):+.3%}")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    if not valid[0]:
        lines.append(f"\n(the reference {runs[0]} logged no validation loss)")
    return "\n".join(lines)


def _arm_cells(values: list[float]) -> list[str]:
    """A pooled arm's cells: its runs' values and their mean."""
    return [", ".join(f"{v:.4f}" for v in values), f"{statistics.fmean(values):.4f}"]


def _pooled_row(label: str, ref: list[float], other: list[float]) -> str:
    ref_mean, other_mean = statistics.fmean(ref), statistics.fmean(other)
    spread = f"{(max(ref) - min(ref)) / ref_mean:.3%}" if len(ref) > 1 else "-"
    return (f"| {label} | {' | '.join(_arm_cells(ref))} | {spread} | {' | '.join(_arm_cells(other))} | "
            f"{_gap(other_mean, ref_mean):+.3%} |")


def rank_check(ref: list[float], other: list[float], labels: tuple[str, str]) -> str:
    """One line beside Welch's t test that an outlying run cannot sway: the rank-sum test (`mann_whitney`) and the
    Hodges-Lehmann shift (the median of every other-minus-reference difference of runs, relative to the reference's
    mean)."""
    u, p, exact = mann_whitney(ref, other)
    shift = statistics.median(o - r for o in other for r in ref) / statistics.fmean(ref)
    return (f"- Rank check (Mann-Whitney, {'exact' if exact else 'normal approximation'}): {labels[1]}'s runs end "
            f"higher in {u:g} of {len(ref) * len(other)} pairs with {labels[0]}'s, two-sided p = {p:.2g} "
            f"({'below' if p < 0.05 else 'not below'} 0.05); median pairwise difference {shift:+.3%}")


def pooled_verdict(ref: list[float], other: list[float], tolerance: float, labels: tuple[str, str]) -> list[str]:
    """The end verdict of two arms of repeats (final losses): the other arm's mean inside the reference arm's range
    (its run-to-run spread at one seed) or not; the standard error of the difference of the means and Welch's t
    test of it (95%, two-sided: INSIDE the noise where the difference is at most the critical t times the standard
    error); and whether these runs resolve `tolerance` (the critical t times the standard error at most), else
    about how many runs an arm would (`runs_to_resolve`)."""
    if len(ref) < 2:
        raise ConfigError(f"the {labels[0]} arm needs two runs or more to measure its run-to-run spread")
    ref_mean, other_mean = statistics.fmean(ref), statistics.fmean(other)
    gap = _gap(other_mean, ref_mean)
    spread = (max(ref) - min(ref)) / ref_mean
    deviation = statistics.stdev(ref) / ref_mean
    other_deviation = statistics.stdev(other) / ref_mean if len(other) > 1 else deviation
    error, dof = welch(ref, other)
    error /= ref_mean
    critical = t_critical(dof)
    inside = abs(gap) <= spread
    lines = [f"- {labels[0]}'s run-to-run range at one seed ({len(ref)} runs): {spread:.3%} of their mean; "
             f"sample deviation {deviation:.3%}",
             f"- {labels[1]}'s mean ({len(other)} run{'s' if len(other) > 1 else ''}) vs {labels[0]}'s: {gap:+.3%}, "
             f"standard error {error:.3%}: {'inside' if inside else 'OUTSIDE'} {labels[0]}'s range"]
    if critical * error <= tolerance:
        lines.append(f"- These runs resolve {tolerance:.2%}: the 95% bound is {critical * error:.3%}")
    else:
        needed = runs_to_resolve(max(deviation, other_deviation), tolerance)
        lines.append(f"- These runs cannot resolve {tolerance:.2%} (the 95% bound is {critical * error:.3%}): at "
                     f"this deviation that takes ~{needed} runs an arm")
    ratio = abs(gap) / error if error > 0 else (0.0 if gap == 0 else math.inf)
    within = ratio <= critical
    lines.append(f"- **{'INSIDE' if within else 'OUTSIDE'} the run-to-run noise** (Welch's t test, 95%): the "
                 f"difference of the means is {ratio:.2f} standard errors from zero, against {critical:.2f} at "
                 f"{dof:.1f} degrees of freedom; 95% interval {gap - critical * error:+.3%} to "
                 f"{gap + critical * error:+.3%}")
    if len(other) > 1:
        lines.append(rank_check(ref, other, labels))
    return lines


def pooled(ref_runs: list[str], other_runs: list[str], labels: tuple[str, str], window: int,
           tolerance: float) -> str:
    """Two arms of repeated runs compared by their means, against the reference arm's own run-to-run spread (see the
    module's docstring), as Markdown: training loss per window, validation loss per evaluation, the verdict."""
    runs = ref_runs + other_runs
    lines = [f"- {labels[0]}: {', '.join(ref_runs)}", f"- {labels[1]}: {', '.join(other_runs)}", ""]
    train = train_losses(runs)
    last = [max(series, default=0) for series in train]
    steps = sorted(set.union(*(set(s) for s in train)))
    head = (f"{labels[0]} runs | {labels[0]} mean | {labels[0]} range | {labels[1]} runs | {labels[1]} mean | "
            f"{labels[1]} vs {labels[0]} |")
    rows = []
    for w in range((steps[-1] - 1) // window + 1 if steps else 0):
        first, end = w * window + 1, (w + 1) * window
        # each run's mean over the window's steps, counted only where the run logged the window to its end
        means = [statistics.fmean(v for s, v in series.items() if first <= s <= end)
                 if stop >= min(end, steps[-1]) and any(first <= s <= end for s in series) else None
                 for series, stop in zip(train, last)]
        ref, other = ([m for m in means[a:b] if m is not None] for a, b in ((0, len(ref_runs)), (len(ref_runs), None)))
        if ref and other:
            rows.append(_pooled_row(f"{first}-{min(end, steps[-1])}", ref, other))
    if rows:
        lines += [f"Training loss, mean over each window of {window} steps (each run where it logged the whole "
                  "window):", "", f"| steps | {head}", "|---" * 7 + "|"] + rows
    valid = [dict(zip(*read_series(run, "eval", "val_loss"))) for run in runs]
    end_values = None
    rows = []
    for step in sorted(set.union(*(set(v) for v in valid))):
        ref = [v[step] for v in valid[: len(ref_runs)] if step in v]
        other = [v[step] for v in valid[len(ref_runs):] if step in v]
        if ref and other:
            rows.append(_pooled_row(str(step), ref, other))
            if len(ref) > 1:
                end_values = (step, ref, other)
    if rows:
        lines += ["", "Validation loss (held-out split) at each evaluation:", "", f"| step | {head}",
                  "|---" * 7 + "|"] + rows
    if end_values is None:
        raise ConfigError(f"no evaluation that two {labels[0]} runs and one {labels[1]} run all reached")
    step, ref, other = end_values
    return "\n".join(lines + ["", f"Verdict (validation loss at step {step}):", ""]
                     + pooled_verdict(ref, other, tolerance, labels) + _left_out(runs, valid, step)
                     + _not_judged(runs, tuple(labels[i >= len(ref_runs)] for i in range(len(runs))), "eval",
                                   "val_loss", step))


def _left_out(runs: list[str], valid: list[dict[int, float]], step: int) -> list[str]:
    """A line for each run without a validation loss at the verdict's step: a run that stopped early (an FP8 run that
    diverged, say) must not leave the verdict unnamed."""
    return [f"- Left out of the verdict, no validation loss at step {step}: {run} "
            f"({_why_none(logged_values(run, 'eval', 'val_loss'), step, 'evaluation')})"
            for run, v in zip(runs, valid) if step not in v]


def _not_judged(runs: list[str], names: tuple[str, ...], kind: str, metric: str, judged: int) -> list[str]:
    """A line for each run without a finite `metric` at the last step any run logged one, where that comes after
    `judged` (the verdict's step): a run that stopped early, or whose loss went non-finite, moved the verdict back to
    a step where it still looked well, unsaid."""
    logged = [logged_values(run, kind, metric) for run in runs]
    last = max((step for values in logged for step in values), default=judged)
    if last <= judged:
        return []
    return [f"- Not judged at step {last}, the last step a run logged its {metric} at: {name} ({run}), "
            f"{_why_none(values, last, metric)}"
            for name, run, values in zip(names, runs, logged) if not math.isfinite(values.get(last, math.nan))]


def _why_none(logged: dict[int, float], step: int, what: str) -> str:
    """Why a run (its `logged_values`) has no finite value at `step`: not finite there, or not logged that far."""
    if step in logged:
        return "logged there as a nan or inf"
    if not logged:
        return f"no {what}"
    last = max(logged)
    return f"its last at step {last}" + ("" if math.isfinite(logged[last]) else ", a nan or inf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files; the first is the reference "
                        "(with --parity: BF16 seed A, FP8 seed A, then optionally BF16 seed B)")
    parser.add_argument("--skip", type=int, default=0, help="leave steps up to this one out of the timing")
    parser.add_argument("--parity", action="store_true", help="FP8-vs-BF16 parity tables and verdict (see above)")
    parser.add_argument("--window", type=int, default=500, help="--parity, --pooled: steps per training-loss window")
    parser.add_argument("--tolerance", type=positive_number(at_most=1.0, hint=" (a fraction: 0.0025 = 0.25%)"),
                        default=0.0025,
                        help="--parity: largest relative gap of FP8 to BF16 seed A that passes (0.0025 = 0.25%%); "
                        "--pooled: the gap the runs should resolve")
    parser.add_argument("--seeds", nargs=2, default=["A", "B"], metavar=("REF", "OTHER"),
                        help="--parity: the names of the runs' seeds, the reference's (BF16 and FP8) then the other "
                        "BF16 run's (e.g. B A for a second FP8 seed judged against BF16 seed B)")
    parser.add_argument("--worst", type=int, default=5,
                        help="--parity: FP8 tensors listed by lowest SNR and by most underflow")
    parser.add_argument("--gaps", action="store_true", help="every run's gap to the first, per window and "
                        "evaluation (see above)")
    parser.add_argument("--windows", nargs="+", type=parse_window, default=None, metavar="FIRST-LAST",
                        help="--gaps: the windows of training steps (e.g. 501-750 751-1000)")
    parser.add_argument("--labels", nargs="+", default=None, help="--gaps: the runs' names in the table (default: "
                        "their directories' names); --pooled: the two arms' names (default: BF16 FP8)")
    parser.add_argument("--max-loss-gap", type=positive_number(), default=None, metavar="GAP",
                        help="the default table, then a PASS/FAIL line per run: its largest |loss - reference loss| "
                        "within GAP over all the reference's steps; exit status 1 where any fails")
    parser.add_argument("--pooled", action="store_true", help="the runs given are repeats of one configuration, "
                        "compared by their mean with --against's (see above)")
    parser.add_argument("--against", nargs="+", default=None, metavar="RUN",
                        help="--pooled: the other arm's runs (e.g. FP8's repeats)")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error("--window must be at least 1")
    if sum((args.gaps, args.parity, args.pooled)) > 1:
        parser.error("--gaps, --parity and --pooled are different tables: give one")
    if args.pooled and not args.against:
        parser.error("--pooled needs --against RUN... (the other arm's runs)")
    if args.against and not args.pooled:
        parser.error("--against belongs to --pooled")
    if args.pooled and args.labels is not None and len(args.labels) != 2:
        parser.error(f"--pooled takes two --labels (the arms' names), got {len(args.labels)}")
    if args.max_loss_gap is not None and (args.gaps or args.parity or args.pooled):
        parser.error("--max-loss-gap belongs to the default table, not --gaps, --parity or --pooled")
    if args.gaps and not args.windows:
        parser.error("--gaps needs --windows (e.g. --windows 501-750 751-1000)")
    if not args.pooled and args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels names {len(args.labels)} runs, but {len(args.runs)} are given")
    try:
        if args.pooled:
            print(pooled(args.runs, args.against, tuple(args.labels or ("BF16", "FP8")), args.window,
                         args.tolerance))
        elif args.gaps:
            print(gaps(args.runs, args.labels or [Path(run).name for run in args.runs], args.windows))
        elif args.parity:
            print(parity(args.runs, args.window, args.tolerance, args.worst, tuple(args.seeds)))
        else:
            print(compare(args.runs, args.skip))
            if args.max_loss_gap is not None:
                lines, passed = loss_gap_verdict(args.runs, args.max_loss_gap)
                print("\n".join(["", *lines]))
                if not passed:  # on stderr too, where a script's summary takes a failed command's reason from
                    print("\n".join(line for line in lines if "FAIL" in line), file=sys.stderr)
                    return 1
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
