"""The GPU benchmark scripts (`benchmarks/gpu_2gpu.sh`, `gpu_8.sh`, `gpu_e2e.sh`'s clock and memory parts) run on a
CPU with stand-ins for `train_step.py`, `torchrun` and `nvidia-smi`: which parts they run, on how many GPUs, what
they skip and why, and the tables they compute from the stand-ins' rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

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
# A stand-in for benchmarks/train_step.py and launch/pretrain.py: logs its arguments and rank count, prints a row.
FAKE_RUN = r'''
import json, os, sys
with open(os.environ["FAKE_CALLS"], "a") as calls:
    calls.write(json.dumps({"script": sys.argv[1], "ranks": int(os.environ.get("FAKE_RANKS", "1")),
                            "args": sys.argv[2:]}) + "\n")
print("| fake row |")
'''


def gpu_8(tmp_path, gpus: int, *parts, **extra_env):
    """benchmarks/gpu_8.sh with `gpus` GPUs reported, the training scripts and torchrun replaced by the stand-in
    (the planner, tools/plan.py, is the real one); returns (summary.md, the logged calls)."""
    out = tmp_path / "out"
    fake = tmp_path / "fake_run.py"
    fake.write_text(FAKE_RUN)
    bin_dir = stand_in_tools(tmp_path, fake, gpus, ("benchmarks/train_step.py", "launch/pretrain.py"),
                             keep_script_arg=True)
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
    summary, calls = gpu_8(tmp_path, 8, "eight_gpus")
    sections = [line[3:] for line in summary.splitlines() if line.startswith("## ")]
    assert sections == ["moe16b_tp2_pp2_ep2", "moe16b_layouts", "moe16b_recommended", "dense_dp8", "dense_tp2_dp4"]
    assert "FAILED" not in summary and "recommended overrides: " in summary
    recommended = summary.split("recommended overrides: ")[1].splitlines()[0].split()
    assert [c["ranks"] for c in calls] == [8, 8, 8, 8]
    assert set(recommended) <= set(calls[1]["args"]) and "16b_moe_fp8" in calls[1]["args"]
    assert {"parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=dualpipev"} <= set(calls[0]["args"])


# ------------------------------------------------------------------------ benchmarks/gpu_e2e.sh clocks_8b
# A stand-in nvidia-smi: the GPU list for the summary's head, success for the probe of a field name, and for a
# sampling query (-lms) a CSV of one idle and three busy samples, then it waits to be stopped.
FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
case "$*" in
  *name,memory.total*) printf 'name, memory.total [MiB]\\nFake GPU, 1 MiB\\n' ;;
  *-lms*)
    echo "timestamp, utilization.gpu [%], clocks.current.sm [MHz], clocks.max.sm [MHz], power.draw [W], \\
power.limit [W], temperature.gpu, clocks_event_reasons.active"
    echo "2026/12/01 05:00:00.000, 0 %, 345 MHz, 1980 MHz, 90.00 W, 700.00 W, 30, 0x0000000000000001"
    echo "2026/12/01 05:00:00.200, 100 %, 1980 MHz, 1980 MHz, 600.50 W, 700.00 W, 50, 0x0000000000000000"
    echo "2026/12/01 05:00:00.400, 99 %, 1755 MHz, 1980 MHz, 700.00 W, 700.00 W, 61, 0x0000000000000004"
    echo "2026/12/01 05:00:00.600, 100 %, 1800 MHz, 1980 MHz, 690.00 W, 700.00 W, 62, 0x0000000000000004"
    exec sleep 60 ;;
esac
"""


