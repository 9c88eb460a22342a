"""tools/compare_runs.py: per-step loss agreement and median speed against a reference run."""
from __future__ import annotations

import json

from tools.compare_runs import compare


def _write(path, losses, norms, times):
    path.mkdir()
    records = [{"kind": "train", "step": i + 1, "loss": l, "grad_norm": g, "step_time_s": t, "tokens_per_s": 100 / t}
               for i, (l, g, t) in enumerate(zip(losses, norms, times))]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_compare_reports_largest_differences_and_median_speed(tmp_path):
    _write(tmp_path / "ref", [3.0, 2.0, 1.0], [1.0, 2.0, 4.0], [9.0, 1.0, 1.0])
    _write(tmp_path / "other", [3.0, 2.5, 1.1], [1.0, 2.0, 5.0], [9.0, 0.5, 0.5])
    table = compare([str(tmp_path / "ref"), str(tmp_path / "other")], skip=1).splitlines()
    assert table[2] == "| ref | 3 | 0.0000 | 0.00% | 1.0000 | 1.0000 | 100 |"
    assert table[3] == "| other | 3 | 0.5000 | 25.00% | 1.1000 | 0.5000 | 200 |"
