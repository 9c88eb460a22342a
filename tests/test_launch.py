"""The launcher end to end: torchrun with 2 ranks (gloo), plain python, and bad input at the command line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from tests.conftest import REPO, side_by_side, torchrun_env

PRETRAIN = str(REPO / "launch" / "pretrain.py")


def torchrun(nproc: int, args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           PRETRAIN, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=torchrun_env(), cwd=REPO)


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_run_matches_one_rank_with_accumulation(tiny_overrides, tmp_path):
    """DP=2 x 2 micro-batches sees the same global batches as DP=1 x 4 micro-batches: same losses."""
    result = torchrun(2, ["--config", "tiny_dense", *tiny_overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "initialized gloo with 2 ranks" in out
    assert out.count("step 6/6 |") == 1  # rank 0 alone logs
    # Current collective APIs: no deprecation warning from torch (0800a78 printed 8 FutureWarnings per run).
    assert "FutureWarning" not in result.stderr and "DeprecationWarning" not in result.stderr, result.stderr
    records = read_metrics(tmp_path / "runs" / "t")
    two_rank = [r["loss"] for r in records if r["kind"] == "train"]
    assert two_rank[-1] < two_rank[0] - 0.5

    torch.manual_seed(0)
    single = Trainer(load_config("tiny_dense", tiny_overrides + [f"logging.output_dir={tmp_path / 'one'}"]),
                     ParallelDims.single(), torch.device("cpu"))
    one_rank = [r["loss"] for r in single.fit() if r["kind"] == "train"]
    # Identical weights and data before the first update: equal up to the order of summing micro-batch losses.
    assert two_rank[0] == pytest.approx(one_rank[0], rel=2e-7)
    torch.testing.assert_close(torch.tensor(two_rank), torch.tensor(one_rank), rtol=2e-3, atol=0)


def test_plain_python_runs_one_rank(tiny_overrides):
    cmd = [sys.executable, PRETRAIN, "--config", "tiny_dense", *tiny_overrides, "training.steps=2",
           "training.eval_interval=0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=torchrun_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2/2 |" in result.stdout + result.stderr


def test_bad_key_under_torchrun_gives_one_clear_error(tiny_overrides):
    result = torchrun(2, ["--config", "tiny_dense", *tiny_overrides, "model.num_layer=3"], timeout=120)
    assert result.returncode != 0
    line = "error: unknown config key 'model.num_layer'. Did you mean 'model.num_layers'?"
    printed = [x for x in result.stderr.splitlines() if x.startswith(line)]
    assert len(printed) == 1, result.stderr  # once per job, not once per rank
    # torchrun reports the failed child with its own traceback; ours must not add one.
    assert 'megafp8/' not in result.stderr and 'pretrain.py", line' not in result.stderr
    # torchrun's failure summary carries the same line, through the error file, instead of "To enable traceback".
    assert f"traceback : {printed[0]}" in result.stderr
    assert "To enable traceback see" not in result.stderr
    assert result.stderr.index(printed[0]) < result.stderr.index("ChildFailedError")  # our line comes first


def test_missing_config_name_exits_2():
    cmd = [sys.executable, PRETRAIN, "--config", "no_such_config"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=torchrun_env(), cwd=REPO)
    assert result.returncode == 2
    assert "error: config 'no_such_config' not found" in result.stderr


def test_print_config_shows_resolved_values():
    cmd = [sys.executable, PRETRAIN, "--config", "tiny_dense", "--print-config", "model.num_layers=3"]
    result, with_data = side_by_side(*(lambda args=args: subprocess.run(cmd + args, capture_output=True, text=True,
                                                                        timeout=60, env=torchrun_env(), cwd=REPO)
                                       for args in ([], ["data.path=/nonexistent"])))
    assert result.returncode == 0
    assert "num_layers: 3" in result.stdout and "hidden_size: 256" in result.stdout
    # vocab_size: null is resolved at start-up; the printed config says to what (it read "null" and nothing more)
    assert "vocab_size: null" in result.stdout and "# model.vocab_size: null is " in result.stdout
    assert with_data.stdout.endswith("# model.vocab_size: null is set at start-up from the tokenizer of the data at "
                                     "/nonexistent\n"), with_data.stdout[-300:]


def test_print_config_says_what_a_null_vocabulary_resolves_to(corpus_dir):
    from megafp8.config import load_config
    from megafp8.train.plan import vocab_note

    note = vocab_note(load_config("tiny_dense", [f"data.path={corpus_dir}", "model.vocab_size=null"]))
    assert note == (f"# model.vocab_size: null is 384 at start-up: the 258 ids of {corpus_dir}'s tokenizer (byte), "
                    "padded (model.pad_vocab_to_multiple_of)\n")
    assert vocab_note(load_config("tiny_dense", ["model.vocab_size=512"])) is None


def test_two_rank_fp8_run_tracks_bf16(tiny_overrides, tmp_path):
    """Same seed, data and layout; only the recipe differs. FP8 (reference backend on CPU) must fall like BF16
    and stay within 2% of its loss at every step (DeepSeek-V3 reports <0.25% at scale after long training;
    over 10 steps of a tiny model the per-step gap is dominated by the noise of early steps, measured <0.5%)."""
    losses = {}
    for recipe in ("bf16", "fp8"):
        out = tmp_path / recipe
        result = torchrun(2, ["--config", "tiny_dense", *tiny_overrides, f"precision.recipe={recipe}",
                              "training.steps=10", "training.eval_interval=0", f"logging.output_dir={out}"])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[recipe] = [r["loss"] for r in read_metrics(out / "t") if r["kind"] == "train"]
    assert "fp8: backend reference (auto) | 8 of 9 GEMM layers in FP8" in result.stdout + result.stderr
    bf16, fp8 = torch.tensor(losses["bf16"]), torch.tensor(losses["fp8"])
    assert fp8[-1] < fp8[0] - 1.0
    gap = ((fp8 - bf16).abs() / bf16).max().item()
    print(f"max relative FP8-BF16 loss gap over {len(bf16)} steps: {gap:.4%}")
    assert gap < 0.02, f"FP8 vs BF16 loss gap {gap:.4f}: {losses}"


def test_checkpoint_from_two_sharded_ranks_resumes_on_one(tiny_overrides, tmp_path):
    """Optimizer state is saved by parameter name, gathered from the shards: a DP=2 checkpoint resumes at DP=1."""
    ckpt = tmp_path / "ckpt"
    common = ["training.eval_interval=0", f"checkpoint.dir={ckpt}", "checkpoint.keep_last=0"]
    result = torchrun(2, ["--config", "tiny_dense", *tiny_overrides, *common, "checkpoint.interval=3",
                          f"logging.output_dir={tmp_path / 'two'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    two_rank = [r["loss"] for r in read_metrics(tmp_path / "two" / "t") if r["kind"] == "train"]
    cfg = load_config("tiny_dense", tiny_overrides + common + [f"checkpoint.resume={ckpt / 'step_00000003'}",
                                                               f"logging.output_dir={tmp_path / 'one'}"])
    resumed = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    assert resumed.step == 3
    one_rank = [r["loss"] for r in resumed.fit() if r["kind"] == "train"]
    torch.testing.assert_close(torch.tensor(one_rank), torch.tensor(two_rank[3:]), rtol=2e-3, atol=0)


def test_evaluate_gives_one_loss_at_any_rank_count(tiny_overrides, tmp_path):
    """A checkpoint saved on one rank, evaluated by `--evaluate` on two ranks (DP=2: each evaluates half of the
    held-out micro-batches) and on one: the same loss, and that of the run's own evaluation at that step."""
    common = [*tiny_overrides, f"logging.output_dir={tmp_path}", "checkpoint.interval=2", "training.steps=2",
              "training.eval_interval=2", "training.eval_iters=4", "checkpoint.format=sharded"]
    Trainer(load_config("tiny_dense", common), ParallelDims.single(), torch.device("cpu")).fit()
    logged = [r["val_loss"] for r in read_metrics(tmp_path / "t") if r["kind"] == "eval"]
    two = torchrun(2, ["--config", "tiny_dense", "--evaluate", *common])
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, PRETRAIN, "--config", "tiny_dense", "--evaluate", *common],
                         capture_output=True, text=True, timeout=120, env=torchrun_env(), cwd=REPO)
    assert one.returncode == 0, one.stderr[-3000:]
    records = [json.loads(result.stdout.strip().splitlines()[-1]) for result in (two, one)]
    assert [r["step"] for r in records] == [2, 2] and two.stdout.count('"val_loss"') == 1  # printed by rank 0 only
    assert records[0]["val_loss"] == pytest.approx(records[1]["val_loss"], rel=1e-5)
    assert records[1]["val_loss"] == pytest.approx(logged[-1], rel=1e-6)


