"""What an import from Hugging Face keeps of its source beyond the model settings (max_position_embeddings, token
ids, the tokenizer beside it), carried by its checkpoints and a fine-tuning run's, and written back on export."""
from __future__ import annotations

import json

import pytest
import torch

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from tests.test_convert import CFG, tiny_model

pytest.importorskip("safetensors")
from megafp8.checkpoint.hf import save_hf  # noqa: E402


TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": [2, 5], "pad_token_id": -1}  # -1: not an id, written as null


def test_hf_round_trip_keeps_max_position_embeddings_and_token_ids(tmp_path):
    """An imported model's token ids go back into its export (they were written as null: generation with the
    exported model no longer stopped at the imported tokenizer's end of text)."""
    from megafp8.checkpoint.convert import export_hf, import_hf, missing_tokenizer_note

    save_hf(tiny_model().state_dict(), CFG, 256, tmp_path / "hf", fp8=False, token_ids=TOKEN_IDS)
    path, _, _ = import_hf(tmp_path / "hf", tmp_path / "ck")
    written = export_hf(path, tmp_path / "hf2", fp8=False)
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["max_position_embeddings"] == 256
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, [2, 5], None)
    assert written == "llama; max_position_embeddings 256: kept from the imported Hugging Face config"
    assert "config.json's eos_token_id is the imported model's ([2, 5])" in missing_tokenizer_note(path)


def test_an_import_names_the_tokenizer_its_directory_holds(tmp_path):
    """The model's ids mean its own tokenizer's text: an import said nothing of the tokenizer.json beside it, and a
    run over data of another tokenizer trained without a word."""
    from megafp8.checkpoint.convert import import_hf

    save_hf(tiny_model().state_dict(), CFG, 256, tmp_path / "hf", fp8=False)
    assert import_hf(tmp_path / "hf", tmp_path / "ck")[2] == []
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    notes = import_hf(tmp_path / "hf", tmp_path / "ck2")[2]
    assert notes == [f"{tmp_path}/hf/tokenizer.json is the model's tokenizer: tokenize the data it trains on with it "
                     f"(tools/preprocess_data.py --tokenizer {tmp_path}/hf/tokenizer.json)"]


def test_an_imported_model_fine_tuned_at_a_shorter_context_exports_the_imported_positions(tiny_overrides, tmp_path):
    """Imported with max_position_embeddings 256, trained 2 steps at data.seq_len 64: the export said 64 (the run's
    checkpoints did not carry what the import kept), serving a long-context model as a short one. A run at a longer
    context than the import's writes its own."""
    from megafp8.checkpoint.convert import export_hf, import_hf, model_settings

    save_hf(tiny_model().state_dict(), CFG, 256, tmp_path / "hf", fp8=False, token_ids=TOKEN_IDS)
    path, cfg, _ = import_hf(tmp_path / "hf", tmp_path / "ck")
    (tmp_path / "run.yaml").write_text(model_settings(cfg))
    not_model = [o for o in tiny_overrides if not o.startswith("model.")]
    for seq_len, expected in ((64, "256: kept from the imported Hugging Face config"),
                              (512, "512: the run's data.seq_len, above the imported config's 256")):
        run = f"ft{seq_len}"
        Trainer(load_config(tmp_path / "run.yaml", not_model + [
            f"checkpoint.resume={path}", f"run_name={run}", f"data.seq_len={seq_len}", "training.steps=2",
            "training.eval_interval=0", "checkpoint.interval=2", "training.global_batch_size=2",
            "training.micro_batch_size=1"]), ParallelDims.single(), torch.device("cpu")).fit()
        step2 = tmp_path / "runs" / run / "checkpoints" / "step_00000002"
        assert export_hf(step2, tmp_path / f"hf_{run}", fp8=False) == f"llama; max_position_embeddings {expected}"
        config = json.loads((tmp_path / f"hf_{run}" / "config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"]) == (1, [2, 5])  # carried by the run's checkpoints
