"""The two- and eight-GPU benchmark scripts (`benchmarks/gpu_2gpu.sh`, `gpu_8.sh`) run on a
CPU with stand-ins for `train_step.py`, `torchrun` and `nvidia-smi`: which parts they run, on how many GPUs, what
they skip and why, and the tables they compute from the stand-ins' rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


# ------------------------------------------------------------------------ benchmarks/gpu_2gpu.sh (issue 26)
# A stand-in for benchmarks/train_step.py: prints a table under the real one's header (the test passes it) with
# TFLOP/s per device = a per-model base x a per-layout factor, and the pipeline schedule's bubble; refuses an
# override after an option, as train_step.py's parser does. Each call is logged (arguments, visible GPU).
FAKE_TRAIN_STEP = r'''
import json, os, sys
args = sys.argv[1:]
first_option = next((i for i, a in enumerate(args) if a.startswith("--")), len(args))
late = [a for a in args[first_option:] if "=" in a and not a.startswith("--")]
if late:
    sys.exit(f"train_step.py: error: unrecognized arguments: {' '.join(late)}")
def option(name):
    return args[args.index(name) + 1]
recipes = args[args.index("--recipes") + 1:]
ranks = int(os.environ.get("FAKE_RANKS", "1"))
schedule = next((a.split("=")[1] for a in args if a.startswith("parallel.pp_schedule=")), None)
layout = (f"pp_{schedule}" if schedule else "tp" if "parallel.tp=2" in args
          else "recompute" if "training.recompute=full" in args else "dp" if ranks == 2 else "one")
factor = {"one": 1.0, "dp": 0.975, "tp": 0.9, "pp_1f1b": 0.85, "pp_dualpipev": 0.95, "recompute": 0.75}[layout]
base = {"8b-layers": {"bf16": 400.0, "fp8": 500.0}, "1b": {"bf16": 300.0, "fp8": 340.0}}[option("--model")]
header = [c.strip() for c in os.environ["FAKE_HEADER"].strip("|").split("|")]
print(os.environ["FAKE_HEADER"])
print("|" + "---|" * len(header))
for recipe in recipes:
    tflops = base[recipe] * factor
    cells = dict.fromkeys(header, "0")
    values = {"model": option("--model"), "recipe": recipe, "ranks": str(ranks),
              "tokens/s": f"{100 * tflops * ranks:,.0f}", "TFLOP/s per device": f"{tflops:.1f}",
              "MFU": f"{tflops / 9.894:.1f}%", "peak GiB, steady": "40.00", "tokens/s per GPU": f"{100 * tflops:,.0f}",
              "bubble, theoretical": {"1f1b": "11.1%", "dualpipev": "2.0%"}.get(schedule, "-")}
    assert set(values) <= set(cells), set(values) - set(cells)
    cells.update(values)
    print("| " + " | ".join(cells[c] for c in header) + " |")
with open(os.environ["FAKE_CALLS"], "a") as calls:
    calls.write(json.dumps({"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "ranks": ranks, "args": args}) + "\n")
'''


def stand_in_tools(tmp_path, fake, gpus: int, scripts: tuple[str, ...], keep_script_arg: bool) -> Path:
    """A directory of stand-ins to put first on PATH: `python` runs `fake` for each of `scripts` (passing the script's
    name on where `keep_script_arg`) and reports `gpus` CUDA devices; `torchrun` runs it the same way with FAKE_RANKS
    set from `--nproc_per_node`; `nvidia-smi` names one fake GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    keep = "" if keep_script_arg else "shift; "
    routes = "|".join(scripts)
    (bin_dir / "python").write_text(f"""#!/usr/bin/env bash
case "$1" in {routes}) {keep}exec {sys.executable} {fake} "$@" ;; esac
if [ "$1" = -c ] && [[ "$2" == *device_count* ]]; then echo {gpus}; exit 0; fi
exec {sys.executable} "$@"
""")
    (bin_dir / "torchrun").write_text(f"""#!/usr/bin/env bash
ranks=1
while [[ "$1" == --* ]]; do [[ "$1" == --nproc_per_node=* ]] && ranks=${{1#*=}}; shift; done
case "$1" in {routes}) {keep};; esac
FAKE_RANKS=$ranks exec {sys.executable} {fake} "$@"
""")
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\nprintf 'name, memory.total [MiB]\\nFake GPU, 1 MiB\\n'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def gpu_2gpu(tmp_path, *parts, budget="1000", **extra_env):
    """benchmarks/gpu_2gpu.sh with `python benchmarks/train_step.py` and `torchrun` replaced by the stand-in and
    two GPUs reported; returns (summary.md, the logged calls)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import train_step

    out = tmp_path / "out"
    fake = tmp_path / "fake_train_step.py"
    fake.write_text(FAKE_TRAIN_STEP)
    bin_dir = stand_in_tools(tmp_path, fake, gpus=2, scripts=("benchmarks/train_step.py",), keep_script_arg=False)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out), BUDGET_S=budget,
               FAKE_HEADER=train_step.table([]).splitlines()[0], FAKE_CALLS=str(tmp_path / "calls.jsonl"), **extra_env)
    result = subprocess.run(["bash", "benchmarks/gpu_2gpu.sh", *parts], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    return (out / "summary.md").read_text(), calls


def model_of(call: dict) -> str:
    return call["args"][call["args"].index("--model") + 1]


def scaling_rows(summary: str) -> dict[tuple[str, str], list[str]]:
    """The `scaling` section's rows by (section, recipe)."""
    table = summary.split("## scaling\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| layout")]
    return {(row[0], row[2]): row for row in rows}