def test_divergence_stops_with_one_clear_error(tiny_overrides):
    cmd = [sys.executable, PRETRAIN, "--config", "tiny_dense", *tiny_overrides, "optimizer.lr=1e6",
           "training.eval_interval=0", "training.max_consecutive_skips=2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=torchrun_env(), cwd=REPO)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "2 steps in a row from step" in errors[0] and "Lower optimizer.lr" in errors[0], errors
    assert "Traceback" not in result.stderr


def _ranks_launched_differently_worker(rank, world):
    from megafp8.config import ConfigError
    from megafp8.train.runtime import check_same_config

    dims = ParallelDims.from_config(load_config("tiny_dense").parallel)
    check_same_config(load_config("tiny_dense", ["optimizer.lr=1e-3"]), dims)  # the same on both ranks: passes
    rank_lr = ["optimizer.lr=1e-3"] if rank == 0 else ["optimizer.lr=1e-2"]
    try:
        check_same_config(load_config("tiny_dense", rank_lr), dims)
    except ConfigError as err:
        assert str(err) == ("the ranks were launched with different settings: optimizer.lr is 0.001 on rank 0; 0.01 "
                            "on rank 1. Launch every rank with the same config file and overrides"), str(err)
    else:
        raise AssertionError(f"rank {rank}: ranks of other learning rates were not refused")


def test_ranks_launched_with_different_settings_are_refused_on_every_rank():
    """A launcher that gave rank 1 another override trained rank 1's shard at another learning rate without a
    word (or, for a setting that changes the collectives, aborted in gloo: "collective mismatch")."""
    from megafp8.train.runtime import _ranks
    from tests.distributed import spawn

    spawn(2, _ranks_launched_differently_worker)
    assert _ranks([0, 1, 2, 3, 5, 7, 8]) == "0-3, 5, 7-8"


def test_a_collective_that_lost_a_rank_is_one_line_not_a_traceback(tmp_path):
    """kill -9 of one rank left each survivor printing gloo's traceback ("Connection reset by peer ... GLHF")."""
    import datetime

    import torch.distributed as dist

    from megafp8.train.main import lost_peer_message

    reset = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:29500: "
                         "Connection reset by peer\nmore lines")
    assert lost_peer_message(reset, 30) is None  # no process group: not a collective's failure
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        assert lost_peer_message(reset, 30) == (
            "rank 0 lost another rank mid-collective: it ended or failed first (torchrun's summary names it, and its "
            "own error comes first in the log) [[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
            "[127.0.0.1]:29500: Connection reset by peer]")
        waited = dist.DistBackendError("[gloo] Timed out waiting 60000ms for recv operation to complete")
        assert lost_peer_message(waited, 1) == (
            "rank 0 waited parallel.timeout_minutes=1 in a collective for a rank that never came (stopped, hung or "
            "far slower) [[gloo] Timed out waiting 60000ms for recv operation to complete]")
        assert lost_peer_message(RuntimeError("shape mismatch"), 30) is None  # anything else stays a traceback
    finally:
        dist.destroy_process_group()


