"""Checkpoint conversion checked against Hugging Face `transformers` itself (the `test` extra installs it; without it
these tests skip, and with MEGAFP8_REQUIRE_TRANSFORMERS=1, set by `.ci/run`, that skip is a failure).

Tiny random models of every supported model_type are made and saved by transformers, imported, and their FP32
logits compared with transformers' own forward on the same tokens; megafp8 models are exported and loaded by
transformers, same bound. (The refusals of what megafp8 cannot represent are in tests/test_convert.py.) The
measured max |logit difference| and argmax agreement of each case are printed as a table at the end of the run.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re

import pytest
import torch

if os.environ.get("MEGAFP8_REQUIRE_TRANSFORMERS") == "1" and importlib.util.find_spec("transformers") is None:
    pytest.fail("MEGAFP8_REQUIRE_TRANSFORMERS=1 (set by .ci/run) but transformers is not installed", pytrace=False)
pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers", reason="needs the test extra: pip install -e '.[test]'")

from megafp8.checkpoint.hf import load_hf, save_hf  # noqa: E402
from megafp8.data import load_tokenizer  # noqa: E402
from megafp8.config import GqaConfig, MlaConfig, ModelConfig, MoeConfig, RopeScalingConfig  # noqa: E402
from megafp8.model import Transformer, init_weights  # noqa: E402
from megafp8.precision import PrecisionRecipe  # noqa: E402

BOUND = 1e-4
SEQ = 48
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            initializer_range=0.1, max_position_embeddings=128)
DEEPSEEK = dict(TINY, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
YARN_V3 = dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
               original_max_position_embeddings=32)  # DeepSeek-V3's values but for the original 4096 tokens
IMPORTS = {
    "llama, rope_theta 10000": ("Llama", dict(num_key_value_heads=2)),
    "llama, rope_theta 500000 (Llama-3)": ("Llama", dict(num_key_value_heads=2, rope_theta=500000.0)),
    "llama, llama3 scaling (Llama-3.1)": ("Llama", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama, yarn scaling": ("Llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                               original_max_position_embeddings=32))),
    "llama, tied embeddings (Llama-3.2)": ("Llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral, no sliding window": ("Mistral", dict(num_key_value_heads=2, sliding_window=None, rope_theta=1e6)),
    "mixtral, top-2 of 4 experts": ("Mixtral", dict(num_key_value_heads=2, num_local_experts=4)),
    "qwen2, q/k/v biases, tied (Qwen2.5-0.5B-like)": ("Qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                                                    rope_theta=1e6)),
    "qwen3, head_dim 32 (not hidden / heads), tied (Qwen3-0.6B-like)": ("Qwen3", dict(
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3, llama3 scaling, window off": ("Qwen3", dict(
        num_key_value_heads=4, head_dim=16, use_sliding_window=False, sliding_window=4096, max_window_layers=1,
        rope_parameters=dict(
        rope_type="llama3", rope_theta=1e6, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "qwen3_moe, top-2 of 4, renormalized, layer 0 dense": ("Qwen3Moe", dict(
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen3_moe, top-3 of 4, not renormalized (Qwen3-30B-A3B's default)": ("Qwen3Moe", dict(
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32)),
    "qwen3_moe, head_dim left out (hidden / heads)": ("Qwen3Moe", dict(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "deepseek_v2, V2-Lite-like (yarn)": ("DeepseekV2", dict(DEEPSEEK, q_lora_rank=None, n_shared_experts=2,
                                                              num_experts_per_tok=3, rope_parameters=dict(
        YARN_V3, rope_theta=10000.0, mscale=0.707, mscale_all_dim=0.707))),
    "deepseek_v3, rope_theta 50000, yarn, no MTP weights": ("DeepseekV3", dict(
        DEEPSEEK, q_lora_rank=48, n_group=2, topk_group=1, rope_parameters=dict(YARN_V3, rope_theta=50000.0))),
    "deepseek_v3, no shared experts (zero-width in the file)": ("DeepseekV3", dict(
        DEEPSEEK, q_lora_rank=48, n_group=2, topk_group=1, n_shared_experts=0)),
    "deepseek_v3, dense, plain rotary rows": ("DeepseekV3", dict(DEEPSEEK, q_lora_rank=None, first_k_dense_replace=2,
                                                                   rope_interleave=False)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and selection biases away from their init (1, 0), so that a wrong mapping of them shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith(("e_score_correction_bias", "expert_bias")):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith(("qkv_bias", "proj.bias")):  # Qwen2's q/k/v biases, away from their zero init
                t.copy_(0.5 * torch.randn(t.shape, generator=g))


def _hf_model(kind: str, settings: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = getattr(transformers, f"{kind}Config")(**{**TINY, **settings})
    model = getattr(transformers, f"{kind}ForCausalLM")(config).float().eval()
    _randomize(model, seed)
    return model


def _ours(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    model = Transformer(cfg, PrecisionRecipe.from_name("fp32"), SEQ).eval()
    model.load_state_dict(state)
    return model


def _measure(hf_model, ours: Transformer, vocab: int, record_property, case: str) -> None:
    """Both models' FP32 logits on the same tokens: equal within BOUND, the same argmax everywhere. The measurement
    is recorded for the table at the end of the run (tests/conftest.py)."""
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        theirs, mine = hf_model(tokens).logits, ours(tokens)
    diff, agree = (theirs - mine).abs().max().item(), (theirs.argmax(-1) == mine.argmax(-1)).float().mean().item()
    record_property("logits_vs_transformers", (case, diff, agree))
    assert theirs.std() > 0.3  # logits spread enough that a wrong mapping shows
    assert diff <= BOUND and agree == 1.0, f"{case}: max |diff| {diff:.3g}, argmax agreement {agree:.1%}"


@pytest.mark.parametrize("case", list(IMPORTS))
def test_import_of_a_transformers_model_gives_its_logits(tmp_path, record_property, case):
    kind, settings = IMPORTS[case]
    hf_model = _hf_model(kind, settings)
    hf_model.save_pretrained(tmp_path)
    if "head_dim left out" in case:  # Qwen3-MoE's config has none: was read as Qwen3's 128, and refused
        assert "head_dim" not in json.loads((tmp_path / "config.json").read_text())
    imported = load_hf(tmp_path)
    assert imported.layout == hf_model.config.model_type
    _measure(hf_model, _ours(imported.cfg, imported.state), TINY["vocab_size"], record_property, f"import {case}")
    if "zero-width" in case:  # were refused as tensors the config does not declare
        assert imported.cfg.moe.num_shared_experts == 0
    if "no MTP weights" in case:
        assert imported.cfg.mtp_depth == 0 and imported.notes == [
            "num_nextn_predict_layers=1 but the checkpoint has no MTP weights (layer 2 on): imported with "
            "model.mtp_depth=0"]
    if "tied" in case:
        assert imported.notes and "tie_word_embeddings=true" in imported.notes[0]
        assert torch.equal(imported.state["lm_head.weight"], imported.state["embed.weight"])


GQA = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                  attention=GqaConfig(num_kv_heads=2, head_dim=16), ffn_hidden_size=96, init_std=0.1)
MLA = dataclasses.replace(GQA, norm_eps=1e-6, attention=MlaConfig(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                                                                  qk_rope_head_dim=8, v_head_dim=16),
                          moe=MoeConfig(num_experts=8, top_k=2, ffn_hidden_size=32, first_dense_layers=1))
LLAMA3 = RopeScalingConfig(type="llama3", factor=8.0, original_max_position_embeddings=32)
YARN = RopeScalingConfig(type="yarn", factor=40.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.5)
EXPORTS = {
    "llama, llama3 scaling": dataclasses.replace(GQA, rope_theta=500000.0, rope_scaling=LLAMA3),
    "qwen2, q/k/v biases": dataclasses.replace(GQA, attention=GqaConfig(num_kv_heads=2, head_dim=16, qkv_bias=True)),
    "qwen3, head_dim 32": dataclasses.replace(GQA, attention=GqaConfig(num_kv_heads=2, head_dim=32, qk_norm=True),
                                              rope_theta=1e6),
    "qwen3_moe, layer 0 dense, not renormalized": dataclasses.replace(
        GQA, attention=GqaConfig(num_kv_heads=2, head_dim=16, qk_norm=True), moe=MoeConfig(
            num_experts=4, top_k=2, ffn_hidden_size=48, num_shared_experts=0, first_dense_layers=1,
            score_func="softmax", norm_topk_prob=False)),
    "mixtral, yarn": dataclasses.replace(GQA, ffn_hidden_size=48, rope_scaling=YARN, moe=MoeConfig(
        num_experts=4, top_k=2, ffn_hidden_size=48, num_shared_experts=0, first_dense_layers=0, score_func="softmax")),
    "deepseek_v2, yarn": dataclasses.replace(
        MLA, rope_scaling=YARN, attention=dataclasses.replace(MLA.attention, q_lora_rank=None),
        moe=dataclasses.replace(MLA.moe, score_func="softmax", top_k=3, num_shared_experts=2, norm_topk_prob=False)),
    "deepseek_v3, yarn, MTP": dataclasses.replace(
        MLA, mtp_depth=1, rope_theta=50000.0, rope_scaling=YARN,
        moe=dataclasses.replace(MLA.moe, n_group=2, topk_group=1, routed_scaling_factor=2.5)),
}


def _megafp8_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """FP32 weights on the BF16 grid (export writes BF16, so losslessly), norms and selection biases randomized."""
    model = Transformer(cfg, PrecisionRecipe.from_name("fp32"), SEQ).eval()
    init_weights(model, cfg, seed)
    _randomize(model, seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    if cfg.moe.score_func == "softmax":  # Mixtral and DeepSeek-V2 have no selection bias
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
    return model


@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, record_property, case):
    cfg = EXPORTS[case]
    model = _megafp8_model(cfg)
    layout = save_hf(model.state_dict(), cfg, SEQ, tmp_path, fp8=False)
    assert case.startswith(layout)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    _measure(hf_model, model, cfg.vocab_size, record_property, f"export {case}")
    imported = load_hf(tmp_path)  # and back: every tensor and setting as it was (training-only ones aside)
    training_only = dict(init_std=cfg.init_std, moe=dataclasses.replace(imported.cfg.moe,
                                                                        bias_update_rate=cfg.moe.bias_update_rate))
    assert dataclasses.replace(imported.cfg, **training_only) == cfg
    for name, t in model.state_dict().items():
        assert torch.equal(imported.state[name], t), name



def test_an_export_in_shards_loads_in_transformers_with_the_same_logits(tmp_path, record_property):
    """Over `shard_bytes` the weights go into model-0000i-of-0000n.safetensors files with an index, as
    `save_pretrained` writes a large model: transformers loads them so (and our import reads them back)."""
    case = "deepseek_v3, yarn, MTP"
    cfg = EXPORTS[case]
    model = _megafp8_model(cfg)
    save_hf(model.state_dict(), cfg, SEQ, tmp_path, fp8=False, shard_bytes=64 * 2**10)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists(), shards
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _measure(hf_model, model, cfg.vocab_size, record_property, f"export {case}, in {len(shards)} shards")
    imported = load_hf(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(imported.state[name], t), name


def _with_some_whole_tiles(cfg: ModelConfig) -> ModelConfig:
    """`cfg` 128 wide, its dense MLPs and one attention projection of each kind whole 128x128 tiles (GQA's query and
    output projections, MLA's q_b), the other projections and the experts not."""
    if cfg.attention.kind == "gqa":
        attention = dataclasses.replace(cfg.attention, head_dim=32)
    else:
        attention = dataclasses.replace(cfg.attention, qk_nope_head_dim=24)
    return dataclasses.replace(cfg, hidden_size=128, ffn_hidden_size=128, attention=attention)


@pytest.mark.parametrize("case", list(EXPORTS))
@pytest.mark.parametrize("dequantize", [False, True], ids=["fp8 layers", "dequantized"])
def test_fp8_export_loads_in_transformers_with_its_bf16_layers_declared(tmp_path, monkeypatch, case, dequantize):
    """transformers makes every nn.Linear of an FP8 checkpoint but those `modules_to_not_convert` names an FP8Linear
    (E4M3 weight and `weight_scale_inv`; on a GPU), or dequantizes each weight by its scale grid (without one). The
    export keeps projections that are not whole 128x128 tiles BF16, so it must declare them (experts by their layer's
    `experts` module): an FP8Linear got a BF16 weight and an uninitialized scale, silently. Both paths are taken here
    on the CPU by replacing transformers' environment check (it needs a GPU, or `accelerate` to dequantize), and the
    weights compared (FP8Linear's kernels need a GPU; dequantized, transformers keeps BF16 experts in BF16 whatever
    dtype it is asked for, so its FP32 logits differ)."""
    from safetensors.torch import load_file
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from megafp8.checkpoint.hf_tensors import HfTensors

    cfg = _with_some_whole_tiles(EXPORTS[case])
    model = _megafp8_model(cfg)
    save_hf(model.state_dict(), cfg, SEQ, tmp_path, fp8=True)
    file = HfTensors(load_file(str(tmp_path / "model.safetensors")))  # megafp8's dequantization of the file
    assert any(t.dtype == torch.float8_e4m3fn for t in file.tensors.values())

    def check_environment(self, *args, **kwargs) -> None:
        self.quantization_config.dequantize = dequantize

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", check_environment)
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    if dequantize:  # every weight as the file holds it (transformers fuses the experts: they are not compared)
        weights = {name: t for name, t in hf_model.state_dict().items() if name in file}
        assert any(name.endswith("o_proj.weight") for name in weights)
        for name, t in weights.items():
            assert torch.equal(t.float(), file(name)), name
        return
    layers = {name: m for name, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert any(type(m).__name__ == "FP8Linear" for m in layers.values())
    for name, layer in layers.items():
        if type(layer).__name__ != "FP8Linear":
            assert torch.equal(layer.weight, file(f"{name}.weight")), name
            continue
        rows, cols = layer.weight.shape
        scale = layer.weight_scale_inv.detach().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        assert torch.equal(layer.weight.float() * scale, file(f"{name}.weight")), name


def test_an_export_with_its_tokenizer_loads_in_auto_tokenizer_and_says_its_end_of_text_id(tiny_overrides, tmp_path,
                                                                                        capsys):
    """A run on data of its own tokenizer.json, exported: config.json named no token ids, so transformers took
    Llama's defaults (bos 1, eos 2: ordinary tokens of this tokenizer, where generation then stopped), and the
    directory held no tokenizer for AutoTokenizer. `--tokenizer` puts it there with its end-of-text id; without it
    the ids are null, and the tool says which tokenizer the run's data was made with."""
    pytest.importorskip("tokenizers")
    import tools.convert_checkpoint as tool
    from megafp8.config import load_config
    from megafp8.data.preprocess import preprocess, train_tokenizer
    from megafp8.parallel import ParallelDims
    from megafp8.train import Trainer

    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i:03d}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + 'text'\n" * 20)
    tok, other = tmp_path / "tok.json", tmp_path / "other.json"
    train_tokenizer([str(src)], tok, vocab_size=400)
    train_tokenizer([str(src)], other, vocab_size=300)
    preprocess([str(src)], tmp_path / "data", tokenizer_spec=str(tok), valid_fraction=0.1)
    Trainer(load_config("tiny_dense", tiny_overrides + [f"data.path={tmp_path / 'data'}", "training.steps=2",
                                                        "training.eval_interval=0", "checkpoint.interval=2"]),
            ParallelDims.single(), torch.device("cpu")).fit()
    step2 = tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"
    assert tool.main(["to-hf", str(step2), "--out", str(tmp_path / "bare")]) == 0
    assert f"add --tokenizer FILE.json (the run's data was tokenized with {tok})" in capsys.readouterr().out
    bare = transformers.AutoConfig.from_pretrained(tmp_path / "bare")
    assert bare.eos_token_id is None and bare.bos_token_id is None  # were 2 and 1
    assert tool.main(["to-hf", str(step2), "--out", str(tmp_path / "hf"), "--tokenizer", str(tok)]) == 0
    assert "eos_token '<|endoftext|>' (id 0)" in capsys.readouterr().out
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == config.eos_token_id == 0
    assert loaded("def function_3(x):").input_ids == load_tokenizer(str(tok)).encode("def function_3(x):")
    assert tool.main(["to-hf", str(step2), "--out", str(tmp_path / "wrong"), "--tokenizer", str(other)]) == 2
    assert re.search(rf"--tokenizer {re.escape(str(other))} has \d+ ids, but the run's data was tokenized with "
                     rf"{re.escape(str(tok))} of {load_tokenizer(str(tok)).vocab_size}: give the tokenizer.json",
                     capsys.readouterr().err)
    assert not (tmp_path / "wrong").exists()
