"""Shared fixtures: a small tokenized corpus, tiny configs, and the GPU marker's skip."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from megafp8.data.corpus import stdlib_files
from megafp8.data.preprocess import preprocess
from megafp8.precision.cpu_gemm import widen_reduced_precision_gemms
from tests.parity import ParityRuns

# What every CPU run of the framework does where the CPU has no BF16 GEMM instructions (`megafp8.precision.cpu_gemm`),
# for the whole session: the references a test computes itself see the same arithmetic as the runs it checks.
widen_reduced_precision_gemms()
# Under pytest-xdist (`make test`: one worker a core, at most 4), each worker's share of the cores for torch's
# intra-op threads: torch's default, every core, made the workers' threads outnumber the cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# A model small enough that a few steps take well under a second on one CPU core.
TINY_OVERRIDES = [
    "model.hidden_size=128", "model.num_layers=2", "model.num_heads=2", "model.attention.num_kv_heads=1",
    "model.ffn_hidden_size=256", "model.size=null", "data.seq_len=64",
    "training.global_batch_size=8", "training.micro_batch_size=2", "training.steps=6",
    "training.eval_interval=3", "training.eval_iters=2", "optimizer.warmup_steps=2", "optimizer.lr=3e-3",
    "logging.log_interval=1",
]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """The table of logits compared with transformers (tests/test_hf_transformers.py), when those tests ran."""
    rows = [value for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
            for key, value in report.user_properties if key == "logits_vs_transformers"]
    if rows:
        terminalreporter.write_line("\n| checked against transformers (FP32) | max abs logit diff | argmax agreement |")
        terminalreporter.write_line("|---|---|---|")
        for case, diff, agree in rows:
            terminalreporter.write_line(f"| {case} | {diff:.2g} | {100 * agree:.1f}% |")


@pytest.fixture(autouse=True)
def root_logging_left_as_found():
    """A tool run in-process (its `main`) that calls `logging.basicConfig` leaves a handler on the root logger bound to
    the test's captured stderr, which pytest closes after the test: a later test's tool, logging through it, wrote
    "--- Logging error ---" into its own stderr (seen with the tests in another order under pytest-xdist). Such
    handlers, and the level with them, go when the test ends; pytest's own handlers are its to remove."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    added = [h for h in root.handlers if h not in before and type(h) is logging.StreamHandler]
    for handler in added:
        root.removeHandler(handler)
    if added:
        root.setLevel(level)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """~200 KB of real text (the first stdlib modules), byte-tokenized, with a held-out split."""
    src = tmp_path_factory.mktemp("src")
    total = 0
    for i, path in enumerate(stdlib_files()):
        text = path.read_text(encoding="utf-8", errors="replace")
        (src / f"{i:04d}.txt").write_text(text, encoding="utf-8")
        total += len(text)
        if total > 200_000:
            break
    out = tmp_path_factory.mktemp("data") / "corpus"
    preprocess([str(src)], out, valid_fraction=0.2, seed=0, shard_tokens=50_000)
    return out


def one_per_key(*lists: list[str]) -> list[str]:
    """`lists` of overrides joined, each key once with its last value (what the launcher makes of them, less its
    warning about a key given twice): for tests that check a command's whole output."""
    return list({item.partition("=")[0]: item for overrides in lists for item in overrides}.values())


@pytest.fixture
def tiny_overrides(corpus_dir, tmp_path) -> list[str]:
    return TINY_OVERRIDES + [f"data.path={corpus_dir}", f"logging.output_dir={tmp_path / 'runs'}", "run_name=t"]


@pytest.fixture(scope="session")
def saved(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    """Checkpoints of the tiny model's steps 1 and 2, sharded and full: {form: checkpoint root} (copy before
    changing)."""
    from tests.checkpoints import saved_checkpoints

    return saved_checkpoints(corpus_dir, tmp_path_factory.mktemp("saved"))


@pytest.fixture(scope="module")
def parity(corpus_dir, tmp_path_factory) -> ParityRuns:
    """Training runs of the tiny model at any layout, the one-rank reference runs shared by the test module."""
    return ParityRuns(TINY_OVERRIDES + [f"data.path={corpus_dir}"], tmp_path_factory.mktemp("parity"))


def side_by_side(*calls):
    """Each call's result, in order, the calls made two at a time: for independent subprocesses that are each mostly
    one thread (a Python start-up importing torch), on the CI machine's two cores."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def torchrun_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def steps_never_wait_for_the_gpu(trainer, warmup: int = 2, steps: int = 2) -> None:
    """`warmup` training steps (compiling, autotuning, the FP8-health-sampled step 0), then `steps` more under
    torch's sync checker: any host synchronization inside a step raises."""
    import torch

    for _ in range(warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
