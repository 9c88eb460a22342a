"""tools/plot_runs.py: metrics of several runs on one PNG; the last value wins for a step logged twice."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megafp8.config import ConfigError
from megafp8.train.plots import read_series, relative_gaps, run_styles, splice_warning
from tests.conftest import REPO, torchrun_env


def write_run(path, losses, extra=()):
    path.mkdir(parents=True)
    records = [{"kind": "run"}] + [{"kind": "train", "step": i + 1, "loss": v} for i, v in enumerate(losses)]
    records += [{"kind": "eval", "step": 2, "val_loss": 3.0}, *extra]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_read_series_keeps_the_last_value_of_a_step(tmp_path):
    write_run(tmp_path / "a", [5.0, 4.0], extra=[{"kind": "train", "step": 2, "loss": 3.5}])
    assert read_series(tmp_path / "a", "train", "loss") == ([1, 2], [5.0, 3.5])
    assert read_series(tmp_path / "a", "eval", "val_loss") == ([2], [3.0])
    with pytest.raises(ConfigError, match="no metrics file"):
        read_series(tmp_path / "missing", "train", "loss")


def test_a_non_finite_value_leaves_its_step_without_one_even_where_an_earlier_launch_logged_it(tmp_path):
    """megafp8 writes a non-finite loss as null; a file holding NaN or Infinity (JSON's extensions, which Python's
    json writes) gave nan means and a statistics traceback in compare_runs.py --pooled. Both now leave the step
    without a value, and as the last record of a step wins, a resumed launch's null at a step replaces the value
    the first launch logged there (which was kept)."""
    write_run(tmp_path / "a", [5.0, 4.0, 3.0, 2.0])
    path = tmp_path / "a" / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"kind": "train", "step": 2, "loss": null}\n{"kind": "train", "step": 3, "loss": NaN}\n'
                '{"kind": "train", "step": 4, "loss": Infinity}\n{"kind": "train", "step": 5, "loss": 1.5}\n')
    assert read_series(tmp_path / "a", "train", "loss") == ([1, 5], [5.0, 1.5])
    from tools.compare_runs import pooled

    runs = []
    for name, final in (("b1", 3.0), ("b2", 3.01), ("f1", 3.0), ("f2", 3.02), ("f3", "NaN")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(f'{{"kind": "eval", "step": 10, "val_loss": {final}}}\n')
        runs.append(str(tmp_path / name))
    report = pooled(runs[:2], runs[2:], ("BF16", "FP8"), window=10, tolerance=0.0025)
    assert "| 10 | 3.0000, 3.0100 | 3.0050 | 0.333% | 3.0000, 3.0200 | 3.0100 | +0.166% |" in report, report


def test_a_line_cut_short_at_the_end_is_left_out_and_a_damaged_one_elsewhere_is_named(tmp_path):
    """A run killed while it appended a record leaves half a line at the end of metrics.jsonl: plots and
    comparisons read the rest (they raised a JSONDecodeError). A bad line anywhere else is an error naming it."""
    write_run(tmp_path / "a", [5.0, 4.0])
    path = tmp_path / "a" / "metrics.jsonl"
    whole = path.read_text()
    path.write_text(whole + '{"kind": "train", "step": 3, "lo')
    assert read_series(tmp_path / "a", "train", "loss") == ([1, 2], [5.0, 4.0])
    path.write_text(whole.replace('"step": 2, "loss": 4.0}', '"step": 2, "lo', 1))
    with pytest.raises(ConfigError, match=r"metrics.jsonl line 3 is not a metrics record .*: the file is damaged"):
        read_series(tmp_path / "a", "train", "loss")
    write_run(tmp_path / "b", [5.0, 4.1])
    result = subprocess.run([sys.executable, "tools/compare_runs.py", str(tmp_path / "a"), str(tmp_path / "b")],
                            cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "line 3" in result.stderr, \
        result.stderr


def test_command_line_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "bf16", [5.0, 4.0, 3.0])
    write_run(tmp_path / "fp8", [5.0, 4.1, 3.1])
    out = tmp_path / "runs.png"
    cmd = [sys.executable, "tools/plot_runs.py", str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--labels", "BF16",
           "FP8", "--metrics", "loss", "val_loss", "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(cmd[:-2] + ["--metrics", "nonsense", "--out", str(out)], cwd=REPO, env=torchrun_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "has no 'nonsense'" in bad.stderr


def test_lm_loss_of_a_run_from_before_it_was_logged_is_its_loss_unless_it_trained_with_mtp(tmp_path):
    """`--metrics lm_loss` sets a run with MTP beside runs without it, older ones too: a metrics file from before
    `lm_loss` was logged has the LM loss in `loss`, but where the run trained with MTP that held the MTP loss too."""
    pytest.importorskip("matplotlib")
    from megafp8.train.plots import plot_runs

    write_run(tmp_path / "plain", [5.0, 4.0])
    write_run(tmp_path / "mtp", [5.9, 4.9])
    mtp = tmp_path / "mtp" / "metrics.jsonl"
    mtp.write_text(mtp.read_text().replace('9}', '9, "lm_loss": 4.5}'))
    out = tmp_path / "lm.png"
    assert plot_runs([str(tmp_path / "plain"), str(tmp_path / "mtp")], ["plain", "mtp"], ["lm_loss"], str(out)) == []
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    old = tmp_path / "old_mtp" / "metrics.jsonl"
    write_run(old.parent, [5.9, 4.9])
    old.write_text(old.read_text().replace('{"kind": "run"}', '{"kind": "run", "config": {"model": {"mtp_depth": 1}}}'))
    with pytest.raises(ConfigError, match="old_mtp has no 'lm_loss' in its 'train' records"):
        plot_runs([str(old.parent)], ["old"], ["lm_loss"], str(out))


def test_steps_that_go_back_are_warned_about(tmp_path):
    """0800a78 drew three launches appended to one file as one curve, silently."""
    write_run(tmp_path / "a", [5.0, 4.0, 3.0], extra=[{"kind": "train", "step": 1, "loss": 5.5}])
    assert splice_warning(tmp_path / "a") == (f"{tmp_path / 'a' / 'metrics.jsonl'} line 6: steps go back from 3 to 1: "
                                              "the file holds more than one run (or launch); each step is plotted "
                                              "with its last value, so the curve may be spliced")
    write_run(tmp_path / "b", [5.0, 4.0])
    assert splice_warning(tmp_path / "b") is None
    if pytest.importorskip("matplotlib"):
        result = subprocess.run([sys.executable, "tools/plot_runs.py", str(tmp_path / "a"), "--out",
                                 str(tmp_path / "a.png")], cwd=REPO, env=torchrun_env(), capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0 and result.stderr.startswith("warning: ") and "steps go back" in result.stderr


def test_three_runs_with_their_gaps_to_the_first(tmp_path):
    """Issue 22's parity plot: BF16 seed A, FP8 seed A, BF16 seed B, and each one's gap to BF16 A."""
    assert relative_gaps(([1, 2, 3], [2.0, 4.0, 5.0]), ([2, 3, 4], [5.0, 4.5, 1.0])) == ([2, 3], [25.0, -10.0])
    pytest.importorskip("matplotlib")
    for name, scale in (("bf16_a", 1.0), ("fp8_a", 1.002), ("bf16_b", 0.999)):
        write_run(tmp_path / name, [scale * (5.0 - 0.01 * s) for s in range(100)])
    out = tmp_path / "parity.png"
    result = subprocess.run([sys.executable, "tools/plot_runs.py", *(str(tmp_path / n) for n in ("bf16_a", "fp8_a",
                             "bf16_b")), "--labels", "BF16 seed A", "FP8 seed A", "BF16 seed B", "--metrics", "loss",
                             "val_loss", "--gaps", "--smooth", "5", "--from-step", "10", "--out", str(out)],
                            cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_run_gets_its_own_colour_and_line_style_past_ten_runs():
    """The MoE repeats' plot drew twelve runs; matplotlib's default colours wrap after ten, so the eleventh and
    twelfth took the first two runs' colours."""
    assert run_styles(3) == [("C0", "-"), ("C1", "-"), ("C2", "-")]
    pytest.importorskip("matplotlib")
    for count in (11, 12, 20, 45):
        styles = run_styles(count)
        assert len(styles) == count and len(set(styles)) == count, count
    assert run_styles(21)[20] == (run_styles(21)[0][0], "--")


