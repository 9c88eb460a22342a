"""benchmarks/gpu_parity_corpus.sh (issue 22's GPU session) on CPU: its sub-steps, the configs of its runs (every
key checked by the config loader), and one run cut short and then finished with a tiny model."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from megafp8.data.preprocess import preprocess
from megafp8.data.text_tree import scan_text_tree
from tests.conftest import REPO

SCRIPT = "benchmarks/gpu_parity_corpus.sh"
# Stands in for the ~1B model on CPU: appended to each run's overrides (later overrides win).
TINY = ("model.size=null model.hidden_size=128 model.num_layers=2 model.num_heads=2 model.attention.num_kv_heads=1 "
        "model.ffn_hidden_size=256 data.seq_len=64 training.micro_batch_size=2 optimizer.warmup_steps=1 "
        "logging.log_interval=1 training.device=cpu")


def script(tmp_path, *args, **env):
    """Run the script's sub-step `args` with WORK and OUT under tmp_path and this interpreter first on PATH."""
    full_env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                    OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=300)


# Each run whose resolved config a test reads (`config NAME`: a Python start-up importing torch, ~2 s of CPU on the
# 2-core CI machine), keyed by how the tests name it: NAME, or NAME and the environment it is resolved with.
# `config` reads only the corpus's meta.json (every test that reads configs makes the same one, fake_corpus's
# 40M/900k tokens) and the environment, and writes nothing a test reads: so each is resolved once for the module
# (the `configs` fixture, two at a time), not once per test (18 sub-steps, 14 of them different, one test at a time).
CONFIGS = {name: (name, {}) for name in (
    "dense_bf16_b", "moe_fp8", "moe_bf16_b", "moe_fp8_b", "dense_fp8_a", "dense_fp8blocks_a", "dense_fp8deepgemm_a",
    "moe_fp8bf16experts_b", "moe_fp8expertsonly_b", "moe_fp8bf16attn_b", "moe_fp8allbf16_b", "moe_bf16_b_r2",
    "moe_fp8_b_r3")}
CONFIGS["moe_fp8_b_r8 SEED_B_REPEATS=8"] = ("moe_fp8_b_r8", {"SEED_B_REPEATS": "8"})


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> tuple[str, dict]:
    """(the corpus's meta.json, each of CONFIGS's `config` sub-step results), resolved against fake_corpus's corpus;
    the sub-steps run side by side (each a Python start-up: `config` reads nothing the others write)."""
    root = tmp_path_factory.mktemp("configs")
    fake_corpus(root, 40_000_000, 900_000)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda key: script(root, "config", CONFIGS[key][0], **CONFIGS[key][1]), CONFIGS)
        return (root / "work" / "corpus" / "meta.json").read_text(), dict(zip(CONFIGS, results))


def run_configs(tmp_path, configs, *keys) -> dict:
    """Each run's resolved config, as the script's `config` sub-step prints it (every key checked), for the corpus
    in tmp_path (the one the `configs` fixture resolved them against)."""
    meta, results = configs
    assert (tmp_path / "work" / "corpus" / "meta.json").read_text() == meta
    for key in keys:
        assert results[key].returncode == 0, results[key].stderr
    return {key: yaml.safe_load(results[key].stdout) for key in keys}


def fake_corpus(tmp_path, train_tokens, valid_tokens):
    """A meta.json with these token counts: all `plan` and `config` read."""
    corpus = tmp_path / "work" / "corpus"
    corpus.mkdir(parents=True)
    splits = {"train": [{"num_tokens": train_tokens}], "valid": [{"num_tokens": valid_tokens}]}
    (corpus / "meta.json").write_text(json.dumps({"splits": splits}))


