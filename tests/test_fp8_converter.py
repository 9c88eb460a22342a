"""The FP8 converter (`megafp8.model.fp8_converter`): its plan is checked once against the whole model, described
without converting, applied, switched on at `precision.fp8_start_step` and restored on resume; the GEMM layers it
converts share one base (`megafp8.precision.GemmLayer`)."""
from __future__ import annotations

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.model import Fp8Converter, Transformer
from megafp8.model.fp8_converter import gemm_layers
from megafp8.parallel import ColumnParallelLinear, ExpertLinear, ExpertParallel, ParallelDims, RowParallelLinear
from megafp8.parallel.pipeline import StageSpec, attach_wgrad_queue
from megafp8.precision import PrecisionRecipe, WeightGradQueue
from megafp8.train import Trainer

CPU = torch.device("cpu")


def converter_for(config: str, *overrides: str) -> tuple:
    cfg = load_config(config, ["model.vocab_size=384", *overrides])
    recipe = PrecisionRecipe.from_config(cfg.precision)
    return cfg, recipe, Fp8Converter(cfg.precision, recipe, cfg.model.num_layers)


def fp8_layers(model) -> list[str]:
    return [name for name, layer in gemm_layers(model).items() if layer.runs_fp8]


def test_globs_are_checked_against_the_whole_model_and_a_stage_is_converted_without_them():
    """A pipeline stage holds only some layers: a glob naming another stage's layers is right for the run (checked
    on a meta copy of the whole model) and converts nothing here."""
    cfg, recipe, converter = converter_for("tiny_dense_fp8", "precision.fp8_layers=[layers.3.mlp.*]")
    whole = Transformer(cfg.model, recipe, 64, device="meta")
    stage = Transformer(cfg.model, recipe, 64, stages=[StageSpec(0, (0, 1), first=True, last=False)])
    assert converter.check(whole).fp8_layers == ["layers.3.mlp.gate_up_proj", "layers.3.mlp.down_proj"]
    with pytest.raises(ConfigError, match=r"precision.fp8_layers entry 'layers.3.mlp.\*' matches no GEMM layer "
                                          r"\(names look like layers.0.attn.qkv_proj\)"):
        converter.check(stage)
    assert converter.convert(stage).fp8_layers == [] and fp8_layers(stage) == []


@pytest.mark.parametrize("override, message", [
    ("precision.fp8_layers=['*.mlp.*', 'layers.*.mpl.*']", "precision.fp8_layers entry 'layers.*.mpl.*' matches no"),
    ("precision.bf16_layers=['layers.9.*']", "precision.bf16_layers entry 'layers.9.*' matches no GEMM layer"),
    ("precision.fp8_layers=['final_norm']", "precision.fp8_layers entry 'final_norm' names 'final_norm', a precision "
                                            "island"),
])
def test_a_glob_that_matches_no_gemm_layer_is_named(override, message):
    cfg, recipe, converter = converter_for("tiny_dense_fp8", override)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("*", r"\*")):
        converter.check(Transformer(cfg.model, recipe, 64, device="meta"))


def test_plan_describes_without_converting_and_convert_follows_the_start_step():
    cfg, recipe, converter = converter_for("tiny_dense_fp8", "precision.fp8_start_step=5",
                                           "precision.bf16_first_last_blocks=1")
    model = Transformer(cfg.model, recipe, 64)
    planned = [f"layers.{i}.{p}" for i in (1, 2) for p in ("attn.qkv_proj", "attn.out_proj", "mlp.gate_up_proj",
                                                             "mlp.down_proj")]
    built_as = fp8_layers(model)  # every whole-tile layer but the LM head: the recipe the model was built with
    assert converter.plan(model).fp8_layers == planned and fp8_layers(model) == built_as  # nothing changed
    assert [converter.switches_at(s) for s in (0, 4, 5, 6)] == [False, False, True, False]
    assert converter.convert(model).fp8_layers == planned and fp8_layers(model) == []  # step 0: BF16
    assert converter.convert(model, 4).fp8_layers == planned and fp8_layers(model) == []
    converter.convert(model, 5)
    assert fp8_layers(model) == planned
    cache = model.layers[1].mlp.down_proj.fp8_cache
    converter.convert(model, 6)  # already so: left as it is
    assert model.layers[1].mlp.down_proj.fp8_cache is cache
    converter.convert(model, 4)  # back before the start step (a resume from an earlier checkpoint)
    assert fp8_layers(model) == []


