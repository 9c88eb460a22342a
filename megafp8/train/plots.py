"""Reading metrics files back and plotting several runs on one figure (matplotlib, imported lazily)."""
from __future__ import annotations

import json
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


def read_series(run: str | Path, kind: str, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` in the `kind` records of a run; a step logged twice (a resumed or repeated
    run writing to the same file) keeps its last value."""
    by_step: dict[int, float] = {}
    for line in metrics_path(run).read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == kind and isinstance(record.get(metric), (int, float)):
            by_step[int(record["step"])] = float(record[metric])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def splice_warning(run: str | Path) -> Optional[str]:
    """One line if the train records of a run's metrics file go back to an earlier step (several runs, or launches
    of one run, appended to one file: its curve would be spliced), else None."""
    path, last = metrics_path(run), 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        record = json.loads(line)
        if record.get("kind") != "train" or not isinstance(record.get("step"), int):
            continue
        if record["step"] <= last:
            return (f"{path} line {number}: steps go back from {last} to {record['step']}: the file holds more than "
                    "one run (or launch); each step is plotted with its last value, so the curve may be spliced")
        last = record["step"]
    return None


def plot_runs(runs: list[str], labels: list[str], metrics: list[str], out: str) -> list[str]:
    """One panel per metric (`loss`, `val_loss`, `grad_norm`, ... or `kind:field`), one line per run. Returns one
    warning line per run whose metrics file holds spliced runs (`splice_warning`)."""
    warnings = [w for w in map(splice_warning, runs) if w]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        kind, _, field = metric.rpartition(":")
        kind = kind or ("eval" if field.startswith("val_") else "train")
        for run, label in zip(runs, labels):
            steps, values = read_series(run, kind, field)
            if not steps:
                raise ConfigError(f"run {run} has no '{field}' in its '{kind}' records")
            ax.plot(steps, values, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(field)
        ax.set_title(field)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return warnings
