"""Every shell command in README.md and docs/*.md is classified here, and the cheap ones run as documented.

The commands are read from the ```bash blocks (and `$ ` lines) of the docs. `COMMANDS` says, for each, either
how it runs here (in a scratch copy of the repository, in table order, with any substitution spelled out next to
it) or why it is skipped. A command the docs gain without an entry here fails
`test_every_documented_command_is_classified`: classify it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
TRAILING_COMMENT = re.compile(r"\s+#\s.*$")
# The tiny run that stands in for the docs' 200-step runs: checkpoints every 2 steps, 2 steps in all.
TINY_TRAINING = "training.steps=2 optimizer.warmup_steps=1 training.eval_interval=2 training.eval_iters=1"
TINY_STEP = "step_00000002"
COMMAND_TIMEOUT_S = 180


@dataclass(frozen=True)
class Run:
    """Run in the scratch copy with each (old, new) replaced first, after the `Run` entries above it.

    An `alongside` entry needs nothing the others make: the alongside entries run in their own sequence,
    beside the main one (two processes at a time keep the test near a minute on a 2-core machine).
    """

    substitutions: tuple[tuple[str, str], ...] = ()
    why: str = ""
    alongside: bool = False


@dataclass(frozen=True)
class Skip:
    """Not run here, for `reason`."""

    reason: str


GPU = "needs GPUs (8 ranks or a CUDA device)"
SLURM = "submits a SLURM job (needs sbatch and a cluster; tests/test_slurm.py covers the scripts)"
LONG = "a full 200-step run (minutes on CPU); the same launch path runs below with tiny settings"

GPU_SESSION = "a GPU session's script (tests/test_gpu_parity_script.py runs its sub-steps on CPU)"
PARITY_RUNS, TINY_RUNS = "runs/bf16_a runs/fp8_a runs/bf16_b", "runs/tiny_dense runs/tiny_dense runs/tiny_dense"

# Keyed by the command as documented, continuation lines joined and the trailing comment dropped.
# `Run` entries run top to bottom, so an entry may use what the ones above it made.
COMMANDS: dict[str, Run | Skip] = {
    "make train": Skip("README's first command: builds .venv and runs the 200-step demo (~80 s or more)"),
    "make test": Skip("README's second command: runs this test suite"),
    "pip install torch -e .": Skip("installs packages (network); .venv already holds them"),
    "apt-get install -y slurmctld slurmd slurm-client munge": Skip("installs system packages (root, network)"),
    "bash launch/slurm/local_cluster.sh && export SLURM_CONF=/tmp/megafp8-slurm/slurm.conf":
        Skip("starts SLURM daemons (root); tests/test_slurm.py covers it where SLURM is installed"),
    # Data: a tiny generated corpus (books/, my_corpus/, crawl-*.jsonl) stands in for the real ones.
    "python tools/preprocess_data.py --input stdlib --output data/pystdlib":
        Run((("--input stdlib", "--input books/"),), "the standard library is 31M tokens; a tiny corpus stands in"),
    "python tools/preprocess_data.py --input books/ --output data/books": Run(alongside=True),
    "python tools/preprocess_data.py --input crawl-*.jsonl --json-key content --output data/crawl "
    "--valid-fraction 0.001": Run(alongside=True),
    "python tools/preprocess_data.py --input my_corpus/ --output data/mine": Run(alongside=True),
    "python tools/train_tokenizer.py --input my_corpus/ --valid-fraction 0 --vocab-size 32000 "
    "--output data/my-tok.json":
        Run((("--vocab-size 32000", "--vocab-size 300"),), "a tiny vocabulary for the tiny corpus", alongside=True),
    "python tools/preprocess_data.py --input my_corpus/ --valid-input heldout.jsonl --tokenizer data/my-tok.json "
    "--output data/mine":
        Run((("--output data/mine", "--output data/mine-heldout"),),
            "data/mine is the byte-tokenized corpus of the entry above", alongside=True),
    "python tools/preprocess_data.py --input my_corpus/ --output data/llama --tokenizer llama3/tokenizer.json "
    "--bos-token '<|begin_of_text|>'":
        Skip("needs Llama 3's tokenizer.json (not shipped); tests/test_data_bos.py runs --bos-token on a tokenizer "
             "with a template of its own"),
    "python tools/train_tokenizer.py --input stdlib --vocab-size 8192 --output data/tokenizer.json":
        Run((("--input stdlib --vocab-size 8192", "--input books/ --vocab-size 300"),),
            "a tiny corpus and vocabulary stand in for the standard library's", alongside=True),
    "python tools/preprocess_data.py --input stdlib --tokenizer data/tokenizer.json --output data/pystdlib-bpe":
        Run((("--input stdlib", "--input books/"),), "a tiny corpus stands in", alongside=True),
    'SITE=$(python -c "import sysconfig; print(sysconfig.get_paths()[\'purelib\'])")':
        Run(why="sets a variable only (each command runs in its own shell)", alongside=True),
    'python tools/preprocess_data.py --input "$SITE" --extensions .py .md .rst .txt --output data/sitepkgs --dry-run':
        Run((('"$SITE"', "my_corpus/"),), "the tiny corpus stands in for site-packages", alongside=True),
    'python tools/train_tokenizer.py --input "$SITE" --extensions .py .md .rst .txt --sample-bytes 1e8 '
    "--vocab-size 32768 --output data/sitepkgs-tokenizer.json":
        Run((('"$SITE"', "my_corpus/"), ("--vocab-size 32768", "--vocab-size 300")),
            "the tiny corpus and vocabulary stand in", alongside=True),
    'python tools/preprocess_data.py --input "$SITE" --extensions .py .md .rst .txt '
    "--tokenizer data/sitepkgs-tokenizer.json --output data/sitepkgs":
        Run((('"$SITE"', "my_corpus/"),), "the tiny corpus stands in", alongside=True),
    # Configs and the dry run: verbatim.
    "python launch/pretrain.py --config tiny_dense.yaml --print-config": Run(alongside=True),
    "python launch/pretrain.py --config tiny_dense --print-config": Run(alongside=True),
    "python launch/pretrain.py --config path/to/my.yaml model.num_layers=8 optimizer.lr=1e-3":
        Run((("optimizer.lr=1e-3", "optimizer.lr=1e-3 --print-config"),),
            "path/to/my.yaml is a copy of tiny_dense.yaml; it prints the config instead of a 200-step run", alongside=True),
    "python launch/pretrain.py --config tiny_dense.yaml --dry-run --world-size 8 model.size=1b "
    "model.vocab_size=32768 training.global_batch_size=32": Run(alongside=True),
    "python launch/pretrain.py --config tiny_dense.yaml --dry-run --world-size 8 model.size=1b parallel.tp=2 "
    "model.vocab_size=32768": Run(alongside=True),
    "python launch/slurm/submit.py --config 671b_fp8.yaml --print-only": Run(alongside=True),
    "python tools/plan.py --config 16b_moe_fp8 --world-size 8 --layouts": Run(alongside=True),
    # Training: the demo runs, shortened.
    "torchrun --nproc_per_node=2 launch/pretrain.py --config tiny_dense.yaml":
        Run((("tiny_dense.yaml", f"tiny_dense.yaml {TINY_TRAINING}"),),
            "make train's run, shortened to 2 steps, so runs/tiny_dense holds a finished run as after make train"),
    ".venv/bin/torchrun --nproc_per_node=2 launch/pretrain.py --config tiny_dense_fp8.yaml": Skip(LONG),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config tiny_moe_fp8.yaml parallel.ep=2": Skip(LONG),
    ".venv/bin/torchrun --nproc_per_node=2 launch/pretrain.py --config tiny_dense.yaml data.path=data/pystdlib "
    "checkpoint.interval=100":
        Run((("checkpoint.interval=100", f"checkpoint.interval=2 {TINY_TRAINING}"),),
            f"2 steps, saving {TINY_STEP} where the docs' 200-step run saves step_00000100 and step_00000200"),
    # Checkpoints: the 2-step checkpoint stands in for the docs' step_00000100/200 (and runs/big's step_00001000).
    "python launch/pretrain.py --config tiny_dense.yaml --evaluate data.path=data/pystdlib training.eval_iters=20":
        Run((("training.eval_iters=20", "training.eval_iters=1"),), "the 2-step run's newest checkpoint, one batch"),
    "python launch/pretrain.py --config tiny_dense.yaml --evaluate data.path=data/pystdlib "
    "checkpoint.resume=runs/tiny_dense/checkpoints/step_00000100":
        Run((("step_00000100", f"{TINY_STEP} training.eval_iters=1"),), "the 2-step run's checkpoint, one batch"),
    "python tools/convert_checkpoint.py inspect runs/tiny_dense/checkpoints/step_00000200":
        Run((("step_00000200", TINY_STEP),), "the 2-step run's checkpoint"),
    'python tools/generate.py runs/tiny_dense/checkpoints/step_00000200 --prompt "def main():" --tokens 40':
        Run((("step_00000200", TINY_STEP), ("--tokens 40", "--tokens 4")), "the 2-step run's checkpoint, 4 tokens"),
    "python tools/convert_checkpoint.py to-hf runs/tiny_dense/checkpoints/step_00000200 --out hf/tiny":
        Run((("step_00000200", TINY_STEP),), "the 2-step run's checkpoint"),
    "python tools/convert_checkpoint.py to-hf runs/tiny_dense/checkpoints/step_00000200 --out hf/tiny-fp8 --fp8":
        Run((("step_00000200", TINY_STEP),), "the 2-step run's checkpoint"),
    "python tools/convert_checkpoint.py to-hf runs/mine/checkpoints/step_00001000 --out hf/mine "
    "--tokenizer data/my-tok.json":
        Skip("needs a run on data of data/my-tok.json; tests/test_hf_transformers.py::"
             "test_an_export_with_its_tokenizer_loads_in_auto_tokenizer_and_says_its_end_of_text_id runs one"),
    "python tools/convert_checkpoint.py from-hf hf/tiny --out runs/from_hf/checkpoints": Run(),
    "python launch/pretrain.py --config my_run.yaml checkpoint.resume=runs/from_hf/checkpoints/step_00000000":
        Run((("step_00000000", f"step_00000000 {TINY_TRAINING}"),),
            "my_run.yaml is tiny_dense.yaml with from-hf's model: section (the same model); 2 steps"),
    # Continuing a Hugging Face model (docs/checkpoints.md): a downloaded directory, hf/base, is not shipped.
    "python tools/convert_checkpoint.py from-hf hf/base --out runs/base/checkpoints":
        Skip("a downloaded Hugging Face directory; `from-hf hf/tiny` above runs the command on an export, and "
             "tests/test_hf_transformers.py imports Llama and Qwen3 models that transformers made"),
    "python tools/preprocess_data.py --input my_corpus/ --output data/mine-base --tokenizer hf/base/tokenizer.json":
        Skip("the base model's tokenizer.json; tests/test_data_bos.py preprocesses with a tokenizer.json whose "
             "template begins texts with a token"),
    ".venv/bin/torchrun --nproc_per_node=8 launch/pretrain.py --config my_run.yaml "
    "checkpoint.resume=runs/base/checkpoints/step_00000000": Skip(GPU),
    "python tools/convert_checkpoint.py to-hf runs/my_run/checkpoints/step_00001000 --out hf/mine "
    "--tokenizer hf/base/tokenizer.json":
        Skip("a run continued from an import; tests/test_data_bos.py exports a run with its tokenizer.json and "
             "imports the export back"),
    "python tools/convert_checkpoint.py consolidate runs/big/checkpoints/step_00001000 --out one_file/":
        Run((("runs/big/checkpoints/step_00001000", f"runs/tiny_dense/checkpoints/{TINY_STEP}"),),
            "the 2-step run's checkpoint stands in for a big run's"),
    "python tools/convert_checkpoint.py shard one_file/step_00001000 --out sharded/":
        Run((("step_00001000", TINY_STEP),), "the consolidated 2-step checkpoint"),
    "python tools/fp8_sensitivity.py --config tiny_dense --checkpoint runs/tiny_dense/checkpoints/step_00000100 "
    "--batches 4 --plot sensitivity.png --json sensitivity.json":
        Run((("step_00000100", TINY_STEP), ("--batches 4", "--batches 1")),
            "the 2-step run's checkpoint, one batch"),
    # FP8-vs-BF16 parity (issue 22): the 2-step run stands in for each of the three runs.
    "python tools/compare_runs.py --parity runs/bf16_a runs/fp8_a runs/bf16_b --window 500":
        Run(((PARITY_RUNS, TINY_RUNS),), "the 2-step run three times: every gap 0"),
    "python tools/plot_runs.py runs/bf16_a runs/fp8_a runs/bf16_b --labels \"BF16 seed A\" \"FP8 seed A\" "
    "\"BF16 seed B\" --metrics loss val_loss --gaps --smooth 10 --from-step 100 --out parity.png":
        Run(((PARITY_RUNS, TINY_RUNS), ("--from-step 100", "--from-step 0")), "the 2-step run three times"),
    "python tools/compare_runs.py --pooled runs/bf16_b runs/bf16_b_r2 runs/bf16_b_r3 --against runs/fp8_b "
    "runs/fp8_b_r2 --labels \"BF16 B\" \"FP8 B\" --window 250":
        Run((("runs/bf16_b runs/bf16_b_r2 runs/bf16_b_r3", "runs/tiny_dense runs/tiny_dense runs/tiny_dense"),
             ("runs/fp8_b runs/fp8_b_r2", "runs/tiny_dense runs/tiny_dense")),
            "the 2-step run as every repeat: both arms the same"),
    "OUT=results bash benchmarks/gpu_parity_corpus.sh corpus": Skip(GPU_SESSION),
    "OUT=results bash benchmarks/gpu_parity_corpus.sh next": Skip(GPU_SESSION),
    "OUT=results bash benchmarks/gpu_parity_corpus.sh status": Skip(GPU_SESSION),
    "OUT=results bash benchmarks/gpu_parity_corpus.sh compare": Skip(GPU_SESSION),
    # Clusters.
    "torchrun --nproc_per_node=8 launch/pretrain.py --config tiny_dense.yaml data.path=data/mine model.size=1b "
    "data.seq_len=2048 training.global_batch_size=256 training.micro_batch_size=8": Skip(GPU),
    "torchrun --nproc_per_node=8 launch/pretrain.py --config tiny_dense.yaml model.size=1b parallel.tp=2 "
    "parallel.sequence_parallel=true precision.recipe=fp8": Skip(GPU),
    "torchrun --nproc_per_node=8 launch/pretrain.py --config tiny_dense.yaml model.size=1b parallel.tp=2 "
    "parallel.pp=2 parallel.pp_schedule=zbv training.global_batch_size=32": Skip(GPU),
    "sbatch --nodes=16 --gpus-per-node=8 launch/slurm/pretrain.sbatch --config my_run.yaml optimizer.lr=2e-4":
        Skip(SLURM),
    "python launch/slurm/submit.py --config 671b_fp8.yaml --nodes 256": Skip(SLURM),
    "python launch/slurm/submit.py --config 1b_dense_fp8.yaml --sbatch=--time=12:00:00 optimizer.lr=2e-4":
        Skip(SLURM),
    "GPUS_PER_NODE=2 sbatch --nodes=1 --export=ALL,OMP_NUM_THREADS=1 launch/slurm/pretrain.sbatch "
    "--config tiny_dense.yaml training.steps=20 training.eval_interval=10 logging.log_interval=10": Skip(SLURM),
    # DeepGEMM (docs/precision.md): tests/test_install_deepgemm.py runs the tool with a stand-in DeepGEMM.
    "python tools/install_deepgemm.py --prefix ~/deepgemm": Skip("clones and builds DeepGEMM, checks it on a GPU"),
    "source ~/deepgemm/deepgemm.env": Skip("the file the install above writes"),
    "python tools/check_env.py": Run(alongside=True),
    "torchrun --nproc_per_node=8 launch/pretrain.py --config 1b_dense_fp8.yaml": Skip(GPU),
}


def shell_lines(text: str) -> list[str]:
    """The lines of the ```bash blocks and the `$ ` lines of one Markdown page."""
    lines = [line for block in SHELL_BLOCK.findall(text) for line in block.splitlines()]
    return lines + [line[2:] for line in text.splitlines() if line.startswith("$ ")]


def commands_in(lines: list[str]) -> list[str]:
    """Commands with continuation lines joined, trailing comments and comment-only lines dropped."""
    commands, pending = [], ""
    for line in lines:
        line = TRAILING_COMMENT.sub("", line).strip()
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            commands.append(" ".join(command.split()))
    return commands


def documented_commands() -> dict[str, str]:
    """Each documented command, mapped to the first page (relative to the repo) that shows it."""
    found: dict[str, str] = {}
    for page in DOC_FILES:
        for command in commands_in(shell_lines(page.read_text())):
            found.setdefault(command, str(page.relative_to(REPO)))
    return found


def test_every_documented_command_is_classified():
    documented = documented_commands()
    unclassified = [f"{page}: {command}" for command, page in documented.items() if command not in COMMANDS]
    assert not unclassified, ("documented commands missing from COMMANDS in tests/test_documented_commands.py "
                              "(add each as Run or Skip):\n" + "\n".join(unclassified))
    stale = [command for command in COMMANDS if command not in documented]
    assert not stale, "COMMANDS entries no longer in the docs (remove them):\n" + "\n".join(stale)


def test_command_extraction_joins_continuations_and_drops_comments():
    lines = ["# a comment", "python a.py --x 1 \\", "    --y 2   # trailing", "", "make test  # run"]
    assert commands_in(lines) == ["python a.py --x 1 --y 2", "make test"]
    assert shell_lines("```bash\nls\n```\n$ pwd\n```\nnot me\n```\n") == ["ls", "pwd"]


def write_tiny_corpora(root: Path) -> None:
    """books/ and my_corpus/ (plain text) and crawl-*.jsonl: the package's own sources, ~1 MB of text;
    heldout.jsonl: the tools' sources."""
    import json

    sources = sorted((REPO / "megafp8").rglob("*.py"))
    for folder in ("books", "my_corpus"):
        (root / folder).mkdir()
        for index, source in enumerate(sources):
            (root / folder / f"doc{index:03d}.txt").write_text(source.read_text())
    for part in range(2):
        with open(root / f"crawl-{part}.jsonl", "w") as handle:
            for source in sources[part::2]:
                handle.write(json.dumps({"content": source.read_text()}) + "\n")
    with open(root / "heldout.jsonl", "w") as handle:  # docs/data.md's validation set of one's own
        for source in (REPO / "tools").glob("*.py"):
            handle.write(json.dumps({"text": source.read_text()}) + "\n")


def make_scratch_clone(root: Path) -> None:
    """What a fresh clone holds, plus .venv (this interpreter's), the tiny corpora and the docs' placeholders."""
    for name in ("configs", "launch", "megafp8", "tools"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "docs").mkdir()
    (root / ".venv").symlink_to(Path(sys.executable).parent.parent)
    write_tiny_corpora(root)
    (root / "path" / "to").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "tiny_dense.yaml", root / "path" / "to" / "my.yaml")
    shutil.copy(REPO / "configs" / "tiny_dense.yaml", root / "my_run.yaml")


def substituted(command: str, entry: Run) -> str:
    """`command` with the entry's substitutions made; each must apply, so a stale one fails loudly."""
    for old, new in entry.substitutions:
        assert old in command, f"substitution {old!r} no longer applies to: {command}"
        command = command.replace(old, new)
    return command


def run_in(root: Path, command: str) -> subprocess.CompletedProcess:
    """`command` through bash in `root`, with this interpreter's bin first on PATH (as after activating .venv)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    return subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)


def run_in_turn(root: Path, commands: list[tuple[str, Run]], documented: dict[str, str]) -> list[str]:
    """Run each command in order, stopping at the first failure; its report, or nothing."""
    for command, entry in commands:
        result = run_in(root, substituted(command, entry))
        if result.returncode != 0:
            return [f"{documented[command]}: `{command}` failed (exit {result.returncode}):\n"
                    f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"]
    return []


def test_cheap_documented_commands_run(tmp_path):
    documented = documented_commands()
    make_scratch_clone(tmp_path)
    runs = [(command, entry) for command, entry in COMMANDS.items()
            if isinstance(entry, Run) and command in documented]
    sequences = [[run for run in runs if run[1].alongside == alongside] for alongside in (False, True)]
    with ThreadPoolExecutor(max_workers=len(sequences)) as pool:
        failures = sum(pool.map(lambda sequence: run_in_turn(tmp_path, sequence, documented), sequences), [])
    assert not failures, "\n\n".join(failures)