def test_the_script_parses_and_refuses_bad_sub_steps(tmp_path):
    assert subprocess.run(["bash", "-n", SCRIPT], cwd=REPO).returncode == 0
    for args, message in ((("frobnicate",), "usage: OUT=dir bash"), (("run",), "usage:"),
                          (("run", "a", "b", "c"), "usage:"), (("run", "dense_bf16_c"), "unknown run 'dense_bf16_c'"),
                          (("compare", "mixed"), "usage:"),
                          (("config", "dense_fp8_a"), "no corpus in")):
        result = script(tmp_path, *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    assert script(tmp_path, "status").stdout.startswith("no corpus in")


def test_plan_cuts_the_runs_to_one_pass_and_configs_hold_every_setting(tmp_path, configs):
    fake_corpus(tmp_path, 40_000_000, 900_000)  # 19,531 samples of 2048: 2,441 steps of 8; 439 held-out samples
    plan = script(tmp_path, "plan")
    assert plan.returncode == 0, plan.stderr
    assert "validation: 54 micro-batches of 8\n" in plan.stdout
    assert "- dense: 2441 steps of 16384 tokens = 39993344 tokens, one pass at most (cut from 3000: the corpus holds " \
           "one pass of 2441 steps)\n" in plan.stdout
    assert "- moe: 1000 steps of 16384 tokens = 16384000 tokens, one pass at most\n" in plan.stdout
    resolved = run_configs(tmp_path, configs, "dense_bf16_b", "moe_fp8")
    dense, moe = resolved["dense_bf16_b"], resolved["moe_fp8"]
    assert (dense["precision"]["recipe"], dense["training"]["seed"], dense["data"]["seed"]) == ("bf16", 2, 1234)
    assert (moe["precision"]["recipe"], moe["training"]["seed"], moe["data"]["seed"]) == ("fp8", 1, 1234)
    assert (dense["training"]["steps"], moe["training"]["steps"]) == (2441, 1000)
    assert dense["model"]["hidden_size"] == 2048 and dense["model"]["moe"]["num_experts"] == 0
    assert moe["model"]["moe"]["num_experts"] == 64 and moe["model"]["num_layers"] == 8
    for cfg in (dense, moe):
        assert cfg["data"]["seq_len"] == 2048 and cfg["training"]["global_batch_size"] == 8
        assert (cfg["optimizer"]["lr"], cfg["optimizer"]["min_lr"], cfg["optimizer"]["decay_style"]) == \
            (3e-4, 3e-5, "cosine")
        assert (cfg["training"]["eval_interval"], cfg["training"]["eval_iters"]) == (500, 54)
    assert (dense["checkpoint"]["interval"], moe["checkpoint"]["interval"]) == (500, 0)


def test_a_run_cut_short_starts_again_and_a_finished_run_leaves_its_metrics(tmp_path):
    tree = scan_text_tree([str(REPO / "megafp8")], [".py"], valid_fraction=0.05, seed=0)
    preprocess([str(REPO / "megafp8")], tmp_path / "work" / "corpus", valid_fraction=0.05, tree=tree)  # byte tokens
    env = {"DENSE_STEPS": "3", "EXTRA_OVERRIDES": TINY}
    cut = script(tmp_path, "run", "dense_bf16_a", RUN_SECONDS="1", **env)
    assert cut.returncode == 0 and "- dense_bf16_a (GPU 0): step 0 of 3, exit 124, cut short before its first " \
        "checkpoint: it starts over next time\n" in cut.stdout
    done = script(tmp_path, "run", "dense_bf16_a", **env)
    assert "- dense_bf16_a (GPU 0): step 3 of 3, exit 0, finished\n" in done.stdout, done.stdout + done.stderr
    run_dir = tmp_path / "work" / "runs" / "dense_bf16_a"
    assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / "checkpoints").exists()
    assert (tmp_path / "out" / "runs" / "dense_bf16_a" / "metrics.jsonl").read_text() == \
        (run_dir / "metrics.jsonl").read_text()
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.count("## run dense_bf16_a") == 2 and "finished" in summary
    again = script(tmp_path, "run", "dense_bf16_a", **env)
    assert again.stdout == "dense_bf16_a: finished already\n"
    status = script(tmp_path, "status", **env).stdout
    assert status.startswith("dense_bf16_a: step 3 of 3\ndense_fp8_a: step 0 of 3\n")


