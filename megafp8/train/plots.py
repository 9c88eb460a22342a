"""Reading metrics files back and plotting several runs on one figure (matplotlib, imported lazily)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from megafp8.config import ConfigError


def metrics_path(run: str | Path) -> Path:
    """A run directory (holding metrics.jsonl) or a metrics file itself."""
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"no metrics file at {path}: pass a run directory or a metrics.jsonl path")
    return path


def read_records(run: str | Path) -> list[dict]:
    """Every record of a run's metrics file, in order. A last line cut short (a run killed while writing it) is
    left out; any other line that is not a JSON object is a ConfigError naming the file and line."""
    path = metrics_path(run)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.start} is 0x{err.object[err.start]:02x}): it is not a "
                          "metrics file megafp8 wrote; pass the run's metrics.jsonl") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "step" in record and not _is_step(record["step"]):
            raise ConfigError(f"{path} line {number}: step {record['step']!r} is not a whole number: the file is "
                              "damaged; remove or mend that line")
        if isinstance(record, dict):
            records.append(record)
        elif number < len(lines):
            raise ConfigError(f"{path} line {number} is not a metrics record ({line[:60]!r}): the file is damaged; "
                              "remove or mend that line")
    return records


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def logged_values(run: str | Path, kind: str, metric: str) -> dict[int, float]:
    """Each step's last logged `metric` in the `kind` records of a run (a step logged twice: a resumed or repeated
    run writing to the same file), nan where that is not finite (null, as megafp8 writes a nan or inf, or JSON's NaN
    and Infinity): what a comparison must tell from a step never logged."""
    by_step: dict[int, float] = {}
    for record in read_records(run):  # a record without a step (none megafp8 writes) has no place on a curve
        if record.get("kind") != kind or "step" not in record or metric not in record:
            continue
        value = record[metric]
        if isinstance(value, (int, float)) and math.isfinite(value):
            by_step[record["step"]] = float(value)
        elif value is None or isinstance(value, float):
            by_step[record["step"]] = math.nan
    return by_step


def read_series(run: str | Path, kind: str, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` in the `kind` records of a run; a step logged twice (a resumed or repeated
    run writing to the same file) keeps its last value, and where that is not finite (null, as megafp8 writes a
    nan or inf, or JSON's NaN and Infinity) the step has none (a nan would make every mean over it nan)."""
    by_step = {step: value for step, value in logged_values(run, kind, metric).items() if math.isfinite(value)}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def trained_with_mtp(run: str | Path) -> bool:
    """Whether a run's config (its `run` record, written first) has multi-token prediction (`model.mtp_depth` > 0)."""
    info = next((r for r in read_records(run) if r.get("kind") == "run"), {})
    return bool(info.get("config", {}).get("model", {}).get("mtp_depth"))


def lm_loss_field(run: str | Path) -> Optional[str]:
    """The field of a run's train records that holds its language-modelling training loss: `lm_loss`; in a metrics
    file from before that was logged, `loss`, unless the run trained with MTP, whose `loss` held the weighted MTP
    loss too (None: no field holds it)."""
    if logged_values(run, "train", "lm_loss"):
        return "lm_loss"
    return None if trained_with_mtp(run) else "loss"


def splice_warning(run: str | Path) -> Optional[str]:
    """One line if the train records of a run's metrics file go back to an earlier step (several runs, or launches
    of one run, appended to one file: its curve would be spliced), else None."""
    path, last = metrics_path(run), 0
    for number, record in enumerate(read_records(run), 1):
        if record.get("kind") != "train" or not isinstance(record.get("step"), int):
            continue
        if record["step"] <= last:
            return (f"{path} line {number}: steps go back from {last} to {record['step']}: the file holds more than "
                    "one run (or launch); each step is plotted with its last value, so the curve may be spliced")
        last = record["step"]
    return None


def _smoothed(values: list[float], points: int) -> list[float]:
    """Trailing mean over up to `points` values (1: unchanged)."""
    return [sum(values[max(0, i - points + 1):i + 1]) / len(values[max(0, i - points + 1):i + 1])
            for i in range(len(values))]


