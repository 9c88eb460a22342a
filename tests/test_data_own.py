"""Bringing one's own data: a held-out file as the validation split, the end-of-document token's text inside
documents, a vocabulary configured far above the tokenizer's, and what the start-up lines say of the data (epochs
read, a named checkpoint's warnings said once)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megafp8.config import ConfigError
from megafp8.data import ByteTokenizer, TokenStream, read_meta
from megafp8.data.preprocess import preprocess, train_tokenizer
from tests.test_data import write_docs


def test_a_held_out_file_of_one_s_own_is_the_validation_split(tmp_path, capsys):
    """A Megatron user brings a validation file of their own: there was no way to make it the `valid` split (only a
    seeded draw from the training inputs), short of editing meta.json by hand."""
    import tools.preprocess_data as tool

    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"train doc {i} " * 5}) + "\n" for i in range(30)))
    held = tmp_path / "heldout.jsonl"
    held.write_text("".join(json.dumps({"text": f"held doc {i} " * 5}) + "\n" for i in range(4)))
    assert tool.main(["--input", str(src), "--valid-input", str(held), "--output", str(tmp_path / "out")]) == 0
    meta = read_meta(tmp_path / "out")
    assert [s["num_docs"] for s in meta.splits["train"]] == [30]  # nothing of the training inputs drawn out
    valid = TokenStream(meta, "valid")
    pieces = np.split(valid.read(0, valid.num_tokens), np.where(valid.read(0, valid.num_tokens) == 256)[0] + 1)[:-1]
    assert [ByteTokenizer().decode(p.tolist()) for p in pieces] == [f"held doc {i} " * 5 for i in range(4)]
    for args, expected in ((["--input", str(src), "--valid-input", str(src / "a.jsonl")],
                            "a.jsonl is in both --input and --valid-input: validation would read training data"),
                           (["--input", str(src), "--valid-input", str(held), "--valid-fraction", "0.1"],
                            "--valid-input is the held-out split, so --valid-fraction 0.1 would hold out training "
                            "documents as well")):
        assert tool.main([*args, "--output", str(tmp_path / "out2")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match=r"no documents in --valid-input .*empty.jsonl"):
        preprocess([str(src)], tmp_path / "out3", valid_fraction=0.0, valid_inputs=[str(tmp_path / "empty.jsonl")])
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


def test_a_named_checkpoint_s_warnings_are_said_once_not_by_every_rank(tiny_overrides, tmp_path, caplog):
    """A second stage (checkpoint.resume=PATH, a longer data.seq_len) under torchrun printed each of its warnings
    (settings changed, data position dropped, model settings changed) once per rank: they are the same everywhere,
    and ranks above 0 log warnings."""
    import dataclasses

    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    common = tiny_overrides + ["training.steps=2", "checkpoint.interval=2", "training.eval_interval=0"]
    Trainer(load_config("tiny_dense", common), ParallelDims.single(), torch.device("cpu")).fit()
    path = tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"
    stage = Trainer(load_config("tiny_dense", common + ["run_name=long", f"checkpoint.resume={path}",
                                                       "data.seq_len=128", "model.rope_theta=20000",
                                                       "training.steps=3"]),
                    ParallelDims.single(), torch.device("cpu"))
    for rank, said in ((0, 3), (1, 0)):
        stage.checkpointer.dims = dataclasses.replace(stage.checkpointer.dims, rank=rank)
        caplog.clear()
        with caplog.at_level("WARNING", logger="megafp8"):
            stage.checkpointer.load(path, named=True)
        assert len(caplog.records) == said, (rank, caplog.text)


def test_documents_holding_the_end_of_document_token_s_text_are_counted_in_a_warning(tmp_path, caplog):
    """A tokenizer.json reads its special tokens' text wherever it occurs: a document that quotes
    '<|endoftext|>' (a corpus of code or docs about language models) was silently split in two."""
    pytest.importorskip("tokenizers")
    src = write_docs(tmp_path / "src", [f"def f_{i}(x):\n    return x + {i}\n" * 10 for i in range(20)])
    tok_path = tmp_path / "tokenizer.json"
    train_tokenizer([str(src)], tok_path, vocab_size=400)
    (src / "100.txt").write_text("a model ends documents with <|endoftext|> and goes on\n")
    with caplog.at_level("WARNING"):
        preprocess([str(src)], tmp_path / "out", tokenizer_spec=str(tok_path), valid_fraction=0.0)
    assert ("1 of 21 documents hold the text '<|endoftext|>', which the tokenizer reads as its end-of-document "
            "token: training sees each of them as several documents") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        preprocess([str(src)], tmp_path / "out2", valid_fraction=0.0)  # bytes: no text is a token of its own
    assert "end-of-document token" not in caplog.text


def test_a_configured_vocabulary_far_above_the_tokenizer_s_is_warned_about(tiny_overrides, caplog):
    """from-hf prints `vocab_size` (3072 for a model of a 3000-id tokenizer); that model section over data of another
    tokenizer (bytes: 258 ids) trained without a word, every embedding row meaning other text than it learned."""
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    for vocab, warned in ((3072, True), (768, True), (640, False), (384, False), (None, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="megafp8"):
            Trainer(load_config("tiny_dense", tiny_overrides + [f"model.vocab_size={vocab}" if vocab else
                                                                "model.vocab_size=null", f"run_name=v{vocab}"]),
                    ParallelDims.single(), torch.device("cpu"))
        assert (f"model.vocab_size={vocab} is far above the 384 rows the data's tokenizer (byte, 258 ids) needs: "
                f"{(vocab or 0) - 258} rows are never a target" in caplog.text) == warned, (vocab, caplog.text)


def test_the_start_up_line_says_how_many_epochs_the_run_reads_and_when_samples_repeat(tiny_overrides, caplog):
    """A run longer than its data walked into a second epoch without a word: the start-up line said the samples per
    step and the steps, not that the last steps re-read the data."""
    from megafp8.config import load_config
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer
    from megafp8.train.build import epochs_read

    with caplog.at_level("INFO", logger="megafp8"):
        trainer = Trainer(load_config("tiny_dense", tiny_overrides + ["training.eval_interval=0"]),
                          ParallelDims.single(), torch.device("cpu"))
        trainer.fit()
    samples = len(trainer.loader.dataset)
    steps = -(-samples // 8) + 2  # two steps into the second epoch
    assert f"6 steps from step 0, {6 * 8 / samples:.3g} epoch(s) of the data by the last step" in caplog.text
    assert epochs_read(0, steps, 8, samples) == (f"{steps * 8 / samples:.3g} epochs of the data by the last step: "
                                                 f"samples repeat from {steps - 2} step(s) on (the next epoch's order)")
    assert epochs_read(samples - 3, 1, 8, samples).endswith("samples repeat from 1 step(s) on (the next epoch's order)")
