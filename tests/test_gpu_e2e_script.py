"""`benchmarks/gpu_e2e.sh`'s parts (and `deepgemm_source.sh`) run on a CPU with stand-ins for `nvidia-smi` and the
benchmarks they call: which runs each part makes, with which settings, and what lands in the summary."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from tests.conftest import REPO


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


def test_gpu_e2e_moe_auto_hands_its_overrides_to_every_run(tmp_path):
    """`MOE_OVERRIDES="a=1 b=2" gpu_e2e.sh moe_auto` (e.g. the AdamW moments in BF16, as the 671B config keeps them)
    passes both overrides to each of its runs, the balanced and the four-micro-batch one included; without it the
    runs get none."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["moe_auto"], 'echo "$*" >> ../train_step_args.txt',
                                    env={"MOE_REPEATS": "2", "MOE_ACCUM": "1", "MOE_WARMUP": "4",
                                         "MOE_OVERRIDES": "optimizer.moment_dtype=bf16 training.seed=3",
                                         "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [r.split() for r in (tmp_path / "train_step_args.txt").read_text().splitlines()]
    assert len(runs) == 4  # two pairs, the balanced one, the four-micro-batch one
    assert all("optimizer.moment_dtype=bf16" in r and "training.seed=3" in r for r in runs)
    assert all(r[r.index("--recipes") + 1:] == ["bf16", "fp8"] for r in runs)
    (tmp_path / "plain").mkdir()
    plain = _gpu_e2e_with_fake_gpu(tmp_path / "plain", ["moe_auto"], 'echo "$*" >> ../train_step_args.txt',
                                   env={"MOE_REPEATS": "1", "MOE_BALANCED": "0",
                                        "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert (tmp_path / "plain" / "train_step_args.txt").read_text().split() == [
        "benchmarks/train_step.py", "training.compile=true", "training.compile_mode=reduce-overhead", "--model", "moe",
        "--recipes", "bf16", "fp8"]


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


def test_gpu_e2e_determinism_compares_each_model_plain_then_deterministic_with_deepgemm_placed(tmp_path):
    """`gpu_e2e.sh determinism`: `determinism.py` on each of REPEAT_MODELS, plain and then with `--deterministic`,
    both recipes under CUDA graphs, after DeepGEMM is placed (here its missing source is said in the summary); each
    run's tables in the summary under its own heading."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["determinism"], 'echo "$*" >> ../determinism_args.txt; echo "| table |"',
                                    script="benchmarks/determinism.py",
                                    env={"REPEAT_MODELS": "1b 8b-layers", "REPEAT_STEPS": "3",
                                         "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [r.split() for r in (tmp_path / "determinism_args.txt").read_text().splitlines()]
    assert [(r[r.index("--model") + 1], "--deterministic" in r) for r in runs] \
        == [("1b", False), ("1b", True), ("8b-layers", False), ("8b-layers", True)]
    assert all(r[r.index("--steps") + 1] == "3" and "training.compile_mode=reduce-overhead" in r
               and r[r.index("--recipes") + 1:r.index("--recipes") + 3] == ["bf16", "fp8"] for r in runs)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "no DeepGEMM source" in summary
    for model in ("1b", "8b-layers"):
        for mode in ("plain", "deterministic"):
            heading = f"## determinism_{model}_{mode}"
            assert heading in summary and "| table |" in summary.split(heading)[1].split("##")[0], summary


def test_gpu_e2e_determinism_runs_each_part_of_the_mode_alone_when_asked(tmp_path):
    """REPEAT_MODES names the modes, a part of `training.deterministic` running alone (`--only PART`), each in a
    process of its own, a mode named again as another numbered draw; REPEAT_RECIPES the recipes."""
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["determinism"], 'echo "$*" >> ../determinism_args.txt; echo "| table |"',
                                    script="benchmarks/determinism.py",
                                    env={"REPEAT_MODES": "plain inductor algorithms algorithms",
                                         "REPEAT_RECIPES": "fp8", "DEEPGEMM_SRC": str(tmp_path / "no_source")})
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [r.split() for r in (tmp_path / "determinism_args.txt").read_text().splitlines()]
    assert [r[r.index("--recipes") + 1:] for r in runs] == [["fp8"], ["fp8", "--only", "inductor"],
                                                            ["fp8", "--only", "algorithms"],
                                                            ["fp8", "--only", "algorithms"]]
    assert all(r[r.index("--model") + 1] == "8b-layers" and "--deterministic" not in r for r in runs)
    summary = (tmp_path / "out" / "summary.md").read_text()
    headings = [line for line in summary.splitlines() if line.startswith("## determinism_")]
    assert headings == [f"## determinism_8b-layers_{mode}"
                        for mode in ("plain", "inductor", "algorithms", "algorithms_2")], summary


def test_the_two_gpu_parts_say_they_are_skipped_on_one_gpu_and_start_no_ranks(tmp_path):
    """moe_ep2, moe_dp2, dense_2gpu and cp_2gpu started two ranks on one GPU: rank 1 failed at once, and the summary's
    FAILED line (torchrun's last lines) left out why. Now each says it needs two GPUs; cp_2gpu's one-GPU row runs."""
    recording_torchrun = '#!/usr/bin/env bash\necho "$@" >> "$OUT/torchrun_calls.txt"\n'
    result = _gpu_e2e_with_fake_gpu(tmp_path, ["moe_ep2", "moe_dp2", "dense_2gpu", "cp_2gpu"],
                                    "echo one-gpu-row >> rows.txt", env={"GPUS": "1"},
                                    tools={"torchrun": recording_torchrun})
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    summary = (out / "summary.md").read_text()
    for part in ("moe_ep2", "moe_dp2", "dense_2gpu", "cp_2gpu"):
        assert f"## {part}: SKIPPED: needs 2 GPUs, 1 visible" in summary, summary
    assert not (out / "torchrun_calls.txt").exists()
    assert (out / "rows.txt").read_text() == "one-gpu-row\n"  # cp_one_gpu