def test_bf16_first_last_blocks_keeps_the_mtp_modules_in_bf16_with_the_last_blocks():
    """An MTP module's block follows the last block and, like it, feeds the shared output head: the blocks nearest
    the output that `bf16_first_last_blocks` keeps out of FP8. They ran FP8 (and their combining projection) while
    the last main block beside them ran BF16. The main blocks kept are the same with MTP as without."""
    cfg, recipe, converter = converter_for("tiny_dense_fp8", "precision.bf16_first_last_blocks=1",
                                           "model.mtp_depth=2")
    plan = converter.check(Transformer(cfg.model, recipe, 64, device="meta"))
    assert not [n for n in plan.fp8_layers if n.startswith(("mtp.", "layers.0.", "layers.3."))], plan.fp8_layers
    assert {n.split(".")[1] for n in plan.fp8_layers if n.startswith("layers.")} == {"1", "2"}
    assert {"mtp.0.combine_proj", "mtp.1.block.mlp.down_proj"} <= set(plan.bf16_layers)
    _, _, unset = converter_for("tiny_dense_fp8", "model.mtp_depth=2")  # without the setting MTP runs FP8
    assert "mtp.1.block.mlp.down_proj" in unset.check(Transformer(cfg.model, recipe, 64, device="meta")).fp8_layers


def test_without_fp8_every_layer_is_bf16_and_nothing_switches():
    cfg, recipe, converter = converter_for("tiny_dense", "precision.fp8_start_step=2")
    model = Transformer(cfg.model, recipe, 64)
    assert converter.check(model).fp8_layers == [] and fp8_layers(model) == []
    assert not any(converter.switches_at(s) for s in range(4)) and not converter.runs_fp8_at(3)


def _trainer(overrides):
    torch.manual_seed(0)
    return Trainer(load_config("tiny_dense", overrides), ParallelDims.single(), CPU)


def test_the_trainer_checks_once_on_a_meta_copy_and_switches_at_the_start_step(tiny_overrides, monkeypatch, caplog):
    checked = []
    check = Fp8Converter.check
    monkeypatch.setattr(Fp8Converter, "check", lambda self, model: checked.append(model) or check(self, model))
    with caplog.at_level("INFO", logger="megafp8"):
        trainer = _trainer(tiny_overrides + ["precision.recipe=fp8", "precision.fp8_start_step=2",
                                             "training.eval_interval=0"])
        runs = []
        for _ in range(3):
            runs.append(fp8_layers(trainer.model))
            trainer.train_step()
        runs.append(fp8_layers(trainer.model))
    assert len(checked) == 1 and next(checked[0].parameters()).device.type == "meta"
    planned = trainer.fp8.plan(trainer.model).fp8_layers
    assert len(planned) == 8 and runs == [[], [], [], planned]  # step 2 (the third) is the first FP8 one
    assert "fp8: backend reference (auto) | 8 of 9 GEMM layers in FP8; BF16: lm_head | BF16 until step 2" in caplog.text
    assert "step 2: switching to FP8 | 8 of 9 GEMM layers in FP8" in caplog.text


@pytest.mark.parametrize("saved_at", [1, 2, 3])
def test_resume_converts_at_load_to_the_precision_of_its_step(tiny_overrides, tmp_path, saved_at):
    """FP8 from step 2: a run resumed before it loads in BF16 and switches there; one resumed at or past it loads in
    FP8. Either way it continues bit for bit as the run that was not interrupted."""
    overrides = tiny_overrides + ["precision.recipe=fp8", "precision.fp8_start_step=2", "training.steps=5",
                                  "training.eval_interval=0"]
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=100"]
    straight = [r["loss"] for r in _trainer(overrides + ["checkpoint.resume=none"]).fit() if r["kind"] == "train"]
    first = _trainer(overrides + ckpt)
    for _ in range(saved_at):
        first.train_step()
    first.save()
    resumed = _trainer(overrides + ckpt)
    assert resumed.step == saved_at
    assert len(fp8_layers(resumed.model)) == (8 if saved_at >= 2 else 0)
    assert [r["loss"] for r in resumed.fit() if r["kind"] == "train"] == straight[saved_at:]


def test_both_gemm_layers_share_one_base():
    """Tensor-parallel and expert linears switch numerics, pick a backend and take a weight-gradient queue the same
    way; `attach_wgrad_queue` finds them by type."""
    cfg, recipe, _ = converter_for("tiny_moe_fp8")
    model = Transformer(cfg.model, recipe, 64)
    layers = gemm_layers(model)
    assert {ColumnParallelLinear, RowParallelLinear, ExpertLinear} <= {type(m) for m in layers.values()}
    queue = WeightGradQueue()
    attach_wgrad_queue(model, queue)
    assert all(layer.wgrad_queue is queue for layer in layers.values())
    experts = model.layers[1].mlp.experts.gate_up_proj
    experts.set_recipe(recipe.high_precision())
    assert not experts.runs_fp8 and experts.fp8_cache is None and experts.fp8_capable
    experts.set_recipe(recipe)
    assert experts.runs_fp8 and experts.fp8_backend is None
    backend = experts.fp8_backend_for(CPU)
    assert backend.name == "reference" and experts.fp8_backend is backend
    with pytest.raises(ValueError, match="an FP8 ExpertLinear needs out_features to be a multiple of 128, got 200"):
        ExpertLinear(4, 128, 200, recipe, ExpertParallel.single())
    assert not ExpertLinear(4, 128, 200, recipe.high_precision(), ExpertParallel.single()).fp8_capable
