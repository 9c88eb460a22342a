"""Documents that begin with a beginning-of-document token (`preprocess_data.py --bos-token`), as Llama's and
DeepSeek's models were trained: recorded with the data, carried to generation and to a Hugging Face export."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.data.blend import read_metas
from megafp8.data.indexed import TokenStream, read_meta
from megafp8.data.preprocess import preprocess
from megafp8.data.tokenizer import load_tokenizer, tokenizer_of_data
from tests.test_data import write_docs

pytest.importorskip("tokenizers")

WORDS = [f"w{i}" for i in range(30)]
BOS, EOS = "<s>", "<|endoftext|>"


def _templated_tokenizer(path, template=True):
    """A word-level tokenizer.json whose template begins every text with <s> (as Llama's does), ids 0-29 the words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate(WORDS)} | {"[UNK]": 30, BOS: 31, EOS: 32}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if template:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 31)])
    tok.save(str(path))
    return path


def _documents(folder, count=40, words=120):
    rng = np.random.default_rng(0)
    return write_docs(folder, [" ".join(rng.choice(WORDS, words)) for _ in range(count)])


def _documents_of(directory, split="train"):
    tokens = TokenStream(read_meta(directory), split)
    stream = tokens.read(0, tokens.num_tokens)
    ends = np.flatnonzero(stream == 32)
    return np.split(stream, ends[:-1] + 1)


@pytest.fixture
def tokenizer(tmp_path):
    return str(_templated_tokenizer(tmp_path / "tok.json"))


def test_every_document_begins_with_the_token_given_and_the_data_records_it(tokenizer, tmp_path):
    preprocess([str(_documents(tmp_path / "src"))], tmp_path / "out", tokenizer_spec=tokenizer, valid_fraction=0.1,
               bos_token=BOS)
    meta = read_meta(tmp_path / "out")
    assert (meta.bos_id, meta.eos_id) == (31, 32)
    for split in ("train", "valid"):
        docs = _documents_of(tmp_path / "out", split)
        assert all(doc[0] == 31 and doc[-1] == 32 and 31 not in doc[1:] for doc in docs)
    assert sum(len(_documents_of(tmp_path / "out", s)) for s in ("train", "valid")) == 40
    assert TokenStream(meta, "train").fingerprint["bos_id"] == 31
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["bos_id"] == 31


def test_without_it_a_template_that_begins_texts_is_pointed_out(tokenizer, tmp_path, caplog):
    """Llama 3's tokenizer.json begins every text with <|begin_of_text|>; data made without it trains an imported
    Llama on documents that begin otherwise than it learned, silently, as before --bos-token existed."""
    preprocess([str(_documents(tmp_path / "src"))], tmp_path / "out", tokenizer_spec=tokenizer, valid_fraction=0.1)
    assert f"begins each text with {BOS} (its template)" in caplog.text
    assert f"add --bos-token {BOS}" in caplog.text
    assert read_meta(tmp_path / "out").bos_id is None
    assert all(doc[0] != 31 for doc in _documents_of(tmp_path / "out"))
    caplog.clear()
    plain = str(_templated_tokenizer(tmp_path / "plain.json", template=False))
    preprocess([str(tmp_path / "src")], tmp_path / "plain", tokenizer_spec=plain, valid_fraction=0.1)
    assert "--bos-token" not in caplog.text


@pytest.mark.parametrize("spec, bos, said", [
    ("tok", "<bos>", rf"has no token '<bos>' \(--bos-token\): give one of its tokens \(the one its template begins "
                     rf"a text with: '{BOS}'\)"),
    ("tok", EOS, "is the end-of-document token, which every document already follows: drop --bos-token"),
    ("byte", BOS, "the byte tokenizer has no beginning-of-document token; drop it, or pass --tokenizer FILE.json"),
])
def test_a_token_that_cannot_begin_documents_is_refused_in_one_line(tokenizer, tmp_path, capsys, spec, bos, said):
    import tools.preprocess_data as tool

    src = _documents(tmp_path / "src", count=3)
    spec = tokenizer if spec == "tok" else spec
    assert tool.main(["--input", str(src), "--output", str(tmp_path / "out"), "--tokenizer", spec,
                      "--bos-token", bos]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert re.search(said, err), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_the_data_s_token_is_found_again_from_its_id(tokenizer):
    tok = tokenizer_of_data(tokenizer, None, 32, 31)
    assert (tok.bos_token, tok.bos_id) == (BOS, 31) and tok.document("w1 w2") == [31, 1, 2]
    assert tokenizer_of_data(tokenizer, None, 32, None).document("w1 w2") == [1, 2]
    with pytest.raises(ConfigError, match="beginning-of-document id 40, which tokenizer .* has no token for"):
        tokenizer_of_data(tokenizer, None, 32, 40)
    with pytest.raises(ConfigError, match="beginning-of-document id 31, which the byte tokenizer has not"):
        tokenizer_of_data("byte", None, 256, 31)
    assert load_tokenizer(tokenizer).template_prefix() == [BOS]


def test_a_mixture_of_documents_that_begin_otherwise_is_refused(tokenizer, tmp_path):
    src = _documents(tmp_path / "src", count=6)
    preprocess([str(src)], tmp_path / "with", tokenizer_spec=tokenizer, valid_fraction=0.2, bos_token=BOS)
    preprocess([str(src)], tmp_path / "without", tokenizer_spec=tokenizer, valid_fraction=0.2)
    assert len(read_metas([str(tmp_path / "with"), str(tmp_path / "with")])) == 2
    with pytest.raises(ConfigError, match=r"data.paths mixes documents that begin otherwise: .*with/meta.json has "
                                          r"beginning-of-document id 31, .*without/meta.json has no "
                                          "beginning-of-document token: preprocess every directory"):
        read_metas([str(tmp_path / "with"), str(tmp_path / "without")])


@pytest.fixture
def trained(tokenizer, tiny_overrides, tmp_path):
    """A tiny model trained 2 steps on documents that begin with <s>, checkpointed at step 2."""
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    preprocess([str(_documents(tmp_path / "src"))], tmp_path / "data", tokenizer_spec=tokenizer, valid_fraction=0.1,
               bos_token=BOS)
    Trainer(load_config("tiny_dense", tiny_overrides + [f"data.path={tmp_path / 'data'}", "training.steps=2",
                                                        "training.eval_interval=0", "checkpoint.interval=2"]),
            ParallelDims.single(), torch.device("cpu")).fit()
    return tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"


def test_generation_and_an_export_begin_a_text_as_the_run_s_documents_began(trained, tokenizer, tmp_path, capsys):
    import tools.convert_checkpoint as tool
    from megafp8.train.generate import load_generator

    gen = load_generator(trained, torch.device("cpu"))
    assert gen.tokenizer.document("w3") == [31, 3]  # the prompt as training's documents began
    assert tool.main(["to-hf", str(trained), "--out", str(tmp_path / "hf"), "--tokenizer", tokenizer]) == 0
    assert f"eos_token '{EOS}' (id 32), bos_token '{BOS}' (id 31)" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (31, 32)
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["bos_token"] == BOS
    # An import never trained here: its prompts begin as its tokenizer's template begins a text.
    assert tool.main(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    assert f"tools/preprocess_data.py --tokenizer {tmp_path / 'hf' / 'tokenizer.json'} --bos-token '{BOS}')" in (
        capsys.readouterr().out)
    imported = next((tmp_path / "imported").glob("step_*"))
    assert load_generator(imported, torch.device("cpu"), tokenizer).tokenizer.document("w3") == [31, 3]
    plain = str(_templated_tokenizer(tmp_path / "plain.json", template=False))
    assert load_generator(imported, torch.device("cpu"), plain).tokenizer.document("w3") == [3]


def test_an_export_says_where_its_template_and_the_documents_disagree(trained, tmp_path, capsys):
    """Documents that began with <s>, exported with a tokenizer.json whose template adds nothing: `AutoTokenizer`
    would encode prompts without it."""
    import tools.convert_checkpoint as tool

    plain = str(_templated_tokenizer(tmp_path / "plain.json", template=False))
    assert tool.main(["to-hf", str(trained), "--out", str(tmp_path / "hf"), "--tokenizer", plain]) == 0
    assert (f"the run's documents began with '{BOS}', which the tokenizer.json's template does not add: prepend it "
            "to a prompt when encoding") in capsys.readouterr().out


def test_auto_tokenizer_of_the_export_begins_a_text_as_training_did(trained, tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    import tools.convert_checkpoint as tool

    assert tool.main(["to-hf", str(trained), "--out", str(tmp_path / "hf"), "--tokenizer", tokenizer]) == 0
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded("w1 w2").input_ids == [31, 1, 2]
    assert (loaded.bos_token_id, loaded.eos_token_id) == (31, 32)