def _gpu_e2e_with_fake_gpu(tmp_path, parts: list[str], on_train_step: str, script: str = "benchmarks/train_step.py",
                           env: Optional[dict] = None, tools: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`gpu_e2e.sh PARTS` with OUT=tmp_path/out, the stand-in nvidia-smi, and a `python` that runs the shell line
    `on_train_step` in OUT (instead of the benchmark) for each call of `script` and runs everything else; `tools`:
    more stand-ins on the PATH, {name: bash script}."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    for name, text in (tools or {}).items():
        (bin_dir / name).write_text(text)
    (bin_dir / "python").write_text(f"""#!/usr/bin/env bash
if [ "$1" = {script} ]; then (cd "{out}" && {on_train_step}); exit 0; fi
if [ "$1" = -c ]; then exit 0; fi  # "import torchao": installed, nothing to install
exec {sys.executable} "$@"
""")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out), **(env or {}))
    return subprocess.run(["bash", "benchmarks/gpu_e2e.sh", *parts], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def test_gpu_e2e_ncu_producers_part_profiles_the_producer_kernels_with_their_wavefront_counters(tmp_path):
    """`gpu_e2e.sh ncu_producers` runs Nsight Compute once over `benchmarks/producer_kernels.py`, on the producers'
    Gluon kernels (SwiGLU backward's columns by name), with the L1 wavefront, shared, bank-conflict and global-sector
    counters that located their bound (docs/benchmarks.md jobs FA-FC) as one metrics list."""
    recording_ncu = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT/ncu_args.txt"\n'
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["ncu_producers"], "true", tools={"ncu": recording_ncu})
    assert result.returncode == 0, result.stderr[-3000:]
    args = (tmp_path / "out" / "ncu_args.txt").read_text().splitlines()
    assert args[args.index("--kernel-name") + 1] == "regex:gluon|swiglu_backward_cols"
    metrics = args[args.index("--metrics") + 1].split(",")
    assert {"l1tex__data_pipe_lsu_wavefronts.sum", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
            "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
            "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"} == set(metrics)
    assert args[-2:] == ["python", "benchmarks/producer_kernels.py"]


def test_gpu_e2e_clocks_part_samples_each_recipes_steps_and_summarizes_the_busy_samples(tmp_path):
    """`gpu_e2e.sh clocks_8b` samples clocks and power while BF16, then FP8, run the 8B-layer step, stops each
    sampler, and summarizes only the busy samples: median and lowest SM clock, power against its limit, and the
    clock event reasons (here a power cap in two of three busy samples)."""
    out = tmp_path / "out"
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["clocks_8b"], 'echo "$*" >> steps.log; sleep 0.3')
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert [line[3:] for line in summary.splitlines() if line.startswith("## ")] == \
        ["steps_8b_bf16", "steps_8b_fp8", "clocks_8b"], summary
    assert "FAILED" not in summary
    steps = (tmp_path / "out" / "steps.log").read_text().splitlines()
    assert len(steps) == 2 and all("--model 8b-layers" in s and "compile_mode=reduce-overhead" in s for s in steps)
    assert [s.split("--recipes ")[1] for s in steps] == ["bf16", "fp8"]
    rows = [line for line in summary.splitlines() if line.startswith("| bf16 ") or line.startswith("| fp8 ")]
    assert len(rows) == 2, summary
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:] == ["3 of 4", "1800 / 1755 (1980)", "690 (700)", "62", "SW power cap 67%; none 33%"], row
    assert "sleep 60" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_gpu_e2e_clocks_gemm_part_samples_each_gemm_run_back_to_back(tmp_path):
    """`gpu_e2e.sh clocks_gemm` samples clocks and power while one GEMM at the 8B-layer gate/up shape runs back to
    back from a CUDA graph: the fprop as BF16's GEMM, cuBLAS's blockwise FP8 GEMM and ours, the wgrad as cuBLASLt's
    and ours, one process each; it stops each sampler and summarizes the five runs' busy samples."""
    out = tmp_path / "out"
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["clocks_gemm"], 'printf "%s|" "$@" >> gemms.log; echo >> gemms.log; '
                                    'sleep 0.3', script="benchmarks/dense_gemm.py")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert [line[3:] for line in summary.splitlines() if line.startswith("## ")] == \
        ["gemm_bf16", "gemm_cublas_fp8", "gemm_ws", "gemm_cublaslt_wgrad", "gemm_ws_wgrad", "clocks_gemm"], summary
    assert "FAILED" not in summary
    calls = [line.split("|") for line in (out / "gemms.log").read_text().splitlines()]
    assert [(call[call.index("--gemms") + 1], call[call.index("--columns") + 1]) for call in calls] == [
        ("fprop", "BF16"), ("fprop", "backend"), ("fprop", "ws 256, interleaved FFMA"), ("wgrad", "backend"),
        ("wgrad", "ws 256, interleaved FFMA")]
    assert all({"--cuda-graphs", "28672,4096"} <= set(call) for call in calls)
    labels = ("bf16", "cublas_fp8", "ws", "cublaslt_wgrad", "ws_wgrad")
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines() if line.startswith("| ")
            and line.split("|")[1].strip() in labels}
    assert sorted(rows) == sorted(labels), summary
    assert all("3 of 4" in row and "SW power cap 67%" in row for row in rows.values()), rows
    assert "sleep 60" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_gpu_e2e_launch_cost_part_times_the_cublas_backend_then_the_hopper_one_with_cprofile(tmp_path):
    """`gpu_e2e.sh launch_cost`: `fp8_launch_cost.py` for the cublas backend, then for the hopper backend with
    cProfile's breakdown (the warp-specialized GEMM's host cost against cuBLAS's), each a step of its own."""
    out = tmp_path / "out"
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["launch_cost"], 'echo "$*" >> calls.log',
                                    script="benchmarks/fp8_launch_cost.py")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert [line[3:] for line in summary.splitlines() if line.startswith("## ")] == \
        ["launch_cost_cublas", "launch_cost_hopper"], summary
    assert "FAILED" not in summary
    assert (out / "calls.log").read_text().splitlines() == [
        "benchmarks/fp8_launch_cost.py", "benchmarks/fp8_launch_cost.py --backend hopper --cprofile 12"]


