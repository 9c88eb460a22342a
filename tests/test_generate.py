"""Text from a checkpoint (`tools/generate.py`, `megafp8.train.generate`)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from megafp8.train.generate import _choose, continuation_text, load_generator
from tests.conftest import REPO, side_by_side


@pytest.fixture(scope="module")
def checkpoint(corpus_dir, tmp_path_factory):
    """A tiny model trained 3 steps on the byte-tokenized corpus, checkpointed at step 3."""
    from tests.conftest import TINY_OVERRIDES

    root = tmp_path_factory.mktemp("gen")
    cfg = load_config("tiny_dense", TINY_OVERRIDES + [f"data.path={corpus_dir}", f"logging.output_dir={root}",
                                                      "run_name=g", "training.steps=3", "training.eval_interval=0",
                                                      "checkpoint.interval=3"])
    Trainer(cfg, ParallelDims.single(), torch.device("cpu")).fit()
    return root / "g" / "checkpoints" / "step_00000003"


def test_greedy_continuation_is_the_model_s_argmax_over_its_window(checkpoint):
    gen = load_generator(checkpoint, torch.device("cpu"))
    assert gen.window == 64 and gen.tokenizer.vocab_size == 258  # the run's data.seq_len and byte tokenizer
    prompt = gen.tokenizer.encode("def main():\n    return ")
    ids = gen.continue_ids(prompt, 5, stop_at_eos=False)
    assert ids == gen.continue_ids(prompt, 5, stop_at_eos=False) and len(ids) == 5
    context = prompt + ids[:2]  # the third new token, by hand: the model over the padded window
    tokens = torch.full((1, 64), gen.tokenizer.eos_id)
    tokens[0, :len(context)] = torch.tensor(context)
    with torch.no_grad():
        logits = gen.model(tokens)[0, len(context) - 1, :258]
    assert ids[2] == int(logits.argmax())
    long_prompt = gen.tokenizer.encode("x" * 100)  # longer than the window: its last 64 tokens are read
    assert len(gen.continue_ids(long_prompt, 2, stop_at_eos=False)) == 2


def test_sampling_draws_among_the_top_k_and_is_seeded():
    logits = torch.tensor([0.0, 5.0, 4.0, -1.0])
    draw = torch.Generator().manual_seed(0)
    assert _choose(logits, 0.0, 0, draw) == 1
    assert {_choose(logits, 1.0, 1, draw) for _ in range(20)} == {1}  # top-1 at any temperature: the argmax
    picks = {_choose(logits, 2.0, 2, draw) for _ in range(50)}
    assert picks == {1, 2}
    first = [_choose(logits, 1.0, 0, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(first)) == 1  # the same seed, the same draw


def test_the_command_line_continues_a_prompt_and_refuses_a_moved_tokenizer_in_one_line(checkpoint, tmp_path):
    command = [sys.executable, "tools/generate.py", str(checkpoint), "--prompt", "import ", "--tokens", "8",
               "--temperature", "0.8", "--top-k", "5", "--samples", "2"]
    result, missing = side_by_side(*(lambda cmd=cmd: subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                                                                     timeout=120)
                                     for cmd in (command, command[:3] + ["--prompt", "a", "--tokenizer",
                                                                         str(tmp_path / "gone.json")])))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- sample") == 2 and result.stdout.count("\nimport ") == 2
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


def test_a_checkpoints_directory_without_one_says_so(tmp_path):
    """`runs/NAME/checkpoints` of a run that saved none (its `.lock` only) was called an incomplete checkpoint whose
    save did not finish."""
    empty = tmp_path / "checkpoints"
    empty.mkdir()
    (empty / ".lock").touch()
    with pytest.raises(ConfigError, match=r"checkpoints holds no checkpoint \(a run saves one every "
                                          r"checkpoint.interval steps\)"):
        load_generator(empty, torch.device("cpu"))


@pytest.mark.parametrize("config", ["tiny_moe_fp8", "tiny_mla_moe_mtp_fp8"])
def test_a_moe_or_mla_checkpoint_trained_in_fp8_continues_text(config, corpus_dir, tmp_path):
    """Layouts no Hugging Face export holds (a MoE with a selection bias, MLA with MTP) continue text too."""
    cfg = load_config(config, [f"data.path={corpus_dir}", f"logging.output_dir={tmp_path}", "run_name=m",
                               "training.steps=1", "optimizer.warmup_steps=0", "training.eval_interval=0",
                               "checkpoint.interval=1"])
    Trainer(cfg, ParallelDims.single(), torch.device("cpu")).fit()
    gen = load_generator(tmp_path / "m" / "checkpoints" / "step_00000001", torch.device("cpu"))
    assert len(gen.continue_ids(gen.tokenizer.encode("def "), 3, stop_at_eos=False)) == 3


def test_the_end_of_document_token_the_data_was_made_with_is_the_one_read_back(tmp_path):
    """Data preprocessed with --eos-token: its id is recorded with the data, and text generation and an export's
    tokenizer use it (both fell back to the tokenizer's default token, one that ends no document of the data)."""
    tokenizers = pytest.importorskip("tokenizers")
    from megafp8.checkpoint.convert import export_hf
    from megafp8.data.preprocess import preprocess
    from tests.conftest import TINY_OVERRIDES

    words = ["the", "cat", "sat", "on", "mat", "a", "dog"]
    vocab = {w: i for i, w in enumerate(words + ["<|endoftext|>", "</s>", "[UNK]"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(90)))
    preprocess([str(src)], tmp_path / "data", tokenizer_spec=str(tmp_path / "tok.json"), valid_fraction=0.0,
               eos_token="</s>")
    cfg = load_config("tiny_dense", TINY_OVERRIDES + [f"data.path={tmp_path / 'data'}", f"logging.output_dir={tmp_path}",
                                                      "run_name=e", "data.seq_len=16", "training.steps=1",
                                                      "optimizer.warmup_steps=0", "training.eval_interval=0",
                                                      "checkpoint.interval=1"])
    Trainer(cfg, ParallelDims.single(), torch.device("cpu")).fit()
    step = tmp_path / "e" / "checkpoints" / "step_00000001"
    assert load_generator(step, torch.device("cpu")).tokenizer.eos_id == vocab["</s>"]  # not <|endoftext|>'s 7
    export_hf(step, tmp_path / "hf", fp8=False, tokenizer=tmp_path / "tok.json")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == vocab["</s>"]
    with pytest.raises(ConfigError, match=r"the data was made with end-of-document id 8, but '<\|endoftext\|>' is id 7"):
        load_generator(step, torch.device("cpu"), eos_token="<|endoftext|>", tokenizer=str(tmp_path / "tok.json"))


@pytest.mark.parametrize("device, message", [("gpu", "--device gpu: give cpu, cuda or cuda:N"),  # RuntimeError's
                                             ("mps", "--device mps: give cpu, cuda or cuda:N")])  # traceback
def test_a_device_it_cannot_run_on_is_one_error_line(tmp_path, capsys, device, message):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from generate import main
    finally:
        sys.path.remove(str(REPO / "tools"))
    assert main([str(tmp_path / "none"), "--prompt", "x", "--device", device]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    if not torch.cuda.is_available():  # was torch's AssertionError "Torch not compiled with CUDA enabled"
        assert main([str(tmp_path / "none"), "--prompt", "x", "--device", "cuda"]) == 2
        assert "--device cuda: this torch sees no CUDA GPU" in capsys.readouterr().err


def test_a_window_longer_than_the_run_trained_on_is_refused_and_a_shorter_one_is_read(checkpoint):
    with pytest.raises(ConfigError, match=r"--window 65: .* windows of 64 tokens .* give --window 64 or less"):
        load_generator(checkpoint, torch.device("cpu"), window=65)
    assert load_generator(checkpoint, torch.device("cpu"), window=16).window == 16


def test_a_continuation_keeps_the_space_a_leading_space_stripping_decoder_drops(tmp_path):
    """Llama 2's and Mistral's tokenizer.json decoders strip the leading space of a text: the continuation decoded
    on its own lost the space its first token begins with, and "Once upon" + " a time" was printed "Once upona
    time". The prompt and continuation are now decoded together."""
    tokenizers = pytest.importorskip("tokenizers")
    from megafp8.data.tokenizer import ByteTokenizer, HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581Once": 3, "\u2581upon": 4, "\u2581a": 5, "\u2581time": 6}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = tokenizers.decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.save(str(tmp_path / "tokenizer.json"))
    llama2_like = HFTokenizer(str(tmp_path / "tokenizer.json"), bos_token="<s>")
    prompt = llama2_like.document("Once upon")
    assert prompt == [1, 3, 4] and llama2_like.decode([5, 6]) == "a time"  # alone: the space is gone
    assert continuation_text(llama2_like, prompt, [5, 6]) == " a time"
    byte = ByteTokenizer()
    assert continuation_text(byte, byte.encode("caf"), list("é!".encode())) == "é!"
