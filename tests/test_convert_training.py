"""Hugging Face imports trained on: a DeepSeek-V2-Lite-shaped and a Qwen3-MoE-shaped model, exported and imported,
train in FP8 (untiled layers BF16, query/key norms learning), and a resume under other RoPE settings says so. The
conversions themselves are tested in tests/test_convert.py."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from megafp8.config import GqaConfig, RopeScalingConfig, load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer

pytest.importorskip("safetensors")
from tests.test_convert import CFG, V2, _exported, with_moe  # noqa: E402


def test_a_v2_lite_shaped_import_trains_in_fp8_keeping_untiled_layers_bf16(tiny_overrides, tmp_path, caplog):
    """DeepSeek-V2-Lite's dense FFN (10944) and kv_a (512 + 64 rows) are not whole 128-wide tiles. Imported and trained
    under FP8 (here 200 and 128 + 64), those layers run BF16 on their own and the start-up line names them."""
    from megafp8.checkpoint.convert import import_hf, model_settings

    cfg = with_moe(dataclasses.replace(V2, hidden_size=128, num_layers=2, num_heads=2, ffn_hidden_size=200,
                                       attention=dataclasses.replace(V2.attention, q_lora_rank=None)),
                   num_experts=4, ffn_hidden_size=128)
    _exported(cfg, tmp_path / "hf")
    path, imported, _ = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    (tmp_path / "run.yaml").write_text(model_settings(imported))
    not_model = [o for o in tiny_overrides if not o.startswith("model.")]
    run = load_config(tmp_path / "run.yaml", not_model + [f"checkpoint.resume={path}", "precision.recipe=fp8",
                                                          "training.steps=2", "training.eval_interval=0"])
    with caplog.at_level("INFO", logger="megafp8"):
        trainer = Trainer(run, ParallelDims.single(), torch.device("cpu"))
    assert ("BF16 as not whole 128x128 FP8 tiles: layers.*.attn.kv_a_proj (x2), layers.0.mlp.gate_up_proj, "
            "layers.0.mlp.down_proj") in caplog.text
    assert trainer.model.layers[1].mlp.experts.gate_up_proj.runs_fp8 and trainer.model.layers[0].attn.q_proj.runs_fp8
    losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_a_qwen3_moe_import_trains_in_fp8_with_its_query_key_norms(tiny_overrides, tmp_path):
    """A Qwen3-MoE-shaped model (query/key norms, a dense first layer, softmax routing), exported and imported, trains
    in FP8: every projection and expert FP8 (the QKV one without RoPE's fused backward), the norms learning."""
    from megafp8.checkpoint.convert import import_hf, model_settings

    cfg = with_moe(dataclasses.replace(CFG, hidden_size=128, num_heads=2, ffn_hidden_size=256, attention=GqaConfig(
        num_kv_heads=1, head_dim=128, qk_norm=True)), num_experts=4, ffn_hidden_size=128, num_shared_experts=0,
                   score_func="softmax", norm_topk_prob=False)
    _exported(cfg, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"
    path, imported, _ = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert imported.attention.qk_norm and imported.moe.first_dense_layers == 1
    (tmp_path / "run.yaml").write_text(model_settings(imported))
    not_model = [o for o in tiny_overrides if not o.startswith("model.")]
    run = load_config(tmp_path / "run.yaml", not_model + [f"checkpoint.resume={path}", "precision.recipe=fp8",
                                                          "training.steps=2", "training.eval_interval=0"])
    trainer = Trainer(run, ParallelDims.single(), torch.device("cpu"))
    attn = trainer.model.layers[1].attn
    assert attn.qkv_proj.runs_fp8 and trainer.model.layers[1].mlp.experts.gate_up_proj.runs_fp8
    before = attn.q_norm.weight.detach().clone()
    losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert not torch.equal(attn.q_norm.weight.detach(), before)


def test_resuming_an_import_under_other_rope_settings_says_so(tiny_overrides, tmp_path, caplog):
    """The tensors of a Llama-3-style import (rope_theta 500000, llama3 scaling) fit a run with plain RoPE: the
    resume says which settings differ, since the weights then compute another function."""
    from megafp8.checkpoint.convert import import_hf

    cfg = dataclasses.replace(CFG, hidden_size=128, num_heads=2, attention=GqaConfig(num_kv_heads=1),
                              ffn_hidden_size=256, rope_theta=5e5,
                              rope_scaling=RopeScalingConfig(type="llama3", factor=8.0))
    _exported(cfg, tmp_path / "hf")
    path, _, _ = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    with caplog.at_level("WARNING", logger="megafp8"):
        Trainer(load_config("tiny_dense", tiny_overrides + [f"checkpoint.resume={path}"]), ParallelDims.single(),
                torch.device("cpu"))
    assert "model.rope_theta: 500000.0 in the checkpoint, 10000.0 in this run; model.rope_scaling: {'type': 'llama3'," \
           in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="megafp8"):
        Trainer(load_config("tiny_dense", tiny_overrides + [
            f"checkpoint.resume={path}", "model.rope_theta=5e5", "model.rope_scaling.type=llama3",
            "model.rope_scaling.factor=8", "run_name=same"]), ParallelDims.single(), torch.device("cpu"))
    assert "model settings other than its own" not in caplog.text