# A task of `srun -n 2` as SLURM 22.05 sets it (tests/test_slurm.py checks these against a real step): the batch
# script itself has the job's SLURM_NTASKS but no SLURM_STEP_NUM_TASKS, and torchrun's workers inherit their node's.
SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}
STARTS_WITHOUT_TORCH = ("import sys; from megafp8.train.command_line import parse_args; "
                        "from megafp8.train.entry import run_staged; "
                        "status = run_staged(parse_args(sys.argv[1:])); print(status, 'torch' in sys.modules)")


def test_tasks_of_srun_without_torchrun_are_refused_before_torch(corpus_dir):
    """`srun -n 2 python launch/pretrain.py` started 2 processes that each saw no RANK or WORLD_SIZE, took
    themselves for rank 0 of 1 and trained alone (then collided on the run directory's lock, which said another run
    held it). Each task now stops at once, before torch is imported; the step's first task alone prints the line.
    tools/plan.py, which shares the entry, too."""
    def started(procid: str, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *command, "--config", "tiny_dense", f"data.path={corpus_dir}"],
                              capture_output=True, text=True, timeout=120, cwd=REPO,
                              env={**torchrun_env(), **SRUN_TASK, "SLURM_PROCID": procid})

    first, second, staged, plan = side_by_side(
        lambda: started("0", PRETRAIN, "--dry-run"), lambda: started("1", PRETRAIN, "--dry-run"),
        lambda: started("0", "-c", STARTS_WITHOUT_TORCH, "--dry-run"), lambda: started("0", "tools/plan.py"))
    assert first.returncode == 2 and first.stdout == "", first.stdout[-2000:]
    assert first.stderr.count("\n") == 1 and first.stderr.startswith(
        "error: srun started this process as one of 2 tasks (SLURM_STEP_NUM_TASKS=2) without torchrun"), first.stderr
    assert "launch/slurm/pretrain.sbatch" in first.stderr and "launch/slurm/submit.py" in first.stderr
    assert (second.returncode, second.stdout, second.stderr) == (2, "", "")  # task 0 says it for the step
    assert staged.stdout == "2 False\n", staged.stdout[-2000:]
    assert plan.returncode == 2 and plan.stdout == "" and plan.stderr == first.stderr, plan.stdout[-2000:]


@pytest.mark.parametrize("env, tasks", [
    ({}, 0),  # plain python
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, 0),  # the batch script of `sbatch -n 2`, once
    ({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}, 0),  # `srun -n 1`
    ({**SRUN_TASK, "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "7"}, 0),  # torchrun's
    ({**SRUN_TASK, "SLURM_PTY_PORT": "33577"}, 0),  # a person's shell of `srun -n 2 --pty bash`: one process
    (SRUN_TASK, 2),
])
def test_only_several_srun_tasks_without_a_launcher_count(monkeypatch, env, tasks):
    from megafp8.train.command_line import srun_tasks_without_torchrun

    for var in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS",
                "SLURM_PTY_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert srun_tasks_without_torchrun() == tasks