def test_past_ten_runs_one_legend_sits_beside_the_panels(tmp_path):
    """Eighteen runs' legends, one in each panel, covered the curves of the MoE repeats' plot: past ten runs the
    figure has one legend, outside the panels (so the image is wider than its panels), and up to ten each panel
    keeps its own (the image no wider)."""
    pytest.importorskip("matplotlib")
    from megafp8.train.plots import plot_runs

    runs = []
    for i in range(12):
        write_run(tmp_path / f"r{i}", [5.0, 4.0 + i / 100, 3.0])
        runs.append(str(tmp_path / f"r{i}"))

    def width(count):
        out = tmp_path / f"{count}.png"
        plot_runs(runs[:count], [f"run {i}" for i in range(count)], ["loss", "val_loss"], str(out), gaps=True)
        return int.from_bytes(out.read_bytes()[16:20], "big")  # the PNG header's width

    panels = 2 * 5.5 * 120  # two panels of 5.5 inches at 120 dpi
    assert width(10) <= panels < width(12) - 100


def test_a_bad_metrics_file_or_output_is_one_error_before_any_work(tmp_path):
    """A metrics file that is not UTF-8 (UnicodeDecodeError's traceback), a step that is not a whole number
    (ValueError's), an --out in a missing directory or with an ending matplotlib does not write (an error after
    the plotting, or "wrote x" for a file saved as x.png): each is one error, and nothing is written. A --from-step
    past a run's points (an empty panel or figure, without a word) is a warning: scripts' plot steps stay whole."""
    pytest.importorskip("matplotlib")
    from megafp8.train.plots import plot_runs

    write_run(tmp_path / "a", [5.0, 4.0])
    (tmp_path / "latin.jsonl").write_bytes(b'{"kind": "train", "step": 1, "loss": 1.0, "note": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"latin.jsonl is not UTF-8 text \(byte 54 is 0xe9\)"):
        read_series(tmp_path / "latin.jsonl", "train", "loss")
    (tmp_path / "step.jsonl").write_text('{"kind": "train", "step": "x", "loss": 1.0}\n'
                                         '{"kind": "train", "step": 2, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match=r"step.jsonl line 1: step 'x' is not a whole number"):
        read_series(tmp_path / "step.jsonl", "train", "loss")
    run = [str(tmp_path / "a")]
    for out, message in ((tmp_path / "no" / "x.png", r"the directory .*no does not exist: create it"),
                         (tmp_path / "x.xyz", "give a file ending matplotlib writes"),
                         (tmp_path / "noext", r"give a file ending matplotlib writes \(.*png.*\), e.g. .png")):
        with pytest.raises(ConfigError, match=message):
            plot_runs(run, ["a"], ["loss"], str(out))
    warnings = plot_runs(run, ["a"], ["loss", "val_loss"], str(tmp_path / "late.png"), from_step=100)
    assert warnings[-1] == "--from-step 100 leaves no point of any run to draw: the figure is empty", warnings
    (tmp_path / "late.png").unlink()
    write_run(tmp_path / "b", [5.0, 4.0, 3.0])  # losses to step 3, one evaluation at step 2: one panel left empty
    warnings = plot_runs([str(tmp_path / "b")], ["b"], ["loss", "val_loss"], str(tmp_path / "b.png"), from_step=3)
    assert warnings == [f"run {tmp_path / 'b'} logged 'val_loss' up to step 2 only: --from-step 3 leaves none of it "
                        "to draw"], warnings
    (tmp_path / "b.png").unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "latin.jsonl", "step.jsonl"]


def test_a_gap_to_a_reference_value_of_zero_is_left_out_not_a_traceback(tmp_path):
    """`--gaps` of a metric the first run logged as 0 at some step (moe_idle_experts, skipped steps) raised a
    ZeroDivisionError's traceback: 0 is no scale to relate a gap to, so that step has none."""
    assert relative_gaps(([1, 2, 3], [0.0, 4.0, 5.0]), ([1, 2, 3], [0.5, 5.0, 4.5])) == ([2, 3], [25.0, -10.0])
    pytest.importorskip("matplotlib")
    from megafp8.train.plots import plot_runs

    for name, idle in (("a", [0.0, 0.25]), ("b", [0.5, 0.25])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"kind": "train", "step": i + 1, "loss": 4.0, "moe_idle_experts": v}) + "\n"
            for i, v in enumerate(idle)))
    assert plot_runs([str(tmp_path / "a"), str(tmp_path / "b")], ["a", "b"], ["moe_idle_experts"],
                     str(tmp_path / "idle.png"), gaps=True) == []