def test_gpu_e2e_launch_cost_ab_part_interleaves_the_old_tree_and_this_one(tmp_path):
    """`gpu_e2e.sh launch_cost_ab`: `fp8_launch_cost.py` in $OLD, here, here, $OLD (the host's drift reaches both
    trees alike), each a step of its own, for the hopper backend unless LC_BACKEND names another."""
    old = tmp_path / "old_tree"
    (old / "benchmarks").mkdir(parents=True)
    out = tmp_path / "out"
    # the stand-in python runs in OUT; OLDPWD is where it was called from
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["launch_cost_ab"], 'echo "$(basename "$OLDPWD") $*" >> calls.log',
                                    script="benchmarks/fp8_launch_cost.py", env={"OLD": str(old)})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert [line[3:] for line in summary.splitlines() if line.startswith("## ")] == \
        ["launch_cost_1_old_hopper", "launch_cost_2_new_hopper", "launch_cost_3_new_hopper",
         "launch_cost_4_old_hopper"], summary
    assert "FAILED" not in summary
    calls = (out / "calls.log").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["old_tree", REPO.name, REPO.name, "old_tree"], calls
    assert all(c.split()[1:] == ["benchmarks/fp8_launch_cost.py", "--backend", "hopper"] for c in calls), calls


def test_gpu_e2e_memory_parts_run_each_recipe_in_a_fresh_process_with_and_without_expandable_segments(tmp_path):
    """`memory_8b_ro_fresh` and `expandable_8b`: the 8B-layer step under CUDA graphs, FP8 then BF16, one process
    each (one recipe's leftovers would count in the next one's held memory), the allocator as it comes, then with
    expandable segments."""
    out = tmp_path / "out"
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["memory_8b_ro_fresh", "expandable_8b"],
                                    'echo "conf=[$PYTORCH_CUDA_ALLOC_CONF] $*" >> steps.log')
    assert result.returncode == 0, result.stderr[-3000:]
    steps = (out / "steps.log").read_text().splitlines()
    assert [(s.split("]")[0] + "]", s.split("--recipes ")[1]) for s in steps] == [
        ("conf=[]", "fp8"), ("conf=[]", "bf16"),
        ("conf=[expandable_segments:True]", "fp8"), ("conf=[expandable_segments:True]", "bf16")]
    assert all("--model 8b-layers" in s and "compile_mode=reduce-overhead" in s for s in steps)
    summary = (out / "summary.md").read_text()
    assert [line[3:] for line in summary.splitlines() if line.startswith("## ")] == [
        "memory_8b_ro_fresh_fp8", "memory_8b_ro_fresh_bf16", "expandable_8b_fp8", "expandable_8b_bf16"]


def test_clock_event_reasons_read_as_words():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import clocks_summary
    assert clocks_summary.reasons(0) == "none"
    assert clocks_summary.reasons(0x4 | 0x40) == "SW power cap, HW thermal"