def test_a_deadline_cuts_a_run_to_end_in_time_and_starts_none_it_cannot(tmp_path):
    """DEADLINE (the device command's end): a run's RUN_SECONDS is cut so that its stop, STOP_GRACE and the copying
    end before it, and with under a minute left no run starts (job HC: the command's limit killed a run whose own
    stop came later)."""
    import time

    tree = scan_text_tree([str(REPO / "megafp8")], [".py"], valid_fraction=0.05, seed=0)
    preprocess([str(REPO / "megafp8")], tmp_path / "work" / "corpus", valid_fraction=0.05, tree=tree)  # byte tokens
    env = {"DENSE_STEPS": "2", "EXTRA_OVERRIDES": TINY, "STOP_GRACE": "5", "RUN_SECONDS": "450"}
    bad = script(tmp_path, "run", "dense_bf16_a", DEADLINE="10 minutes", **env)
    assert "DEADLINE=10 minutes: give seconds since the epoch" in bad.stderr, bad.stdout + bad.stderr
    late = script(tmp_path, "run", "dense_bf16_a", DEADLINE=str(int(time.time()) + 70), **env)
    assert late.returncode == 0 and "- dense_bf16_a (GPU 0): not started, DEADLINE leaves" in late.stdout, \
        late.stdout + late.stderr
    assert not (tmp_path / "work" / "runs" / "dense_bf16_a" / "metrics.jsonl").exists()
    cut = script(tmp_path, "run", "dense_bf16_a", DEADLINE=str(int(time.time()) + 5 + 15 + 90), **env)
    assert "- dense_bf16_a (GPU 0): step 2 of 2, exit 0, finished\n" in cut.stdout, cut.stdout + cut.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "- dense_bf16_a: 450 s cut to 8" in summary or "- dense_bf16_a: 450 s cut to 9" in summary, summary


def test_two_runs_share_one_gpu_when_asked(tmp_path):
    """`run NAME NAME2` puts NAME2 on GPU 1 unless GPU2 says otherwise: GPU2=0 runs both on GPU 0, side by side,
    each to its end."""
    tree = scan_text_tree([str(REPO / "megafp8")], [".py"], valid_fraction=0.05, seed=0)
    preprocess([str(REPO / "megafp8")], tmp_path / "work" / "corpus", valid_fraction=0.05, tree=tree)  # byte tokens
    both = script(tmp_path, "run", "dense_fp8_a", "dense_bf16_b", GPU2="0", DENSE_STEPS="2", EXTRA_OVERRIDES=TINY)
    assert both.returncode == 0, both.stderr
    for name in ("dense_fp8_a", "dense_bf16_b"):
        assert f"- {name} (GPU 0): step 2 of 2, exit 0, finished\n" in both.stdout, both.stdout


def test_two_runs_on_one_gpu_stop_one_after_the_other(tmp_path):
    """Side by side on one GPU, the first run stops STOP_STAGGER s before the second, so that their stop-time
    checkpoints are not written at once (four dense checkpoints would crowd the GPU machine's disk). Here the first
    gets 1 s (cut before it trains) and the second RUN_SECONDS (it finishes)."""
    tree = scan_text_tree([str(REPO / "megafp8")], [".py"], valid_fraction=0.05, seed=0)
    preprocess([str(REPO / "megafp8")], tmp_path / "work" / "corpus", valid_fraction=0.05, tree=tree)  # byte tokens
    both = script(tmp_path, "run", "dense_fp8_a", "dense_bf16_b", GPU2="0", DENSE_STEPS="2", EXTRA_OVERRIDES=TINY,
                  RUN_SECONDS="120", STOP_STAGGER="119")
    assert both.returncode == 0, both.stderr
    assert "- dense_fp8_a (GPU 0): step 0 of 2, exit 124, cut short" in both.stdout, both.stdout
    assert "- dense_bf16_b (GPU 0): step 2 of 2, exit 0, finished\n" in both.stdout, both.stdout