def test_gpu_2gpu_script_runs_every_part_and_computes_efficiency_against_one_gpu(tmp_path):
    assert subprocess.run(["bash", "-n", "benchmarks/gpu_2gpu.sh"], cwd=REPO).returncode == 0
    summary, calls = gpu_2gpu(tmp_path)
    sections = [line[3:] for line in summary.splitlines() if line.startswith("## ")]
    assert sections == ["one_gpu_8b", "one_gpu_1b", "dp2_8b", "tp2_sp_8b", "pp2_1f1b_8b_16_layers",
                        "pp2_dualpipev_8b_16_layers", "dp2_1b", "recompute_8b", "recompute_1b", "tp2_sp_1b",
                        "pp2_1f1b_1b", "pp2_dualpipev_1b", "scaling"], summary
    assert "FAILED" not in summary and "SKIPPED" not in summary
    lanes = [(c["gpu"], model_of(c)) for c in calls if c["ranks"] == 1]  # the one-GPU runs, two at a time
    assert sorted(lanes) == [("0", "8b-layers"), ("0", "8b-layers"), ("1", "1b"), ("1", "1b")]
    pp_8b = [c["args"] for c in calls if "parallel.pp=2" in c["args"] and "8b-layers" in c["args"]]
    assert len(pp_8b) == 2 and all("model.num_layers=16" in a and "--global-batch" in a for a in pp_8b)
    rows = scaling_rows(summary)
    assert len(rows) == 24  # 12 runs x 2 recipes
    # | layout | model | recipe | GPUs | tokens/s per GPU | efficiency | FP8 / BF16 | MFU | peak GiB | bubble |
    assert rows[("one_gpu_8b", "fp8")][5] == "100.0%" and rows[("one_gpu_8b", "fp8")][6] == "1.25x"
    assert rows[("dp2_8b", "bf16")][3:6] == ["2", "39,000", "97.5%"]
    assert rows[("dp2_1b", "fp8")][5] == "97.5%" and rows[("dp2_1b", "fp8")][6] == "1.13x"
    assert rows[("tp2_sp_8b", "fp8")][5:7] == ["90.0%", "1.25x"]
    assert rows[("pp2_1f1b_8b_16_layers", "bf16")][9] == "15.0% / 11.1%"
    assert rows[("pp2_dualpipev_1b", "fp8")][9] == "5.0% / 2.0%"
    assert rows[("recompute_1b", "bf16")][5] == "75.0%" and rows[("recompute_1b", "bf16")][9] == "-"