def test_gpu_e2e_moe_balanced_part_times_both_recipes_after_the_routers_warm_up(tmp_path):
    """`gpu_e2e.sh moe_balanced` runs the MoE step once for BF16 and FP8 under CUDA graphs after MOE_WARMUP
    untimed steps with the balancing bias moving MOE_BIAS_RATE a step (the first steps route nearly every token
    to one expert), timing 30 steps after them."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["moe_balanced"], 'echo "$*" >> steps.log',
                                    env={"MOE_WARMUP": "150", "MOE_BIAS_RATE": "0.02"})
    assert result.returncode == 0, result.stderr[-3000:]
    steps = (tmp_path / "out" / "steps.log").read_text().splitlines()
    assert len(steps) == 1, steps
    args = steps[0].split()
    assert args[args.index("--model") + 1] == "moe" and args[args.index("--warmup") + 1] == "150"
    assert args[args.index("--steps") + 1] == "180" and "training.compile_mode=reduce-overhead" in args
    assert "model.moe.bias_update_rate=0.02" in args
    assert args[args.index("--recipes") + 1:] == ["bf16", "fp8"]


def test_gpu_e2e_group_m_part_times_the_dense_gemms_in_three_group_widths(tmp_path):
    """`gpu_e2e.sh group_m` runs benchmarks/dense_gemm.py once, replayed from CUDA graphs, on the 8B-layer and ~1B
    linears' fprop and dgrad, with the interleaved kernel's three group widths as its columns."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["group_m"], 'printf "%s\\n" "$@" >> gemm.log',
                                    script="benchmarks/dense_gemm.py")
    assert result.returncode == 0, result.stderr[-3000:]
    args = (tmp_path / "out" / "gemm.log").read_text().splitlines()
    assert args[args.index("--model") + 1:args.index("--model") + 3] == ["8b-layers", "1b"]
    assert args[args.index("--gemms") + 1:args.index("--gemms") + 3] == ["fprop", "dgrad"]
    assert "--cuda-graphs" in args
    assert args[args.index("--columns") + 1:] == ["ws 256, interleaved FFMA", "ws 256, interleaved FFMA, GROUP_M 16",
                                                  "ws 256, interleaved FFMA, GROUP_M 32"]
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dense_gemm
    assert set(args[args.index("--columns") + 1:]) <= set(dense_gemm.ALL_COLUMNS)


# ------------------------------------------------------------------------ benchmarks/deepgemm_source.sh