def test_runs_of_an_earlier_session_count_where_they_are_what_this_one_would_run(tmp_path):
    """PRIOR_RUNS: a run finished in an earlier session (what its $OUT/runs brought back) counts as finished on a
    fresh machine with the same corpus and settings, `status` says so, and it is copied into this session's
    $OUT/runs to be carried forward. A prior made on another corpus, or with other settings, stops the script before
    anything runs, saying both ids; so does a prior given before the corpus exists."""
    tree = scan_text_tree([str(REPO / "megafp8")], [".py"], valid_fraction=0.05, seed=0)
    env = {"DENSE_STEPS": "2", "EXTRA_OVERRIDES": TINY}
    first = tmp_path / "first"
    preprocess([str(REPO / "megafp8")], first / "work" / "corpus", valid_fraction=0.05, tree=tree)
    done = script(first, "run", "dense_bf16_a", **env)
    assert "step 2 of 2, exit 0, finished" in done.stdout, done.stdout + done.stderr
    prior = first / "out" / "runs"
    run_id = (prior / "dense_bf16_a" / "run_id.txt").read_text().strip()
    assert run_id.startswith("train_tokens=") and " tokenizer=none " in run_id  # byte tokens here
    assert "precision.recipe=bf16" in run_id and "data.path=" not in run_id  # settings, not machine paths

    second = tmp_path / "second"  # the next session: nothing made yet, then the same corpus made again
    assert script(second, "status", PRIOR_RUNS=str(prior), **env).returncode == 2
    preprocess([str(REPO / "megafp8")], second / "work" / "corpus", valid_fraction=0.05, tree=tree)
    status = script(second, "status", PRIOR_RUNS=str(prior), **env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith("dense_bf16_a: step 2 of 2 (in PRIOR_RUNS)\ndense_fp8_a: step 0 of 2\n")
    again = script(second, "run", "dense_bf16_a", PRIOR_RUNS=str(prior), **env)
    assert again.stdout == "dense_bf16_a: finished already\n", again.stdout + again.stderr
    carried = second / "out" / "runs" / "dense_bf16_a"
    assert (carried / "metrics.jsonl").read_text() == (prior / "dense_bf16_a" / "metrics.jsonl").read_text()

    other_settings = script(second, "status", PRIOR_RUNS=str(prior), DENSE_STEPS="2",
                            EXTRA_OVERRIDES=TINY + " optimizer.lr=1e-3")
    assert other_settings.returncode == 2 and "was made another way" in other_settings.stderr
    assert run_id in other_settings.stderr
    # the settings that differ, first (the override added to the defaults)
    assert "made another way. Only its settings have: nothing; only this session's: optimizer.lr=1e-3 (" in (
        other_settings.stderr), other_settings.stderr

    other = tmp_path / "other"  # another corpus: fewer files
    config_tree = scan_text_tree([str(REPO / "megafp8" / "config")], [".py"], valid_fraction=0.05, seed=0)
    preprocess([str(REPO / "megafp8" / "config")], other / "work" / "corpus", valid_fraction=0.05, tree=config_tree)
    refused = script(other, "run", "dense_bf16_a", PRIOR_RUNS=str(prior), **env)
    assert refused.returncode == 2 and "was made another way" in refused.stderr
    assert not (other / "work" / "runs" / "dense_bf16_a").exists()


def test_pack_out_keeps_every_sub_step_s_files_in_one_archive(tmp_path):
    """PACK_OUT=1: what the sub-steps write under $OUT/runs and $OUT/logs ends in one $OUT/parity_files.tar.gz, each
    sub-step's files merged with the earlier ones', so that $OUT holds a few files (the GPU machine brings back 8)."""
    tree = scan_text_tree([str(REPO / "megafp8")], [".py"], valid_fraction=0.05, seed=0)
    preprocess([str(REPO / "megafp8")], tmp_path / "work" / "corpus", valid_fraction=0.05, tree=tree)  # byte tokens
    env = {"DENSE_STEPS": "3", "EXTRA_OVERRIDES": TINY, "PACK_OUT": "1", "RUN_SECONDS": "1"}
    for name in ("dense_bf16_a", "dense_fp8_a"):  # two sub-steps, each cut short before it trains
        cut = script(tmp_path, "run", name, **env)
        assert cut.returncode == 0 and f"- {name} (GPU 0): step 0 of 3, exit 124, cut short" in cut.stdout, \
            cut.stdout + cut.stderr
    out = tmp_path / "out"
    assert sorted(path.name for path in out.iterdir()) == ["parity_files.tar.gz", "summary.md"]
    with tarfile.open(out / "parity_files.tar.gz") as archive:
        names = set(archive.getnames())
        logs = {name: archive.extractfile(f"./runs/{name}.log").read().decode()
                for name in ("dense_bf16_a", "dense_fp8_a")}
        run_id = archive.extractfile("./runs/dense_fp8_a/run_id.txt").read().decode()
    assert {"./logs", "./runs/dense_bf16_a/run_id.txt", "./runs/dense_fp8_a/run_id.txt"} <= names, names
    for name, log in logs.items():
        assert log == (tmp_path / "work" / "runs" / f"{name}.log").read_text()
    assert "precision.recipe=fp8" in run_id
    assert (out / "summary.md").read_text().count("cut short") == 2


def _finished_run(runs_dir: Path, name: str, losses: list[float]) -> None:
    """A metrics file of a run trained to step len(losses), evaluated at its last step."""
    (runs_dir / name).mkdir(parents=True, exist_ok=True)
    records = [{"kind": "train", "step": step, "loss": loss, "grad_norm": 1.0, "step_time_s": 0.1,
                "tokens_per_s": 1.0} for step, loss in enumerate(losses, 1)]
    records.append({"kind": "eval", "step": len(losses), "val_loss": losses[-1]})
    (runs_dir / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _differs_only_in(run: dict, plain: dict, option: str) -> None:
    """`run`'s resolved config is `plain`'s but for `precision.<option>` (and its run name)."""
    assert {**run, "precision": {**run["precision"], option: plain["precision"][option]},
            "run_name": plain["run_name"]} == plain


def _judged_once_finished(tmp_path, family: str, name: str, finished: dict, final: float, section: str) -> str:
    """With the runs of `finished` (name -> losses) done and `name` one step short, `compare family` leaves
    `section` out; with `name` finished at `final`, it writes it: its text is returned."""
    runs, env = tmp_path / "work" / "runs", {"DENSE_STEPS": "2", "MOE_STEPS": "2"}
    for done, losses in finished.items():
        _finished_run(runs, done, losses)
    _finished_run(runs, name, [4.0])  # not finished
    assert section not in script(tmp_path, "compare", family, **env).stdout
    _finished_run(runs, name, [4.0, final])
    assert f"== {section} done" in script(tmp_path, "compare", family, **env).stdout
    return (tmp_path / "out" / "summary.md").read_text().rsplit(f"## {section}\n", 1)[1]


def test_compare_takes_moe_bf16_seed_b_once_it_has_finished(tmp_path, configs):
    """`moe_bf16_b` (MoE's BF16 seed B, optional) is a run like the others (seed B's training.seed), and `compare`
    judges MoE against its seed-to-seed spread once it has finished; before that, against BF16 seed A alone.
    `compare moe` leaves the dense comparison out."""
    fake_corpus(tmp_path, 40_000_000, 900_000)
    cfg = run_configs(tmp_path, configs, "moe_bf16_b")["moe_bf16_b"]
    assert (cfg["precision"]["recipe"], cfg["training"]["seed"], cfg["data"]["seed"]) == ("bf16", 2, 1234)
    assert cfg["model"]["moe"]["num_experts"] == 64 and cfg["checkpoint"]["interval"] == 0
    runs, env = tmp_path / "work" / "runs", {"MOE_STEPS": "2", "DENSE_STEPS": "2"}
    _finished_run(runs, "moe_bf16", [4.0, 3.0])
    _finished_run(runs, "moe_fp8", [4.0, 3.03])
    _finished_run(runs, "moe_bf16_b", [4.0])  # one step of MOE_STEPS=2: not finished

    def moe_section() -> str:
        summary = (tmp_path / "out" / "summary.md").read_text()
        section = summary.rsplit("## parity_moe\n", 1)[1]
        return section.split("\n## ", 1)[0]

    moe_only = script(tmp_path, "compare", "moe", **env).stdout
    assert "== parity_moe done" in moe_only and "parity_dense" not in moe_only, moe_only
    assert "BF16 seed-to-seed spread: not measured" in moe_section()
    _finished_run(runs, "moe_bf16_b", [4.0, 2.94])  # now finished
    with_seed_b = script(tmp_path, "compare", "moe", **env).stdout
    assert "BF16 seed-to-seed spread |BF16 B - BF16 A|: 2.000%; |FP8 - BF16 A| = 1.000%: inside the spread" \
        in moe_section(), moe_section()

    # MoE's FP8 seed B: seed B's training.seed, judged against BF16 seed B once finished (and not before: the
    # compare just above, with moe_bf16_b finished and no moe_fp8_b, left it out)
    cfg = run_configs(tmp_path, configs, "moe_fp8_b")["moe_fp8_b"]
    assert (cfg["precision"]["recipe"], cfg["training"]["seed"]) == ("fp8", 2)
    assert "parity_moe_seed_b" not in with_seed_b
    _finished_run(runs, "moe_fp8_b", [4.0, 2.97])
    seed_b = script(tmp_path, "compare", "moe", **env).stdout
    assert "== parity_moe_seed_b done" in seed_b, seed_b
    summary = (tmp_path / "out" / "summary.md").read_text()
    section = summary.rsplit("## parity_moe_seed_b\n", 1)[1].split("\n## ", 1)[0]
    # FP8 B against BF16 B (2.97 / 2.94), A's spread beside, each run named by its seed
    assert "- FP8 vs BF16 B: +1.020%" in section, section
    assert "|BF16 A - BF16 B|: 2.041%; |FP8 - BF16 B| = 1.020%: inside the spread" in section, section
    assert "| step | BF16 B | FP8 B | BF16 A | FP8 vs BF16 B | BF16 A vs BF16 B (seed spread) |" in section, section


@pytest.mark.parametrize("opt_in, option, on, off, final, gap", [
    ("fp8blocks", "fp8_wgrad_input_blocks", True, False, 3.02, "0.667%"),
    ("fp8deepgemm", "fp8_backend", "deepgemm", "auto", 3.03, "1.000%")])
def test_an_opt_in_run_is_fp8_seed_a_with_its_one_option_and_compare_sets_it_against_the_bf16_seeds(
        tmp_path, configs, opt_in, option, on, off, final, gap):
    """`dense_fp8blocks_a` (x in 128x128 blocks for the wgrads) and `dense_fp8deepgemm_a` (the deepgemm backend) are
    FP8 seed A with one precision option changed (their only difference from `dense_fp8_a`, so each its own run id);
    `compare dense` judges each against the two BF16 seeds once it has finished, and leaves it out before."""
    name = f"dense_{opt_in}_a"
    fake_corpus(tmp_path, 40_000_000, 900_000)
    resolved = run_configs(tmp_path, configs, "dense_fp8_a", name)
    run, plain = resolved[name], resolved["dense_fp8_a"]
    assert (run["precision"]["recipe"], run["training"]["seed"]) == ("fp8", 1)
    assert (run["precision"][option], plain["precision"][option]) == (on, off)
    _differs_only_in(run, plain, option)
    section = _judged_once_finished(
        tmp_path, "dense", name, {"dense_bf16_a": [4.0, 3.0], "dense_fp8_a": [4.0, 3.01], "dense_bf16_b": [4.0, 2.94]},
        final, f"parity_dense_{opt_in}")
    assert f"|FP8 - BF16 A| = {gap}: inside the spread" in section, section


ABLATIONS = {  # name: (the one layer option it changes, its value, the final validation loss its fake run ends at)
    "fp8bf16experts": ("bf16_layers", ["*.experts.*"], 2.97),
    "fp8expertsonly": ("fp8_layers", ["*.experts.*"], 2.955),
    "fp8bf16attn": ("bf16_layers", ["*.attn.*"], 2.9694),
    "fp8allbf16": ("bf16_layers", ["*"], 2.9547)}


def test_moe_s_ablations_are_fp8_seed_b_with_one_layer_glob_and_compare_sets_them_against_bf16_seed_b(tmp_path,
                                                                                                         configs):
    """`moe_fp8bf16experts_b` (the routed experts in BF16), `moe_fp8expertsonly_b` (only they in FP8) and
    `moe_fp8bf16attn_b` (the attention projections in BF16) and the control `moe_fp8allbf16_b` (no GEMM in FP8) are
    FP8 seed B with one layer glob changed, which reaches the config as a one-element list (quoted for YAML, left alone
    by the shell); `compare moe` sets each against BF16 seed B, seed A's spread beside, once it has finished, and
    all of them in one table once FP8 seed B has finished too. (All four in one test: each `compare` is a handful of
    Python start-ups.)"""
    fake_corpus(tmp_path, 40_000_000, 900_000)
    resolved = run_configs(tmp_path, configs, "moe_fp8_b", *(f"moe_{ablation}_b" for ablation in ABLATIONS))
    plain = resolved["moe_fp8_b"]
    for ablation, (option, value, _) in ABLATIONS.items():
        run = resolved[f"moe_{ablation}_b"]
        assert (run["precision"]["recipe"], run["training"]["seed"]) == ("fp8", 2)
        assert run["precision"][option] == value and plain["precision"][option] != value, ablation
        _differs_only_in(run, plain, option)

    runs, env = tmp_path / "work" / "runs", {"DENSE_STEPS": "2", "MOE_STEPS": "2"}
    for done, losses in {"moe_bf16": [4.0, 3.0], "moe_fp8": [4.0, 3.03], "moe_bf16_b": [4.0, 2.94]}.items():
        _finished_run(runs, done, losses)
    for ablation in ABLATIONS:
        _finished_run(runs, f"moe_{ablation}_b", [4.0])  # one step of MOE_STEPS=2: not finished
    unfinished = script(tmp_path, "compare", "moe", **env).stdout
    assert not any(f"parity_moe_{ablation}" in unfinished for ablation in ABLATIONS), unfinished
    for ablation, (_, _, final) in ABLATIONS.items():
        _finished_run(runs, f"moe_{ablation}_b", [4.0, final])
    finished = script(tmp_path, "compare", "moe", **env).stdout
    summary = (tmp_path / "out" / "summary.md").read_text()
    for ablation, (_, _, final) in ABLATIONS.items():
        assert f"== parity_moe_{ablation} done" in finished, finished
        section = summary.rsplit(f"## parity_moe_{ablation}\n", 1)[1].split("\n## ", 1)[0]
        assert f"- FP8 vs BF16 B: {(final / 2.94 - 1) * 100:+.3f}%" in section, section
    assert "## moe_ablations" not in summary  # not before FP8 seed B is done
    _finished_run(runs, "moe_fp8_b", [4.0, 2.99])  # then one table of them all
    script(tmp_path, "compare", "moe", **env)
    table = (tmp_path / "out" / "summary.md").read_text().rsplit("## moe_ablations\n", 1)[1]
    assert "| run | train loss, 1-2 | validation loss, step 2 |" in table, table  # windows of 250, cut to the run
    for ablation, (_, _, final) in ABLATIONS.items():  # train loss: the mean of (4, final) against (4, 2.94)
        row = f"| {ablation} | {((4 + final) / 6.94 - 1) * 100:+.2f}% | {(final / 2.94 - 1) * 100:+.3f}% |"
        assert row in table, (row, table)


def test_cross_eval_evaluates_a_kept_checkpoint_in_both_recipes_and_refuses_a_run_without_one(tmp_path):
    """`cross_eval NAME`: the run's newest checkpoint evaluated in BF16 and in FP8 (`launch/pretrain.py
    --evaluate`); evaluated in its own recipe it gives the run's own last validation loss. A run that kept no
    checkpoint is refused, saying how to keep one."""
    tree = scan_text_tree([str(REPO / "megafp8")], [".py"], valid_fraction=0.05, seed=0)
    preprocess([str(REPO / "megafp8")], tmp_path / "work" / "corpus", valid_fraction=0.05, tree=tree)  # byte tokens
    env = {"DENSE_STEPS": "2", "EXTRA_OVERRIDES": TINY + " training.eval_iters=2"}
    refused = script(tmp_path, "cross_eval", "dense_bf16_a", **env)
    assert refused.returncode == 2 and "KEEP_CHECKPOINTS=1" in refused.stderr, refused.stderr
    # One run (its weights evaluated in both recipes): a BF16 run takes the same script lines with the recipes swapped,
    # and cost this test ~10 s more of runs and evaluations
    for name, own_recipe in (("dense_fp8_a", "fp8"),):
        done = script(tmp_path, "run", name, KEEP_CHECKPOINTS="1", DENSE_CHECKPOINT_INTERVAL="2", **env)
        assert f"- {name} (GPU 0): step 2 of 2, exit 0, finished\n" in done.stdout, done.stdout + done.stderr
        result = script(tmp_path, "cross_eval", name, DENSE_CHECKPOINT_INTERVAL="2", **env)
        assert result.returncode == 0, result.stderr
        runs = tmp_path / "out" / "runs" / name
        evals = {r: json.loads((runs / f"eval_{r}.json").read_text()) for r in ("bf16", "fp8")}
        own = [r for r in map(json.loads, (tmp_path / "work" / "runs" / name / "metrics.jsonl").open())
               if r["kind"] == "eval"][-1]
        assert evals["bf16"]["step"] == evals["fp8"]["step"] == own["step"] == 2
        assert evals[own_recipe]["val_loss"] == pytest.approx(own["val_loss"], rel=1e-6), name
        bf16, fp8 = evals["bf16"]["val_loss"], evals["fp8"]["val_loss"]
        assert bf16 != fp8
        assert f"| 2 | {own['val_loss']:.4f} (step 2) | {bf16:.4f} | {fp8:.4f} | {100 * (fp8 / bf16 - 1):+.3f}% |" \
            in result.stdout, result.stdout


def test_seed_b_repeats_run_seed_b_s_settings_and_compare_pools_them_once_two_bf16_runs_have_finished(tmp_path,
                                                                                                        configs):
    """`moe_bf16_b_r2` and `moe_fp8_b_r3` (repeats; up to SEED_B_REPEATS, 7 unless set) resolve to their base run's
    config but for the run name (the same seed, data order and recipe); `compare moe` pools the seed-B repeats (`compare_runs.py --pooled`) only once two
    BF16 runs and one FP8 run have finished, counts a repeat still running nowhere, and plots them."""
    fake_corpus(tmp_path, 40_000_000, 900_000)
    resolved = run_configs(tmp_path, configs, "moe_bf16_b", "moe_bf16_b_r2", "moe_fp8_b", "moe_fp8_b_r3")
    for repeat, base in (("moe_bf16_b_r2", "moe_bf16_b"), ("moe_fp8_b_r3", "moe_fp8_b")):
        assert resolved[repeat]["run_name"] == repeat
        assert {**resolved[repeat], "run_name": base} == resolved[base]
    assert "unknown run 'moe_fp8_b_r8'" in script(tmp_path, "config", "moe_fp8_b_r8").stderr  # SEED_B_REPEATS=7
    more = configs[1]["moe_fp8_b_r8 SEED_B_REPEATS=8"]  # (`config moe_fp8_b_r8` with SEED_B_REPEATS=8)
    assert more.returncode == 0 and "run_name: moe_fp8_b_r8" in more.stdout, more.stderr
    assert "SEED_B_REPEATS=12: give 1 to 9" in script(tmp_path, "status", SEED_B_REPEATS="12").stderr
    runs, env = tmp_path / "work" / "runs", {"MOE_STEPS": "2", "DENSE_STEPS": "2"}
    for name, losses in (("moe_bf16", [4.0, 3.0]), ("moe_fp8", [4.0, 3.03]), ("moe_bf16_b", [4.0, 3.0]),
                         ("moe_fp8_b", [4.0, 3.06]), ("moe_bf16_b_r3", [4.0])):  # r3 one step short
        _finished_run(runs, name, losses)
    assert "moe_seed_b_repeats" not in script(tmp_path, "compare", "moe", **env).stdout
    _finished_run(runs, "moe_bf16_b_r2", [4.0, 3.06])
    out = script(tmp_path, "compare", "moe", **env).stdout
    assert "== moe_seed_b_repeats done" in out and "== plot_moe_repeats done" in out, out
    assert (tmp_path / "out" / "parity_moe_repeats.png").stat().st_size > 0
    plotted = (tmp_path / "out" / "summary.md").read_text().rsplit("## plot_moe_repeats\n", 1)[1]
    for label, run in (("BF16 B", "moe_bf16_b"), ("BF16 B repeat 2", "moe_bf16_b_r2"), ("FP8 B", "moe_fp8_b")):
        assert re.search(rf"^- {label}: \S*/{run}$", plotted, re.M), plotted  # each curve named for its own run
    section = (tmp_path / "out" / "summary.md").read_text().rsplit("## moe_seed_b_repeats\n", 1)[1]
    assert "| 2 | 3.0000, 3.0600 | 3.0300 | 1.980% | 3.0600 | 3.0600 | +0.990% |" in section, section
    assert "moe_bf16_b_r3" not in section.split("\n## ", 1)[0]
    assert "**INSIDE the run-to-run noise**" in section, section