def test_gpu_2gpu_script_installs_deepgemm_first_only_when_asked(tmp_path):
    """DEEPGEMM=1: DeepGEMM's install comes before the parts (here its source is missing, and the summary says so,
    the parts running on); without it, nothing is installed."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    summary, _ = gpu_2gpu(tmp_path / "a", "dp2_8b", DEEPGEMM="1", DEEPGEMM_SRC=str(tmp_path / "no_dg"))
    assert f"no DeepGEMM source in {tmp_path / 'no_dg'}" in summary
    assert summary.index("no DeepGEMM source") < summary.index("## dp2_8b")
    summary, _ = gpu_2gpu(tmp_path / "b", "dp2_8b")
    assert "DeepGEMM" not in summary


def test_gpu_2gpu_script_tries_tensor_parallel_variants_only_when_asked(tmp_path):
    """`tp2_cuda_graphs` and `tp2_overlap` (not default parts): TP=2 + SP under CUDA graphs, and compiled with
    Inductor's comm/compute reordering; the 8B-layer shape then ~1B."""
    summary, calls = gpu_2gpu(tmp_path, "tp2_cuda_graphs")
    sections = [line[3:] for line in summary.splitlines() if line.startswith("## ")]
    assert sections == ["tp2_sp_cuda_graphs_8b", "tp2_sp_cuda_graphs_1b", "scaling"], summary
    assert [model_of(c) for c in calls] == ["8b-layers", "1b"] and all(c["ranks"] == 2 for c in calls)
    assert all({"training.compile_mode=reduce-overhead", "parallel.tp=2", "parallel.sequence_parallel=true"}
               <= set(c["args"]) for c in calls)
    (tmp_path / "overlap").mkdir()
    summary, calls = gpu_2gpu(tmp_path / "overlap", "tp2_overlap")
    assert [line[3:] for line in summary.splitlines() if line.startswith("## ")] == [
        "tp2_sp_overlap_8b", "tp2_sp_overlap_1b", "scaling"], summary
    assert all({"training.compile_comm_overlap=true", "parallel.tp=2"} <= set(c["args"]) for c in calls)