def _repo_with(path: Path, files: list[str]) -> str:
    """A git repository at `path` with `files` committed; returns its commit."""
    for name in files:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(name)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def test_deepgemm_source_takes_what_the_build_reads_into_an_ignored_dg(tmp_path):
    """`deepgemm_source.sh` writes .dg/DeepGEMM in the work tree it runs in: DeepGEMM's build inputs (not its tests
    or docs), cutlass's and fmt's include/ and licences under third-party/, and lists /.dg/ in .git/info/exclude
    once; without its three clones it says what it needs."""
    deepgemm = _repo_with(tmp_path / "dg", ["csrc/a.cpp", "deep_gemm/__init__.py", "setup.py", "scripts/s.sh",
                                            "third-party/tilelang_ops/t.py", "CMakeLists.txt", "LICENSE",
                                            "tests/test_x.py", "README.md"])
    cutlass = _repo_with(tmp_path / "cutlass", ["include/cute/c.hpp", "LICENSE.txt", "media/big.png"])
    fmt = _repo_with(tmp_path / "fmt", ["include/fmt/f.h", "LICENSE", "doc/d.md"])
    work = tmp_path / "work"
    _repo_with(work, ["x"])
    env = {**os.environ, "DEEPGEMM_COMMIT": deepgemm, "CUTLASS_COMMIT": cutlass, "FMT_COMMIT": fmt}
    script = str(REPO / "benchmarks" / "deepgemm_source.sh")
    for _ in range(2):
        done = subprocess.run(["bash", script, str(tmp_path / "dg"), str(tmp_path / "cutlass"), str(tmp_path / "fmt")],
                              cwd=work, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    dest = work / ".dg" / "DeepGEMM"
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "CMakeLists.txt", "LICENSE", "csrc/a.cpp", "deep_gemm/__init__.py", "scripts/s.sh", "setup.py",
        "third-party/cutlass/LICENSE.txt", "third-party/cutlass/include/cute/c.hpp", "third-party/fmt/LICENSE",
        "third-party/fmt/include/fmt/f.h", "third-party/tilelang_ops/t.py"]
    assert (work / ".git" / "info" / "exclude").read_text().splitlines().count("/.dg/") == 1
    assert subprocess.run(["git", "-C", str(work), "status", "--porcelain"], capture_output=True,
                          text=True).stdout == ""
    usage = subprocess.run(["bash", script], cwd=work, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage:" in usage.stderr and "deepseek-ai/DeepGEMM" in usage.stderr


def test_gpu_e2e_auto_deepgemm_part_puts_the_backend_auto_logged_in_the_summary(tmp_path):
    """`gpu_e2e.sh auto_deepgemm` (the next GPU session's first call): DeepGEMM's install, the resume test's three
    cases, the ~1B step on `auto`, and the backend `auto` chose as the step's log says it."""
    said = ("echo 'fp8: backend deepgemm (auto) | 16 of 17 GEMM layers in FP8' >&2; "
            "echo 'fp8: backend deepgemm (auto) | 16 of 17 GEMM layers in FP8' >&2; echo '| fake row |'")
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["auto_deepgemm"], said,
                                    env={"DEEPGEMM_SRC": str(tmp_path / "no_dg"), "STEP_TIMEOUT": "50"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"no DeepGEMM source in {tmp_path / 'no_dg'}" in summary
    assert summary.index("## gpu_tests_resume") < summary.index("## auto_1b")
    assert summary.count("fp8: backend deepgemm (auto) | 16 of 17 GEMM layers in FP8") == 1
    assert "| fake row |" in summary


def test_gpu_e2e_a_part_that_installs_deepgemm_leaves_the_parts_after_it_on_their_own_backend(tmp_path):
    """install_deepgemm sources DeepGEMM's environment, under which `auto` picks deepgemm: a later part's `auto` rows
    (labelled ours/hopper) ran on DeepGEMM while the parts shared one shell. Each part now runs in a subshell."""
    bin_dir, out, prefix = tmp_path / "bin", tmp_path / "out", tmp_path / "dg"
    bin_dir.mkdir()
    (tmp_path / "src").mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "python").write_text(f"""#!/usr/bin/env bash
case "$1" in
  tools/install_deepgemm.py) mkdir -p "{prefix}"
    printf '# Made by a stand-in\\nexport DEEPGEMM_SOURCED=yes\\n' > "{prefix}/deepgemm.env"; exit 0 ;;
  benchmarks/train_step.py) echo "| $2 | sourced=${{DEEPGEMM_SOURCED:-no}} |"; exit 0 ;;
  -c) exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out),
               DEEPGEMM_SRC=str(tmp_path / "src"), DEEPGEMM_PREFIX=str(prefix), STEP_TIMEOUT="50")
    result = subprocess.run(["bash", "benchmarks/gpu_e2e.sh", "auto_deepgemm", "moe"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert "DeepGEMM ready in" in summary
    assert "| training.compile=true | sourced=yes |" in summary  # auto_deepgemm's ~1B step
    assert "| --model | sourced=no |" in summary  # the moe part after it


@pytest.mark.parametrize("card, runs", [("H200", False), ("Fake GPU", True)])
def test_gpu_e2e_with_a_required_card_runs_nothing_on_another(tmp_path, card, runs):
    """`REQUIRE_CARD=NAME`: on a machine whose GPUs are not all NAME the script says so in the summary and runs no
    part (a step of record that counts on one card only); on NAME's machine it runs as without it."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["moe_auto"], "touch ran_train_step",
                                    env={"REQUIRE_CARD": card, "MOE_REPEATS": "1", "MOE_BALANCED": "0",
                                         "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert (tmp_path / "out" / "ran_train_step").exists() == runs
    assert ("nothing run" in summary) != runs


def test_a_second_script_in_the_same_out_adds_to_the_summary_and_keeps_the_first_logs(tmp_path):
    """Two `gpu_e2e.sh` invocations in one GPU call (one $OUT): the second's tables follow the first's in
    summary.md, and each keeps its logs (logs.tar.gz, logs_2.tar.gz). Job HU lost a table to a second invocation
    that replaced summary.md."""
    first = _gpu_e2e_with_fake_gpu(tmp_path, ["recompute_in_graph_memory"], "echo '| first table |'")
    assert first.returncode == 0, first.stderr[-3000:]
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    second = subprocess.run(["bash", "benchmarks/gpu_e2e.sh", "recompute_in_graph_memory"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.count("## recompute_in_graph_memory") == 2 and summary.count("| first table |") == 2
    assert summary.index("## recompute_in_graph_memory") > summary.index("memory.total")
    assert sorted(p.name for p in (tmp_path / "out").glob("logs*.tar.gz")) == ["logs.tar.gz", "logs_2.tar.gz"]


def test_gpu_e2e_ab_moe_balanced_times_both_trees_after_the_router_has_balanced(tmp_path):
    """`gpu_e2e.sh ab_moe_balanced` hands ab_steps.py the old tree and the MoE step's balanced settings: 210
    untimed steps with the bias moving 0.01 a step, 30 timed, both recipes, CUDA graphs."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["ab_moe_balanced"], 'echo "$*" >> ../ab_args.txt',
                                    script="benchmarks/ab_steps.py",
                                    env={"OLD": "old_tree", "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert result.returncode == 0, result.stderr[-3000:]
    args = (tmp_path / "ab_args.txt").read_text().split()
    assert args[args.index("--old") + 1] == "old_tree"
    step = args[args.index("--") + 1:]
    assert step[step.index("--warmup") + 1] == "210" and step[step.index("--steps") + 1] == "240"
    assert "model.moe.bias_update_rate=0.01" in step and "training.compile_mode=reduce-overhead" in step
    assert step[step.index("--model") + 1] == "moe" and step[-2:] == ["bf16", "fp8"]


def test_gpu_e2e_ab_moe_balanced_times_fp8_alone_when_asked(tmp_path):
    """AB_RECIPES=fp8 times only FP8 in both trees (a change that leaves BF16's code as it was halves the job)."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["ab_moe_balanced"], 'echo "$*" >> ../ab_args.txt',
                                    script="benchmarks/ab_steps.py",
                                    env={"OLD": "old_tree", "AB_RECIPES": "fp8",
                                         "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert result.returncode == 0, result.stderr[-3000:]
    step = (tmp_path / "ab_args.txt").read_text().split()
    assert step[step.index("--recipes") + 1:] == ["fp8"]


@pytest.mark.parametrize("accum", ["0", "1"])
def test_gpu_e2e_moe_auto_adds_a_pair_at_four_micro_batches_only_when_asked(tmp_path, accum):
    """`MOE_ACCUM=1 gpu_e2e.sh moe_auto` runs the MoE step once more with `--global-batch 32` (four micro-batches of
    8 per optimizer step, AdamW amortized as in pretraining); without it, only the MOE_REPEATS pairs run."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["moe_auto"], 'echo "$*" >> ../train_step_args.txt',
                                    env={"MOE_REPEATS": "1", "MOE_BALANCED": "0", "MOE_ACCUM": accum,
                                         "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert ("## moe_auto_accum" in summary) == (accum == "1")
    runs = (tmp_path / "train_step_args.txt").read_text().splitlines()
    assert len(runs) == 1 + int(accum)
    assert ["--global-batch 32" in r for r in runs] == [False] + [True] * int(accum)


def test_gpu_e2e_deterministic_cost_runs_each_model_plain_then_deterministic(tmp_path):
    """`gpu_e2e.sh deterministic_cost`: each of DET_MODELS in a process of its own, plain then under
    `training.deterministic`, both recipes, under CUDA graphs; one table each in the summary."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["deterministic_cost"], 'echo "$*" >> ../train_step_args.txt',
                                    env={"DET_MODELS": "1b moe", "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [r.split() for r in (tmp_path / "train_step_args.txt").read_text().splitlines()]
    assert [(r[r.index("--model") + 1], next(a for a in r if a.startswith("training.deterministic="))) for r in runs] \
        == [("1b", "training.deterministic=false"), ("1b", "training.deterministic=true"),
            ("moe", "training.deterministic=false"), ("moe", "training.deterministic=true")]
    assert all("training.compile_mode=reduce-overhead" in r and r[-2:] == ["bf16", "fp8"] for r in runs)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert all(f"## deterministic_{m}_{d}" in summary for m in ("1b", "moe") for d in ("false", "true")), summary
