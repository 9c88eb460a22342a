"""tools/compare_runs.py: per-step loss agreement and median speed against a reference run; FP8-vs-BF16 parity."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from megafp8.config import ConfigError
from tests.conftest import REPO, torchrun_env
from tools.compare_runs import (compare, gaps, loss_gap_verdict, mann_whitney, parity, pooled, rank_check, t_critical,
                                welch)


def _write(path, losses, norms, times):
    path.mkdir()
    records = [{"kind": "train", "step": i + 1, "loss": l, "grad_norm": g, "step_time_s": t, "tokens_per_s": 100 / t}
               for i, (l, g, t) in enumerate(zip(losses, norms, times))]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_compare_reports_largest_differences_and_median_speed(tmp_path):
    _write(tmp_path / "ref", [3.0, 2.0, 1.0], [1.0, 2.0, 4.0], [9.0, 1.0, 1.0])
    _write(tmp_path / "other", [3.0, 2.5, 1.1], [1.0, 2.0, 5.0], [9.0, 0.5, 0.5])
    table = compare([str(tmp_path / "ref"), str(tmp_path / "other")], skip=1).splitlines()
    assert table[0].startswith("| run | steps compared | max abs LM loss diff | max grad-norm rel diff | final LM loss |")
    assert table[2] == "| ref | 3 | 0.0000 | 0.00% | 1.0000 | 1.0000 | 100 |"
    assert table[3] == "| other | 3 | 0.5000 | 25.00% | 1.1000 | 0.5000 | 200 |"


def _write_mtp_run(path, losses, lm_losses=None):
    """A run that trained with MTP (its run record says so): its `loss` holds the weighted MTP loss; `lm_losses`
    logged beside it, or not (a metrics file from before `lm_loss` was)."""
    path.mkdir()
    records = [{"kind": "run", "config": {"model": {"mtp_depth": 1, "mtp_loss_weight": 0.3}}}]
    for i, loss in enumerate(losses):
        parts = {} if lm_losses is None else {"lm_loss": lm_losses[i], "mtp_loss": (loss - lm_losses[i]) / 0.3}
        records.append({"kind": "train", "step": i + 1, "loss": loss, **parts})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_a_run_with_mtp_compares_with_one_without_on_its_language_modelling_loss(tmp_path):
    """The training loss of a run with MTP holds the weighted MTP loss (here 0.9 above the LM loss): compared as it
    was, `loss` against `loss`, the MTP run looked 0.9 worse than a run without MTP whose model is as good."""
    _write(tmp_path / "plain", [3.0, 2.0, 1.0], [1.0] * 3, [1.0] * 3)
    mtp = _write_mtp_run(tmp_path / "mtp", [3.9, 2.9, 1.9], lm_losses=[3.0, 2.0, 1.1])
    table = compare([str(tmp_path / "plain"), mtp], skip=0).splitlines()
    assert table[3].startswith("| mtp | 3 | 0.1000 | nan% | 1.1000 |"), table  # (no grad norms logged)
    assert "| max abs LM loss diff |" in table[0] and "| final LM loss |" in table[0], table[0]
    lines, passed = loss_gap_verdict([str(tmp_path / "plain"), mtp], 0.05)
    assert not passed and lines == ["- **FAIL** mtp: max |loss gap| 0.1000 at step 3, above 0.05"]
    old = _write_mtp_run(tmp_path / "old_mtp", [3.9, 2.9, 1.9])  # before lm_loss: only the total is known
    with pytest.raises(ConfigError, match="old_mtp trained with MTP before lm_loss was logged"):
        compare([str(tmp_path / "plain"), old], skip=0)
    old_too = _write_mtp_run(tmp_path / "old_mtp_2", [3.8, 2.9, 1.9])  # alike: total against total, as they were
    totals = compare([old, old_too], skip=0).splitlines()
    assert totals[3].startswith("| old_mtp_2 | 3 | 0.1000 |")
    assert "| max abs loss (LM + weighted MTP) diff |" in totals[0], totals[0]


def test_max_loss_gap_fails_a_run_beyond_it_or_cut_short_with_exit_status_1(tmp_path):
    """--max-loss-gap: PASS within the gap over every step the reference logged; a larger gap, a run cut short or a
    non-finite loss fails, on stdout and stderr, with exit status 1 (a script's step then records it as failed)."""
    _write(tmp_path / "ref", [3.0, 2.0, 1.0], [1.0] * 3, [1.0] * 3)
    _write(tmp_path / "close", [3.01, 2.04, 1.0], [1.0] * 3, [1.0] * 3)
    _write(tmp_path / "far", [3.0, 2.06, 1.0], [1.0] * 3, [1.0] * 3)
    _write(tmp_path / "cut", [3.0, 2.0], [1.0] * 2, [1.0] * 2)
    _write(tmp_path / "nan", [3.0, math.nan, 1.0], [1.0] * 3, [1.0] * 3)

    def run(*names):
        return subprocess.run([sys.executable, "tools/compare_runs.py", *(str(tmp_path / n) for n in names),
                               "--max-loss-gap", "0.05"], cwd=REPO, env=torchrun_env(), capture_output=True,
                              text=True, timeout=120)
    passed = run("ref", "close")
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout.splitlines()[-1] == "- **PASS** close: max |loss gap| 0.0400 (step 2) within 0.05 over 3 steps"
    failed = run("ref", "close", "far", "cut", "nan")
    assert failed.returncode == 1
    expected = ["- **FAIL** far: max |loss gap| 0.0600 at step 2, above 0.05",
                "- **FAIL** cut: a finite loss at 2 of the reference's 3 steps (cut short, or non-finite losses)",
                "- **FAIL** nan: a finite loss at 2 of the reference's 3 steps (cut short, or non-finite losses)"]
    assert failed.stdout.splitlines()[-4:] == [passed.stdout.splitlines()[-1]] + expected
    assert failed.stderr.splitlines() == expected
    refused = subprocess.run([sys.executable, "tools/compare_runs.py", str(tmp_path / "ref"), "--gaps", "--windows",
                              "1-3", "--max-loss-gap", "0.05"], cwd=REPO, env=torchrun_env(), capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "--max-loss-gap belongs to the default table" in refused.stderr


def _write_run(path, loss_at, val_at, steps=1000, eval_every=500, health=None):
    """A run logging its training loss every 10 steps and validation loss every `eval_every` steps."""
    path.mkdir()
    records = [{"kind": "run"}]
    for step in range(10, steps + 1, 10):
        records.append({"kind": "train", "step": step, "loss": loss_at(step), "grad_norm": 1.0, "step_time_s": 0.25,
                        "tokens_per_s": 65536.0})
        if step % eval_every == 0:
            records.append({"kind": "eval", "step": step, "val_loss": val_at(step)})
    if health:
        records.append({"kind": "fp8_health", "step": steps, "layers": health})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def _parity_runs(tmp_path, fp8_val_end, bf16_b_val_end, health=None):
    """BF16 A ends at validation loss 2.0; FP8 A and BF16 B end where told; training losses 1% apart."""
    bf16_a = _write_run(tmp_path / "bf16_a", lambda s: 4.0 - s / 1000, lambda s: 2.0 + (1000 - s) / 1000)
    fp8_a = _write_run(tmp_path / "fp8_a", lambda s: (4.0 - s / 1000) * 1.01,
                       lambda s: fp8_val_end + (1000 - s) / 1000, health=health)
    bf16_b = _write_run(tmp_path / "bf16_b", lambda s: (4.0 - s / 1000) * 0.99,
                        lambda s: bf16_b_val_end + (1000 - s) / 1000)
    return [bf16_a, fp8_a, bf16_b]


def test_parity_tables_per_window_and_per_evaluation(tmp_path):
    health = {"layers.0.attn.qkv": {"input": {"amax": 3.0, "underflow": 0.001, "at_max": 0.008, "snr_db": 31.0},
                                    "grad": {"amax": 0.01, "underflow": 0.2, "at_max": 0.008, "snr_db": 12.5}},
              "layers.1.mlp.down": {"weight": {"amax": 0.1, "underflow": 0.0, "at_max": 0.008, "snr_db": 30.0}}}
    report = parity(_parity_runs(tmp_path, 2.002, 1.996, health), window=500, tolerance=0.0025, worst=2)
    lines = report.splitlines()
    assert "| steps | BF16 A | FP8 A | BF16 B | FP8 vs BF16 A | BF16 B vs BF16 A (seed spread) |" in lines
    # Window 1-500: mean of 4 - s/1000 over s = 10..500 is 3.745.
    assert "| 1-500 | 3.7450 | 3.7824 | 3.7075 | +1.000% | -1.000% |" in lines
    assert "| 501-1000 | 3.2450 | 3.2774 | 3.2125 | +1.000% | -1.000% |" in lines
    assert "| 500 | 2.5000 | 2.5020 | 2.4960 | +0.080% | -0.160% |" in lines
    assert "| 1000 | 2.0000 | 2.0020 | 1.9960 | +0.100% | -0.200% |" in lines
    assert "Verdict (validation loss at step 1000):" in lines
    assert lines[lines.index("Verdict (validation loss at step 1000):") + 2:][:4] == [
        "- FP8 vs BF16 A: +0.100%, within 0.25%: yes",
        "- BF16 seed-to-seed spread |BF16 B - BF16 A|: 0.200%; |FP8 - BF16 A| = 0.100%: inside the spread",
        "- FP8 vs the mean of the two BF16 seeds: +0.200% (for reference, not a criterion)",
        "- **PASS**: FP8 is within 0.25% of BF16 seed A and inside the BF16 seed-to-seed spread"]
    # The worst FP8 tensors by SNR, lowest first, then by underflow, most first.
    by_snr = lines.index("FP8 health at step 1000, the 2 tensors with the lowest SNR:")
    assert lines[by_snr + 4:by_snr + 6] == ["| layers.0.attn.qkv | grad | 12.5 | 20.00% | 0.80% | 0.01 |",
                                            "| layers.1.mlp.down | weight | 30.0 | 0.00% | 0.80% | 0.1 |"]
    assert lines[-7:] == ["", "The 2 tensors with the most underflow:", "",
                          "| layer | tensor | SNR (dB) | underflow | at FP8 max | max-abs |",
                          "|---|---|---|---|---|---|",
                          "| layers.0.attn.qkv | grad | 12.5 | 20.00% | 0.80% | 0.01 |",
                          "| layers.0.attn.qkv | input | 31.0 | 0.10% | 0.80% | 3 |"]


def test_a_tensor_whose_health_is_not_finite_ranks_worst_in_both_tables(tmp_path):
    """A tensor holding a nan has no finite SNR or underflow: its record is written with nulls (the metrics file
    stays strict JSON), and the parity report lists it first in both tables as "n/a" (a nan sorted anywhere, and a
    null raised a TypeError)."""
    from megafp8.train.metrics import MetricsFile

    path = tmp_path / "fp8_a" / "metrics.jsonl"
    MetricsFile(path, True).write({"kind": "fp8_health", "step": 1000, "layers": {
        "layers.0.attn.qkv": {"grad": {"amax": math.inf, "underflow": math.nan, "at_max": 0.0, "snr_db": math.nan},
                              "input": {"amax": 3.0, "underflow": 0.001, "at_max": 0.008, "snr_db": 31.0}},
        "layers.1.mlp.down": {"weight": {"amax": 0.1, "underflow": 0.3, "at_max": 0.008, "snr_db": 30.0}},
        "layers.1.moe.experts": {"grad": {"amax": 0.0, "underflow": 0.0, "at_max": 0.0, "snr_db": math.inf}}}})
    text = path.read_text()  # (an idle expert's gradient: zeros, quantized exactly, not a tensor in trouble)
    assert "NaN" not in text and "Infinity" not in text and '"snr_db": null' in text, text
    saved = json.loads(text)["layers"]
    (tmp_path / "runs").mkdir()
    runs = _parity_runs(tmp_path / "runs", 2.002, 1.996, health=saved)
    lines = parity(runs, window=500, tolerance=0.0025, worst=2).splitlines()
    by_snr = lines.index("FP8 health at step 1000, the 2 tensors with the lowest SNR:")
    assert lines[by_snr + 4:by_snr + 6] == ["| layers.0.attn.qkv | grad | n/a | n/a | 0.00% | n/a |",
                                            "| layers.1.mlp.down | weight | 30.0 | 30.00% | 0.80% | 0.1 |"], lines
    assert lines[-2:] == ["| layers.0.attn.qkv | grad | n/a | n/a | 0.00% | n/a |",
                          "| layers.1.mlp.down | weight | 30.0 | 30.00% | 0.80% | 0.1 |"], lines


@pytest.mark.parametrize("fp8_end, bf16_b_end, verdict", [
    (2.006, 1.990, "- **FAIL**: FP8 is not within 0.25% of BF16 seed A"),  # 0.3% off, inside a 0.5% spread
    (1.997, 1.999, "- **FAIL**: FP8 is outside the BF16 seed-to-seed spread"),  # 0.15% off, spread 0.05%
    (2.010, 2.001, "- **FAIL**: FP8 is not within 0.25% of BF16 seed A and outside the BF16 seed-to-seed spread"),
])
def test_parity_verdict_fails_each_criterion(tmp_path, fp8_end, bf16_b_end, verdict):
    report = parity(_parity_runs(tmp_path, fp8_end, bf16_b_end), window=500, tolerance=0.0025, worst=5)
    assert report.splitlines()[-1] == verdict  # no FP8 health records: the verdict ends the report


def test_parity_with_one_seed_each_and_bad_calls(tmp_path):
    bf16_a, fp8_a, _ = _parity_runs(tmp_path, 2.001, 2.0)
    lines = parity([bf16_a, fp8_a], window=300, tolerance=0.0025, worst=5).splitlines()
    assert "| steps | BF16 A | FP8 A | FP8 vs BF16 A |" in lines and "| 901-1000 | 3.0450 | 3.0755 | +1.000% |" in lines
    assert lines[-2:] == ["- BF16 seed-to-seed spread: not measured (no BF16 seed B run)",
                          "- **PASS** on the 0.25% criterion alone (one seed each: FP8's gap cannot be told from "
                          "seed noise)"]
    with pytest.raises(ConfigError, match="--parity takes 2 or 3 runs"):
        parity([bf16_a], window=500, tolerance=0.0025, worst=5)


def test_parity_command_line_and_the_default_mode_unchanged(tmp_path):
    runs = _parity_runs(tmp_path, 2.002, 1.996)
    result = subprocess.run([sys.executable, "tools/compare_runs.py", "--parity", *runs, "--window", "250"], cwd=REPO,
                            env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| 751-1000 |" in result.stdout and "**PASS**" in result.stdout
    plain = subprocess.run([sys.executable, "tools/compare_runs.py", *runs], cwd=REPO, env=torchrun_env(),
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and plain.stdout.splitlines()[0].startswith("| run | steps compared |")


def test_gaps_put_every_run_against_the_first_and_mark_where_a_cut_run_did_not_reach(tmp_path):
    """`--gaps`: the reference's own values, then each run's relative gap per window (mean training loss) and per
    evaluation; a run cut at step 840 gets "-" for a window past its end and for the evaluation it did not reach."""
    ref = _write_run(tmp_path / "ref", lambda s: 4.0 - s / 1000, lambda s: 2.0)
    worse = _write_run(tmp_path / "worse", lambda s: (4.0 - s / 1000) * 1.02, lambda s: 2.01)
    cut = _write_run(tmp_path / "cut", lambda s: (4.0 - s / 1000) * 0.99, lambda s: 1.98, steps=840)
    lines = gaps([ref, worse, cut], ["BF16", "FP8", "FP8, cut"], [(501, 750), (751, 840), (751, 1000)]).splitlines()
    assert lines[0] == ("| run | train loss, 501-750 | train loss, 751-840 | train loss, 751-1000 | "
                        "validation loss, step 500 | validation loss, step 1000 |")
    assert lines[2] == "| BF16 | 3.3700 | 3.2000 | 3.1200 | 2.0000 | 2.0000 |"  # steps logged every 10
    assert lines[3] == "| FP8 | +2.00% | +2.00% | +2.00% | +0.500% | +0.500% |"
    assert lines[4] == "| FP8, cut | -1.00% | -1.00% | - | -1.000% | - |"
    with pytest.raises(ConfigError, match="logged no training step in 2001-2100"):
        gaps([ref, worse], ["a", "b"], [(2001, 2100)])
    with pytest.raises(ConfigError, match="1 labels for 2 runs"):
        gaps([ref, worse], ["a"], [(1, 100)])


def test_gaps_compare_a_sparser_log_on_the_steps_both_logged_and_name_a_window_by_the_reference_s_end(tmp_path):
    """A finished run logging every 20 steps is compared over the steps both runs logged (not marked "-" as a run
    cut short is); a reference that ends inside a window names the window by its last step."""
    ref = _write_run(tmp_path / "ref", lambda s: 4.0 - s / 1000, lambda s: 2.0, steps=900)
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    records = [{"kind": "train", "step": s, "loss": (4.0 - s / 1000) * 1.01, "grad_norm": 1.0, "step_time_s": 0.2,
                "tokens_per_s": 1.0} for s in range(20, 1001, 20)]
    (sparse / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    lines = gaps([ref, str(sparse)], ["ref", "sparse"], [(1, 500), (501, 1000)]).splitlines()
    assert lines[0] == "| run | train loss, 1-500 | train loss, 501-900 | validation loss, step 500 |"
    assert lines[3] == "| sparse | +1.00% | +1.00% | - |"


def test_gaps_command_line_refuses_what_it_cannot_draw(tmp_path):
    ref = _write_run(tmp_path / "ref", lambda s: 4.0 - s / 1000, lambda s: 2.0)
    other = _write_run(tmp_path / "other", lambda s: 4.1 - s / 1000, lambda s: 2.1)

    def run(*args):
        return subprocess.run([sys.executable, "tools/compare_runs.py", *args], cwd=REPO, env=torchrun_env(),
                              capture_output=True, text=True, timeout=120)
    ok = run("--gaps", ref, other, "--windows", "1-500", "501-1000")
    assert ok.returncode == 0 and ok.stdout.splitlines()[3].startswith("| other | +"), ok.stdout + ok.stderr
    for args, message in ((["--gaps", ref, other], "--gaps needs --windows"),
                          (["--gaps", ref, other, "--windows", "500-1"], "is not a window of steps"),
                          (["--gaps", ref, other, "--windows", "1-10", "--labels", "x"], "--labels names 1 runs"),
                          (["--gaps", "--parity", ref, other, "--windows", "1-10"], "different tables")):
        result = run(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


def _repeats(tmp_path, name, finals, steps=(1000,) * 3):
    """Runs of one configuration whose validation loss ends at each of `finals` (training loss likewise)."""
    return [_write_run(tmp_path / f"{name}_{i}", lambda s, f=final: f + (1000 - s) / 1000, lambda s, f=final: f,
                       steps=last) for i, (final, last) in enumerate(zip(finals, steps))]


def test_pooled_compares_the_arms_means_against_the_reference_arm_s_own_range(tmp_path):
    """`--pooled`: each arm's runs and mean per window and evaluation, the reference's range, the other's gap;
    the verdict says inside or outside the reference's repeats' range, the standard error of the difference, and
    how many runs an arm would resolve the tolerance. A run cut at step 600 counts where it got to, and the verdict
    names it as left out (a diverged run must not vanish from it unnamed)."""
    bf16 = _repeats(tmp_path, "bf16", [3.00, 3.03, 3.015])
    fp8 = _repeats(tmp_path, "fp8", [3.02, 3.03, 3.5], steps=(1000, 1000, 600))
    report = pooled(bf16, fp8, ("BF16 B", "FP8 B"), window=500, tolerance=0.0025)
    assert "| 501-1000 | 3.2450, 3.2750, 3.2600 | 3.2600 | 0.920% | 3.2650, 3.2750 | 3.2700 | +0.307% |" in report
    assert "| 500 | 3.0000, 3.0300, 3.0150 | 3.0150 | 0.995% | 3.0200, 3.0300, 3.5000 | 3.1833 | +5.583% |" \
        in report, report  # the cut run's evaluation at step 500 counts
    assert "| 1000 | 3.0000, 3.0300, 3.0150 | 3.0150 | 0.995% | 3.0200, 3.0300 | 3.0250 | +0.332% |" in report
    assert "- BF16 B's run-to-run range at one seed (3 runs): 0.995% of their mean; sample deviation 0.498%" in report
    assert "- FP8 B's mean (2 runs) vs BF16 B's: +0.332%, standard error 0.332%: inside BF16 B's range" in report
    assert report.endswith(f"- Left out of the verdict, no validation loss at step 1000: {fp8[2]} (its last at step "
                           "500)"), report
    assert "Left out" not in pooled(bf16, fp8[:2], ("BF16 B", "FP8 B"), window=500, tolerance=0.0025)
    assert "cannot resolve 0.25% (the 95% bound is 1.427%): at this deviation that takes ~32 runs an arm" \
        in report, report
    # Welch's t test at 2.9 degrees of freedom (rounded down to 2: t = 4.30), not the normal distribution's 1.96
    assert ("**INSIDE the run-to-run noise** (Welch's t test, 95%): the difference of the means is 1.00 standard "
            "errors from zero, against 4.30 at 2.9 degrees of freedom; 95% interval -1.096% to +1.759%") in report
    far = pooled(bf16, _repeats(tmp_path, "far", [3.1, 3.1]), ("BF16", "FP8"), window=500, tolerance=0.05)
    assert "**OUTSIDE the run-to-run noise**" in far and "These runs resolve 5.00%" in far, far
    # A range only widens with more runs: a mean inside it but three standard errors away is outside the noise.
    wide = _repeats(tmp_path, "wide", [3.00, 3.01, 3.00, 3.01, 3.00, 3.06], steps=(1000,) * 6)
    shifted = pooled(wide, _repeats(tmp_path, "shifted", [3.04, 3.04, 3.04]), ("BF16", "FP8"), window=500,
                     tolerance=0.0025)
    assert "+0.885%, standard error 0.317%: inside BF16's range" in shifted, shifted
    assert ("**OUTSIDE the run-to-run noise** (Welch's t test, 95%): the difference of the means is 2.79 standard "
            "errors from zero, against 2.57 at 5.0 degrees of freedom") in shifted, shifted


def test_welch_s_degrees_of_freedom_and_student_s_critical_values():
    """The standard error and Welch-Satterthwaite degrees of freedom of two arms (an arm of one run borrows the
    reference's variance and its degrees of freedom); t's 97.5% point rounded down to whole degrees of freedom."""
    error, dof = welch([1.0, 2.0, 3.0], [2.0, 4.0])  # variances 1 and 2: 1/3 + 2/2
    assert error == pytest.approx(math.sqrt(4 / 3)) and dof == pytest.approx((4 / 3) ** 2 / ((1 / 3) ** 2 / 2 + 1))
    assert welch([1.0, 2.0, 3.0], [5.0]) == (pytest.approx(math.sqrt(1 / 3 + 1)), 2.0)
    assert welch([1.0, 1.0], [1.0, 1.0]) == (0.0, 2.0)
    assert t_critical(1) == 12.706 and t_critical(3.77) == 3.182 and t_critical(30) == 2.042
    assert t_critical(0.4) == 12.706
    # Past the table, t's quantile (mpmath's inverse of the regularized incomplete beta), not the normal's 1.96:
    # at 31-120 degrees of freedom 1.96 passed differences that Student's t does not.
    for dof, expected in ((31, 2.03951), (40.9, 2.02108), (60, 2.00030), (120, 1.97993), (1000, 1.96234)):
        assert t_critical(dof) == pytest.approx(expected, abs=2e-5), dof


def test_pooled_refuses_an_arm_without_a_spread_and_its_command_line_checks_its_arguments(tmp_path):
    one = _repeats(tmp_path, "one", [3.0])
    with pytest.raises(ConfigError, match="no evaluation that two BF16 runs and one FP8 run all reached"):
        pooled(one, _repeats(tmp_path, "other", [3.0]), ("BF16", "FP8"), window=500, tolerance=0.0025)
    bf16, fp8 = _repeats(tmp_path, "bf16", [3.0, 3.01]), _repeats(tmp_path, "fp8", [3.0])

    def run(*args):
        return subprocess.run([sys.executable, "tools/compare_runs.py", *args], cwd=REPO, env=torchrun_env(),
                              capture_output=True, text=True, timeout=120)
    ok = run("--pooled", *bf16, "--against", *fp8, "--labels", "BF16 B", "FP8 B")
    assert ok.returncode == 0 and "FP8 B's mean (1 run) vs BF16 B's" in ok.stdout, ok.stdout + ok.stderr
    for args, message in ((["--pooled", *bf16], "--pooled needs --against"),
                          ([*bf16, "--against", *fp8], "--against belongs to --pooled"),
                          (["--pooled", *bf16, "--against", *fp8, "--labels", "x"], "two --labels"),
                          (["--pooled", "--gaps", *bf16, "--against", *fp8], "different tables")):
        result = run(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


def test_the_rank_check_matches_the_mann_whitney_test_exact_and_approximate():
    """`mann_whitney`: U counts the pairs in which the other arm's run ends higher (ties half) and the two-sided
    p-value is exact for small arms, the normal approximation with continuity correction past the limit. The
    expected p-values are scipy 1.17's `mannwhitneyu` on the same values (exact, and asymptotic for 12 runs a side);
    the first case is MoE seed B's seven BF16 and six FP8 validation losses (job JF)."""
    bf16 = [3.4141, 3.4433, 3.4302, 3.4229, 3.4368, 3.4350, 3.4824]
    fp8 = [3.4443, 3.4344, 3.4650, 3.4097, 3.4515, 3.4383]
    u, p, exact = mann_whitney(bf16, fp8)
    assert (u, exact) == (26.0, True) and p == pytest.approx(0.5337995337995338)
    assert mann_whitney([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == (9.0, pytest.approx(0.1), True)
    assert mann_whitney([4.0, 5.0, 6.0], [1.0, 2.0, 3.0])[:2] == (0.0, pytest.approx(0.1))  # two-sided
    assert mann_whitney([1.0, 1.0], [1.0, 1.0]) == (2.0, 1.0, True)  # all tied: U at its mean
    u, p, exact = mann_whitney([float(i) for i in range(12)], [i + 100.0 for i in range(12)])
    assert (u, exact) == (144.0, False) and p == pytest.approx(3.6584553538971e-05, rel=1e-6)
    # one run far off moves U by its rank alone: pushing BF16's highest run ten times farther changes nothing
    assert mann_whitney(bf16[:-1] + [3.9], fp8) == mann_whitney(bf16, fp8)
    line = rank_check(bf16, fp8, ("BF16 B", "FP8 B"))
    assert line == ("- Rank check (Mann-Whitney, exact): FP8 B's runs end higher in 26 of 42 pairs with BF16 B's, "
                    "two-sided p = 0.53 (not below 0.05); median pairwise difference +0.227%"), line
    far = rank_check([float(i) for i in range(12)], [i + 100.0 for i in range(12)], ("A", "B"))
    assert "(Mann-Whitney, normal approximation)" in far and "p = 3.7e-05 (below 0.05)" in far, far


def test_the_default_table_reads_runs_without_norms_or_timings_and_refuses_one_without_losses(tmp_path, capsys):
    """Runs that logged no grad_norm, step_time_s or tokens_per_s (or a reference norm of 0) gave max()'s,
    statistics' and ZeroDivisionError's tracebacks; a run with no train records too. Now the table says "nan" or
    "-" where there is nothing to show, a run without losses is one error, and --tolerance takes a fraction in
    (0, 1] only (0 divided by zero, a negative one printed nonsense verdicts)."""
    from tools.compare_runs import main

    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 4.0 - s, "grad_norm": 0.0}) + "\n"
                            for s in (1, 2)))
    assert compare([str(bare), str(bare)], 0).splitlines()[2] == "| bare.jsonl | 2 | 0.0000 | nan% | 2.0000 | - | - |"
    evals = tmp_path / "evals.jsonl"
    evals.write_text(json.dumps({"kind": "eval", "step": 2, "val_loss": 3.0}) + "\n")
    with pytest.raises(ConfigError, match=r"evals.jsonl has no train records with a loss"):
        compare([str(bare), str(evals)], 0)
    for value, message in (("0", "0 must be a number above 0"), ("-1", "-1 must be a number above 0"),
                           ("5", "5 must be at most 1 (a fraction: 0.0025 = 0.25%)")):
        with pytest.raises(SystemExit):
            main([str(bare), str(bare), "--parity", "--tolerance", value])
        assert message in capsys.readouterr().err


def test_the_runs_an_arm_would_take_are_more_than_the_arms_have_where_they_cannot_resolve_the_tolerance():
    """Three runs an arm, sample deviation 0.498%: the 95% bound is t(4) = 2.776 x 0.498% x sqrt(2/3) = 1.128%, so
    1% is not resolved; the large-sample rule 8 s^2 / tolerance^2 said ~2 runs an arm would. Student's t at n runs
    a side (2 n - 2 degrees of freedom): n = 4 gives 2.447 x 0.498% x sqrt(1/2) = 0.862%, the first within 1%."""
    from tools.compare_runs import pooled_verdict, runs_to_resolve

    runs = [3.00, 3.03, 3.015]
    lines = pooled_verdict(runs, runs, 0.01, ("BF16", "FP8"))
    assert "- These runs cannot resolve 1.00% (the 95% bound is 1.128%): at this deviation that takes ~4 runs an arm" \
        in lines, lines
    # Past a handful of runs t is near 1.96 and the large-sample rule stands (MoE seed B's ~46 of jobs JN-JQ).
    assert runs_to_resolve(0.00593, 0.0025) == math.ceil(8 * 0.00593 ** 2 / 0.0025 ** 2) == 46
    for deviation, tolerance in ((0.005, 0.01), (0.004, 0.006), (0.003, 0.0025), (0.01, 0.001)):
        n = runs_to_resolve(deviation, tolerance)
        bound = lambda runs: t_critical(2 * runs - 2) * deviation * math.sqrt(2 / runs)
        assert bound(n) <= tolerance < bound(n - 1) or n == math.ceil(8 * deviation ** 2 / tolerance ** 2), n


def test_a_run_whose_last_evaluation_is_not_finite_or_missing_is_named_beside_the_verdict(tmp_path):
    """Non-finite losses are left out of the means, so a verdict is taken at the last evaluation every run has a
    finite loss at. An FP8 run whose validation loss at the last evaluation was a nan (or that stopped before it)
    moved the parity and pooled verdicts back to step 500, where it passed, without a word; and `--pooled` said of a
    run whose one evaluation gave a nan that it had "no evaluation". Each is now named, with why."""
    nan_at_end = _parity_runs(tmp_path, 2.002, 1.996)
    path = tmp_path / "fp8_a" / "metrics.jsonl"
    path.write_text(path.read_text().replace('{"kind": "eval", "step": 1000, "val_loss": 2.002}',
                                             '{"kind": "eval", "step": 1000, "val_loss": null}'))
    report = parity(nan_at_end, window=500, tolerance=0.0025, worst=5).splitlines()
    assert "Verdict (validation loss at step 500):" in report
    assert report[-1] == (f"- Not judged at step 1000, the last step a run logged its val_loss at: FP8 A "
                          f"({nan_at_end[1]}), logged there as a nan or inf"), report
    for directory in ("cut", "whole", "pooled"):
        (tmp_path / directory).mkdir()
    cut = [_write_run(tmp_path / "cut" / name, lambda s: 3.0, lambda s: 2.0, steps=steps)
           for name, steps in (("bf16_a", 1000), ("fp8_a", 900))]
    assert parity(cut, window=500, tolerance=0.0025, worst=5).splitlines()[-1] == (
        f"- Not judged at step 1000, the last step a run logged its val_loss at: FP8 A ({cut[1]}), its last at "
        "step 500")
    assert "Not judged" not in parity(_parity_runs(tmp_path / "whole", 2.002, 1.996), 500, 0.0025, 5)
    arms = [_write_run(tmp_path / "pooled" / name, lambda s: 3.0, lambda s, end=end: 2.0 if s < 1000 else end)
            for name, end in (("b1", 2.0), ("b2", 2.01), ("f1", math.nan), ("f2", 2.02), ("f3", 2.0))]
    (tmp_path / "pooled" / "f3" / "metrics.jsonl").write_text('{"kind": "eval", "step": 10, "val_loss": NaN}\n')
    lines = pooled(arms[:2], arms[2:], ("BF16", "FP8"), window=500, tolerance=0.0025).splitlines()
    assert lines[-2:] == [f"- Left out of the verdict, no validation loss at step 1000: {arms[2]} (logged there as a "
                          "nan or inf)",
                          f"- Left out of the verdict, no validation loss at step 1000: {arms[4]} (its last at step "
                          "10, a nan or inf)"], lines
    moved = pooled(arms[:2], [arms[2], arms[2]], ("BF16", "FP8"), window=500, tolerance=0.0025).splitlines()
    assert "Verdict (validation loss at step 500):" in moved
    assert moved[-1] == (f"- Not judged at step 1000, the last step a run logged its val_loss at: FP8 ({arms[2]}), "
                         "logged there as a nan or inf"), moved