def test_gpu_2gpu_script_skips_what_the_budget_cannot_hold(tmp_path):
    """A step that would start with less than its estimate left is skipped, saying how to run it; the rest run."""
    summary, calls = gpu_2gpu(tmp_path, "one_gpu", "dp2_8b", budget="95")
    assert "## one_gpu_8b: SKIPPED: " in summary and "it needs ~100 s (another call: OUT=dir bash " \
        "benchmarks/gpu_2gpu.sh one_gpu)" in summary
    assert [model_of(c) for c in calls] == ["1b", "8b-layers"] and "FAILED" not in summary  # one_gpu_1b, dp2_8b
    rows = scaling_rows(summary)
    assert rows[("dp2_8b", "fp8")][5] == "n/a (no one-GPU row)" and rows[("one_gpu_1b", "bf16")][5] == "100.0%"
    # The skipped part run in another call, then both summaries compared together:
    (tmp_path / "again").mkdir()
    again, _ = gpu_2gpu(tmp_path / "again", "one_gpu")
    (tmp_path / "first.md").write_text(summary)
    (tmp_path / "again.md").write_text(again)
    both = subprocess.run([sys.executable, "benchmarks/scaling_table.py", str(tmp_path / "first.md"),
                           str(tmp_path / "again.md"), "--baselines", "one_gpu_8b", "one_gpu_1b"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert both.returncode == 0, both.stderr
    assert scaling_rows("## scaling\n" + both.stdout)[("dp2_8b", "fp8")][5] == "97.5%"


# ------------------------------------------------------------------------ benchmarks/gpu_8.sh (issue 23)
# A stand-in for benchmarks/train_step.py, launch/pretrain.py, tools/preprocess_data.py and tools/compare_runs.py:
# logs its arguments and rank count, prints a row. A pretrain.py run named in FAKE_FAIL fails (exit status 1, an error
# on stderr); one named in FAKE_HANG sleeps past any STEP_TIMEOUT a test sets.
FAKE_RUN = r'''
import json, os, sys, time
with open(os.environ["FAKE_CALLS"], "a") as calls:
    calls.write(json.dumps({"script": sys.argv[1], "ranks": int(os.environ.get("FAKE_RANKS", "1")),
                            "args": sys.argv[2:]}) + "\n")
if sys.argv[1] == "tools/preprocess_data.py" and os.environ.get("FAKE_CORPUS_FAIL"):
    sys.exit("error: no space left on device: /tmp/pystdlib")
run_name = next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("run_name=")), None)
if run_name is not None and run_name == os.environ.get("FAKE_FAIL"):
    sys.exit(f"error: {run_name} diverged at step 57")
if run_name is not None and run_name == os.environ.get("FAKE_HANG"):
    time.sleep(60)
output_dir = next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("logging.output_dir=")), None)
if run_name is not None and output_dir is not None:  # what a finished run leaves
    os.makedirs(os.path.join(output_dir, run_name), exist_ok=True)
    with open(os.path.join(output_dir, run_name, "metrics.jsonl"), "w") as metrics:
        metrics.write(json.dumps({"step": 1, "loss": 5.0, "run": run_name}) + "\n")
print("| fake row |")
'''


def gpu_8(tmp_path, gpus: int, *parts, planner: str | None = None, **extra_env):
    """benchmarks/gpu_8.sh with `gpus` GPUs reported, the training, data and comparison scripts and torchrun replaced
    by the stand-in; the planner, tools/plan.py, is the real one unless `planner` is given: bash run in its place,
    with the planner's arguments as "$@" (run once: a second call of the planner gets the first's output and exit
    status again, a planner's torch import saved). Returns (summary.md, the logged calls)."""
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "out"
    fake = tmp_path / "fake_run.py"
    fake.write_text(FAKE_RUN)
    bin_dir = stand_in_tools(tmp_path, fake, gpus, ("benchmarks/train_step.py", "launch/pretrain.py",
                                                    "tools/preprocess_data.py", "tools/compare_runs.py"),
                             keep_script_arg=True)
    if planner is not None:
        shebang, rest = (bin_dir / "python").read_text().split("\n", 1)
        answer = tmp_path / "plan"
        (bin_dir / "python").write_text(f"""{shebang}
if [ "$1" = tools/plan.py ]; then
  shift
  echo "$@" >> {answer}.calls
  [ -e {answer}.rc ] || {{ ( {planner} ) > {answer}.out 2> {answer}.err; echo $? > {answer}.rc; }}
  cat {answer}.out; cat {answer}.err >&2; exit "$(cat {answer}.rc)"
fi
{rest}""")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out),
               FAKE_CALLS=str(tmp_path / "calls.jsonl"), **extra_env)
    result = subprocess.run(["bash", "benchmarks/gpu_8.sh", *parts], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    calls_file = tmp_path / "calls.jsonl"
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []
    return (out / "summary.md").read_text(), calls


def test_gpu_8_script_on_two_gpus_runs_the_one_and_two_gpu_parts_and_says_what_it_skipped(tmp_path):
    """Issue 23: the eight-GPU script on a two-GPU machine measures every one- and two-GPU layout (each BF16 and
    FP8, the planner's prediction in each row) and names the eight-GPU parts it skipped, with why."""
    assert subprocess.run(["bash", "-n", "benchmarks/gpu_8.sh"], cwd=REPO).returncode == 0
    summary, calls = gpu_8(tmp_path, 2)
    sections = [line[3:] for line in summary.splitlines() if line.startswith("## ")]
    assert sections == ["dense_1gpu", "moe_1gpu", "dense_tp2", "dense_pp2", "moe_ep2", "moe_tp2", "moe_pp2",
                        "eight_gpus: SKIPPED: needs 8 GPUs, 2 visible", "loss_8gpu: SKIPPED: needs 8 GPUs, 2 visible"]
    assert "FAILED" not in summary and summary.count("| fake row |") == 7
    assert [(c["ranks"], c["args"][c["args"].index("--model") + 1]) for c in calls] == [
        (1, "1b"), (1, "moe"), (2, "1b"), (2, "1b"), (2, "moe"), (2, "moe"), (2, "moe")]
    assert all(c["script"] == "benchmarks/train_step.py" and c["args"][-2:] == ["bf16", "fp8"] for c in calls)
    by_name = dict(zip(sections, calls))
    assert {"parallel.tp=2", "parallel.sequence_parallel=true"} <= set(by_name["dense_tp2"]["args"])
    assert "parallel.pp=2" in by_name["dense_pp2"]["args"] and "parallel.ep=2" in by_name["moe_ep2"]["args"]


def test_gpu_8_script_installs_deepgemm_first_only_when_asked(tmp_path):
    summary, _ = gpu_8(tmp_path, 1, "one_gpu", DEEPGEMM="1", DEEPGEMM_SRC=str(tmp_path / "no_dg"))
    assert f"no DeepGEMM source in {tmp_path / 'no_dg'}" in summary
    assert summary.index("no DeepGEMM source") < summary.index("## dense_1gpu")


def test_gpu_8_script_on_eight_gpus_also_runs_the_layout_the_planner_recommends(tmp_path):
    """On eight GPUs: the 16B MoE at TP2 x PP2 x EP2 (DualPipeV, SP), the planner's layout table, the layout it
    recommends (its overrides passed as they are), and the ~1B at DP=8 and TP=2 x DP=4, all on eight ranks."""
    python = sys.executable
    summary, calls = gpu_8(tmp_path, 8, "eight_gpus", planner=f'exec {python} tools/plan.py "$@"')
    sections = [line[3:] for line in summary.splitlines() if line.startswith("## ")]
    assert sections == ["moe16b_tp2_pp2_ep2", "moe16b_layouts", "moe16b_recommended", "dense_dp8", "dense_tp2_dp4"]
    assert len((tmp_path / "plan.calls").read_text().splitlines()) == 1  # the planner runs once (torch's import)
    assert "FAILED" not in summary and "recommended overrides: " in summary
    recommended = summary.split("recommended overrides: ")[1].splitlines()[0].split()
    assert [c["ranks"] for c in calls] == [8, 8, 8, 8]
    assert set(recommended) <= set(calls[1]["args"]) and "16b_moe_fp8" in calls[1]["args"]
    assert {"parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=dualpipev"} <= set(calls[0]["args"])


def test_gpu_8_script_skips_the_recommended_layout_only_where_the_planner_finds_none_fits(tmp_path):
    """The planner's answer "no layout fits" (the real planner, told the GPUs hold 1 GiB) skips the recommended
    layout; a planner that fails (the real one on a bad config, or one that crashes mid-table) is a FAILED line with
    its error, not that skip, and no recommended layout runs."""
    python = sys.executable
    summary, calls = gpu_8(tmp_path / "none_fits", 8, "eight_gpus",
                           planner=f'exec {python} tools/plan.py "$@" --gpu-gib 1')
    assert "no layout fits, for these reasons" in summary  # the planner's own table, under moe16b_layouts
    assert "## moe16b_recommended: SKIPPED: the planner found no layout that fits" in summary
    assert "FAILED" not in summary
    assert [c["ranks"] for c in calls] == [8, 8, 8]  # the fixed layouts only

    summary, calls = gpu_8(tmp_path / "bad_config", 8, "eight_gpus",
                           planner=f'exec {python} tools/plan.py "$@" model.no_such_key=1')
    assert "## moe16b_recommended: FAILED: the layout planner (tools/plan.py --layouts) failed (rc 2): error: " \
        "unknown config key 'model.no_such_key'" in summary
    assert "no layout that fits" not in summary and [c["ranks"] for c in calls] == [8, 8, 8]

    crash = ("echo '| | tp | pp | ep | dp |'; "
             f"exec {python} -c 'raise RuntimeError(\"CUDA error: no kernel image is available\")'")
    summary, calls = gpu_8(tmp_path / "crash", 8, "eight_gpus", planner=crash)
    line = next(line for line in summary.splitlines() if line.startswith("## moe16b_recommended"))
    assert line.startswith("## moe16b_recommended: FAILED: the layout planner (tools/plan.py --layouts) failed "
                           "(rc 1): ") and "RuntimeError: CUDA error: no kernel image is available" in line, line
    assert "no layout that fits" not in summary and [c["ranks"] for c in calls] == [8, 8, 8]


def test_gpu_8_script_compares_the_loss_runs_only_where_both_finished(tmp_path):
    """loss_8gpu: tools/compare_runs.py compares the one-GPU and TP=2 x DP=4 runs where both exit 0; where either
    failed or timed out, the comparison is skipped, and the summary names the run and why (a comparison over the
    steps a cut-short run logged would read as a valid one)."""
    summary, calls = gpu_8(tmp_path / "both", 8, "loss_8gpu")
    assert "## loss_compare\n| fake row |" in summary and "SKIPPED" not in summary and "FAILED" not in summary
    compare = [c for c in calls if c["script"] == "tools/compare_runs.py"]
    assert len(compare) == 1 and [Path(a).name for a in compare[0]["args"][:2]] == ["fp8_1gpu", "fp8_tp2_dp4"]
    assert compare[0]["args"][-2:] == ["--max-loss-gap", "0.05"]  # the header's limit is checked, not only printed
    for run in ("fp8_1gpu", "fp8_tp2_dp4"):  # both runs' metrics come back in $OUT, with the results
        assert json.loads((tmp_path / "both" / "out" / "loss_runs" / run / "metrics.jsonl").read_text())["run"] == run

    summary, calls = gpu_8(tmp_path / "failed", 8, "loss_8gpu", FAKE_FAIL="fp8_tp2_dp4")
    assert "## loss_compare: SKIPPED: loss_tp2_dp4 did not finish (failed, rc 1: error: fp8_tp2_dp4 diverged at " \
        "step 57)\n" in summary
    assert "## loss_compare\n" not in summary and not any(c["script"] == "tools/compare_runs.py" for c in calls)
    assert [p.parent.name for p in (tmp_path / "failed" / "out").glob("loss_runs/*/metrics.jsonl")] == ["fp8_1gpu"]

    summary, calls = gpu_8(tmp_path / "timed_out", 8, "loss_8gpu", FAKE_HANG="fp8_1gpu", FAKE_FAIL="fp8_tp2_dp4",
                           STEP_TIMEOUT="2")
    assert "## loss_compare: SKIPPED: loss_1gpu did not finish (timed out after 2 s); loss_tp2_dp4 did not finish " \
        "(failed, rc 1: error: fp8_tp2_dp4 diverged at step 57)\n" in summary
    assert "## loss_compare\n" not in summary and not any(c["script"] == "tools/compare_runs.py" for c in calls)


def test_gpu_8_script_names_a_corpus_that_failed_and_runs_no_loss_run_without_it(tmp_path):
    summary, calls = gpu_8(tmp_path, 8, "loss_8gpu", FAKE_CORPUS_FAIL="1")
    assert "## stdlib_corpus: FAILED (rc 1): error: no space left on device: /tmp/pystdlib" in summary
    assert [c["script"] for c in calls] == ["tools/preprocess_data.py"] and "## loss_1gpu" not in summary


@pytest.mark.parametrize("script", ["gpu_8.sh", "gpu_2gpu.sh", "gpu_e2e.sh"])
def test_gpu_scripts_refuse_an_unknown_part_before_running_anything(tmp_path, script):
    """A misspelt part is a usage error naming it and the script's parts (exit 2), before any part runs: gpu_e2e.sh
    ran nothing and said nothing of it, the GPU call spent."""
    bin_dir = stand_in_tools(tmp_path, tmp_path / "never_run.py", 8, ("benchmarks/train_step.py",),
                             keep_script_arg=False)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    known = {"gpu_8.sh": "one_gpu", "gpu_2gpu.sh": "dp2_8b", "gpu_e2e.sh": "moe_auto"}[script]
    result = subprocess.run(["bash", f"benchmarks/{script}", known, "moe_atuo", "one_gpus"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and not (tmp_path / "out" / "summary.md").exists()
    message = result.stderr.strip()
    assert message.startswith(f"{script}: unknown part(s): moe_atuo one_gpus; its parts: ") and f" {known} " in message


def joined_scaling_rows(tmp_path, *summaries: str) -> list[list[str]]:
    """`scaling_table.py` over the summaries (each written to a file, in order): its rows, in order."""
    paths = []
    for i, summary in enumerate(summaries):
        paths.append(tmp_path / f"summary_{i}.md")
        paths[-1].write_text(summary)
    joined = subprocess.run([sys.executable, "benchmarks/scaling_table.py", *map(str, paths), "--baselines",
                             "one_gpu_8b", "one_gpu_1b"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert joined.returncode == 0, joined.stderr
    return [[c.strip() for c in line.strip("|").split("|")] for line in joined.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| layout")]


def test_scaling_table_sets_each_fp8_row_beside_the_bf16_row_of_its_own_run(tmp_path):
    """The same part in two joined summaries (a layout timed again): each FP8 row's ratio is to the BF16 row of
    its own run, not to the last BF16 row of that section's name."""
    summary, _ = gpu_2gpu(tmp_path, "dp2_8b")
    # the stand-in's DP=2 8B-layer rows: BF16 78,000 tokens/s, FP8 97,500 (1.25x); in the second run BF16 is slower
    assert summary.count("| 78,000 |") == 1
    again = summary.replace("| 78,000 |", "| 39,000 |")
    ratios = [r[6] for r in joined_scaling_rows(tmp_path, summary, again) if r[0] == "dp2_8b" and r[2] == "fp8"]
    assert ratios == ["1.25x", "2.50x"]
def test_scaling_table_compares_a_later_call_only_with_one_gpu_rows_of_its_own_card(tmp_path):
    """A later call's two-GPU rows joined with the first call's one-GPU rows: where the later call got other cards
    (an H100 pair for a call that asked for H200s), its efficiency is not taken against the other card's one-GPU
    figure, and the rows name their card."""
    (tmp_path / "first").mkdir()
    (tmp_path / "later").mkdir()
    first, _ = gpu_2gpu(tmp_path / "first", "one_gpu")
    later, _ = gpu_2gpu(tmp_path / "later", "dp2_8b")
    rows = {(r[0], r[2]): r for r in joined_scaling_rows(tmp_path, first, later)}
    assert rows[("dp2_8b", "fp8")][5] == "97.5%"  # the same card: compared
    rows = {(r[0], r[2]): r for r in joined_scaling_rows(tmp_path, first, later.replace("Fake GPU", "Other GPU"))}
    assert rows[("dp2_8b (Other GPU)", "fp8")][5] == "n/a (the one-GPU row ran on another card)", rows
    assert rows[("one_gpu_8b (Fake GPU)", "fp8")][5] == "100.0%"