def run_styles(count: int) -> list[tuple[str, str]]:
    """(colour, line style) for each of `count` runs, no two alike: matplotlib's ten default colours while they
    suffice; past ten, `tab20`'s twenty (its dark and light pairs), then those again dashed, dotted and dash-dotted
    (the default cycle wraps after ten, so an eleventh run was drawn in the first run's colour)."""
    if count <= 10:
        return [(f"C{i}", "-") for i in range(count)]
    import matplotlib

    palette = [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab20"].colors]
    dashes = ["-", "--", ":", "-."]
    return [(palette[i % 20], dashes[(i // 20) % 4]) for i in range(count)]


_LEGENDS_IN_PANELS = 10  # runs up to which each panel has its own legend; past it, one beside the figure


def relative_gaps(reference: tuple[list[int], list[float]], other: tuple[list[int], list[float]]
                  ) -> tuple[list[int], list[float]]:
    """(steps, 100 * (other - reference) / reference) at the steps both runs logged, but where the reference's value
    is 0: no scale to relate a gap to (a metric such as moe_idle_experts at 0 raised a ZeroDivisionError)."""
    ref = dict(zip(*reference))
    pairs = [(s, v) for s, v in zip(*other) if ref.get(s)]
    return [s for s, _ in pairs], [100 * (v - ref[s]) / ref[s] for s, v in pairs]


def _check_out(out: str, supported: dict[str, str]) -> None:
    """Refuse an output path the figure cannot be written to, before any work (matplotlib would fail after it, or
    add ".png" to a name without an ending)."""
    path = Path(out)
    if not path.parent.is_dir():
        raise ConfigError(f"--out {out}: the directory {path.parent} does not exist: create it, or write elsewhere")
    ending = path.suffix.lower().lstrip(".")
    if ending not in supported:
        raise ConfigError(f"--out {out}: give a file ending matplotlib writes ({', '.join(sorted(supported))}), "
                          "e.g. .png")


def plot_runs(runs: list[str], labels: list[str], metrics: list[str], out: str, gaps: bool = False,
              smooth: int = 1, from_step: int = 0) -> list[str]:
    """One panel per metric (`loss`, `val_loss`, `grad_norm`, ... or `kind:field`), one line per run; with `gaps`,
    a second row: each other run's relative gap (%) to the first run, per metric, in that run's colour (none at a step
    where the first run's value is 0). `smooth` > 1
    draws trailing means of train metrics over that many logged points (evaluations are drawn as logged); steps
    before `from_step` are left out. Returns warning lines: one per run whose metrics file holds spliced runs
    (`splice_warning`), one per run and metric that `from_step` leaves without points, one if the figure is empty.
    An `out` it cannot write (no such directory, an ending matplotlib does not write) is refused first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    _check_out(out, FigureCanvasBase.get_supported_filetypes())
    warnings = [w for w in map(splice_warning, runs) if w]

    rows = 2 if gaps and len(runs) > 1 else 1
    fig, axes = plt.subplots(rows, len(metrics), figsize=(5.5 * len(metrics), 4 * rows), squeeze=False)
    drawn = 0
    for column, metric in enumerate(metrics):
        kind, _, field = metric.rpartition(":")
        kind = kind or ("eval" if field.startswith("val_") else "train")
        series = []
        for run in runs:
            # lm_loss of a run from before it was logged: its loss, where that is the same
            logged = (lm_loss_field(run) or field) if (kind, field) == ("train", "lm_loss") else field
            steps, values = read_series(run, kind, logged)
            if not steps:
                raise ConfigError(f"run {run} has no '{field}' in its '{kind}' records")
            kept = [i for i, s in enumerate(steps) if s >= from_step]
            if not kept:
                warnings.append(f"run {run} logged '{field}' up to step {steps[-1]} only: --from-step {from_step} "
                                "leaves none of it to draw")
            series.append(([steps[i] for i in kept], [values[i] for i in kept]))
            drawn += len(kept)
        points = smooth if kind == "train" else 1
        styles = run_styles(len(runs))
        panels = [(axes[0][column], field, list(zip(series, labels, styles)))]
        if rows == 2:
            gap_series = [relative_gaps(series[0], other) for other in series[1:]]
            panels.append((axes[1][column], f"{field}: % vs {labels[0]}",
                           list(zip(gap_series, labels[1:], styles[1:]))))
            axes[1][column].axhline(0.0, color=styles[0][0], linewidth=0.8)
        for ax, title, lines in panels:
            for (steps, values), label, (colour, dash) in lines:
                ax.plot(steps, _smoothed(values, points), label=label, color=colour, linestyle=dash,
                        marker="o" if len(steps) < 30 else None, markersize=3)
            ax.set_xlabel("step")
            ax.set_ylabel(title)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if len(runs) <= _LEGENDS_IN_PANELS:
                ax.legend()
    if not drawn:  # written all the same (a script's plot step stays whole), but never without a word
        warnings.append(f"--from-step {from_step} leaves no point of any run to draw: the figure is empty")
    fig.tight_layout()
    if len(runs) > _LEGENDS_IN_PANELS:  # one legend beside the panels: one in each would cover their curves
        fig.legend(*axes[0][0].get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize="small")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return warnings
