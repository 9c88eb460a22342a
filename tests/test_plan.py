"""Dry-run planning: parameter counts match the real model, memory follows the optimizer layout, and a run
that cannot fit fails before allocating anything."""
from __future__ import annotations

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.parallel.pipeline import build_layout
from megafp8.train.plan import GIB, check_fits, make_plan
from megafp8.train.build import build_model
from megafp8.precision import PrecisionRecipe
from tests.scripts import run_scripts


def test_parameter_counts_match_the_built_model():
    cfg = load_config("tiny_dense", ["model.vocab_size=384"])
    plan = make_plan(cfg, world_size=1)
    model = build_model(cfg, cfg.model, PrecisionRecipe.from_name("bf16"), torch.device("cpu"))
    assert plan.total_params == sum(p.numel() for p in model.parameters())
    assert plan.params["embedding"] == plan.params["lm_head"] == 384 * 256
    assert plan.params["norms"] == (2 * 4 + 1) * 256


def test_memory_follows_the_optimizer_layout():
    cfg = load_config("tiny_dense", ["model.vocab_size=384"])
    one, four = make_plan(cfg, 1), make_plan(cfg, 4)
    n = one.total_params
    assert one.bytes_per_rank["weights"] == 2 * n and one.bytes_per_rank["grads"] == 4 * n
    assert four.bytes_per_rank["master_weights"] == one.bytes_per_rank["master_weights"] / 4 == n
    assert four.bytes_per_rank["optimizer_states"] == 8 * n / 4
    assert four.bytes_per_rank["grads"] == 4 * n + n  # full FP32 buffer + this rank's reduced shard
    replicated = make_plan(load_config("tiny_dense", ["model.vocab_size=384", "optimizer.sharded=false"]), 4)
    assert replicated.bytes_per_rank["optimizer_states"] == 8 * n
    bf16_moments = make_plan(load_config("tiny_dense", ["model.vocab_size=384", "optimizer.moment_dtype=bf16"]), 4)
    assert bf16_moments.bytes_per_rank["optimizer_states"] == 4 * n / 4


def test_tensor_parallel_divides_the_weights_per_rank():
    overrides = ["model.size=1b", "model.vocab_size=32768"]
    one = make_plan(load_config("tiny_dense", overrides), 2)
    tp2 = make_plan(load_config("tiny_dense", overrides + ["parallel.tp=2"]), 2)
    assert tp2.total_params == one.total_params  # full counts
    norms = one.params["norms"]  # replicated on every TP rank
    assert tp2.bytes_per_rank["weights"] == 2 * ((one.total_params - norms) / 2 + norms)
    assert tp2.bytes_per_rank["master_weights"] == 4 * ((one.total_params - norms) / 2 + norms)  # dp 1: unsharded
    with pytest.raises(ConfigError, match="cannot be split into tp=4"):
        make_plan(load_config("tiny_dense", overrides + ["parallel.tp=4"]), 2)


def test_a_run_that_cannot_fit_fails_fast():
    cfg = load_config("tiny_dense", ["model.size=1b", "model.vocab_size=32768", "data.seq_len=2048",
                                     "training.micro_batch_size=8", "training.global_batch_size=8"])
    plan = make_plan(cfg, 1)
    check_fits(plan, capacity=None)  # CPU: nothing to check against
    check_fits(plan, capacity=int(plan.total_bytes) + 1)
    with pytest.raises(ConfigError, match=r"needs about .* GiB per GPU .* but the GPU has 8.0 GiB: use more ranks.*--dry-run"):
        check_fits(plan, capacity=8 * GIB)


def test_dry_run_command_prints_the_plan_and_needs_a_vocabulary(tmp_path):
    dry_run = ["launch/pretrain.py", "--config", "tiny_dense", "--dry-run", "--world-size", "8", "model.size=1b",
               "model.vocab_size=32768", "data.seq_len=2048", "training.global_batch_size=32"]
    # The four commands in one interpreter that imports torch once (tests/scripts.py): ~4 s of CPU each otherwise.
    result, tp2, plan_tool, missing = run_scripts([
        dry_run,
        dry_run + ["parallel.tp=2", "parallel.sequence_parallel=true"],
        ["tools/plan.py", "--config", "tiny_dense", "model.vocab_size=512"],
        ["tools/plan.py", "--config", "tiny_dense", f"data.path={tmp_path}"],
    ])
    assert result.returncode == 0, result.stderr
    assert "| **total** | **956.37M** |" in result.stdout and "sharded over 8 data-parallel" in result.stdout
    assert "| **total** | **956.37M** |" in tp2.stdout and "tp 2 with sequence parallelism" in tp2.stdout
    assert "sharded over 4 data-parallel" in tp2.stdout
    assert plan_tool.returncode == 0 and "tokens/s at 40% MFU" in plan_tool.stdout
    assert missing.returncode == 2 and "set model.vocab_size=N" in missing.stderr


def test_671b_config_counts_deepseek_v3s_parameters():
    """DeepSeek-V3 reports 671B parameters (without its 14B MTP module) and 37B activated per token."""
    cfg = load_config("671b_fp8")
    plan = make_plan(cfg, 2048)
    assert abs(plan.main_params - 671e9) <= 0.005 * 671e9, plan.main_params
    assert abs(plan.activated_per_token - 37e9) <= 0.02 * 37e9, plan.activated_per_token
    # MTP: one block, its projection and norms (the embedding and head are shared, so not counted again).
    assert 10e9 < plan.params["mtp"] < 14e9


def test_671b_run_on_one_machine_fails_fast_pointing_at_the_dry_run(tmp_path):
    from megafp8.train.plan import check_fits

    no_pipeline = ["parallel.pp=1", "parallel.pp_layout=null"]
    plan = make_plan(load_config("671b_fp8", ["parallel.ep=8", *no_pipeline]), 8)  # one 8-GPU node
    with pytest.raises(ConfigError, match=r"needs about .* GiB per GPU .*--dry-run"):
        check_fits(plan, capacity=141 * GIB)
    # At the paper's 2048 GPUs it needs the pipeline: without it ~219 GiB per GPU, with PP16 (DualPipeV) it fits.
    assert make_plan(load_config("671b_fp8", no_pipeline), 2048).total_bytes > 141 * GIB
    assert make_plan(load_config("671b_fp8"), 2048).total_bytes < 100 * GIB


def test_launching_671b_here_fails_fast_with_one_line(capsys):
    """On this machine the 671B config stops before reading data or allocating, pointing at the dry run."""
    from megafp8.train.main import main

    assert main(["--config", "671b_fp8", "parallel.ep=1", "parallel.pp=1", "parallel.pp_layout=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs about" in err[0] and "--dry-run" in err[0], err
    assert main(["--config", "671b_fp8"]) == 2  # its 16 pipeline stages need at least 16 ranks
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 rank(s) cannot be split into tp=1 x pp=16" in err[0], err


@pytest.mark.parametrize("name, params, activated", [("16b_moe_fp8", 15.7e9, None), ("1b_dense_fp8", 0.956e9, 0.956e9)])
def test_one_node_configs_fit_eight_h200s(name, params, activated):
    plan = make_plan(load_config(name), 8)
    assert abs(plan.main_params - params) <= 0.01 * params, plan.main_params
    if activated is not None:
        assert abs(plan.activated_per_token - activated) <= 0.01 * activated
    check_fits(plan, capacity=141 * GIB)  # one H200 each


def _memory_worker(rank, world, overrides, out_path):
    from megafp8.parallel import ParallelDims
    from megafp8.train.trainer import Trainer

    cfg = load_config("tiny_dense", overrides)
    memory = Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu")).optimizer.memory_bytes()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, memory)
    if rank == 0:
        torch.save(gathered, out_path)


EXPERTS = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=128",
           "model.moe.first_dense_layers=1"]


@pytest.mark.parametrize("layout", [["parallel.pp=2"], ["parallel.pp=2", "parallel.pp_schedule=zbv"],
                                    EXPERTS + ["parallel.ep=2"]], ids=["pp2", "pp2-zbv", "ep2"])
def test_planned_memory_is_what_the_busiest_pipeline_rank_allocates(tiny_overrides, tmp_path, layout):
    """The planner's weights, gradients, masters and moments per rank equal the live buffers of the pipeline rank it
    plans as the busiest (bytes counted from the optimizer's own tensors); each rank's own figures are in its row of
    the pipeline table. At EP=2 on two ranks the experts' gradients reduce over a group of one: no shard buffer."""
    from tests.distributed import spawn

    overrides = tiny_overrides + ["model.vocab_size=384", "model.num_layers=4"] + layout
    spawn(2, _memory_worker, overrides, tmp_path / "m.pt")
    live = torch.load(tmp_path / "m.pt")  # by rank: pipeline rank r is rank r here
    plan = make_plan(load_config("tiny_dense", overrides), 2)
    busiest = live[plan.busiest_rank]
    for key in ("weights", "grads", "master_weights", "optimizer_states"):
        assert plan.bytes_per_rank[key] == busiest[key], (key, plan.bytes_per_rank[key], busiest[key])
    if plan.pipeline:  # (a layout without pipelining has no pipeline table)
        assert plan.pipeline[plan.busiest_rank][4] == plan.total_bytes == max(row[4] for row in plan.pipeline)


def test_dry_run_lists_every_pipeline_rank():
    from megafp8.train.plan import dry_run

    text = dry_run(load_config("671b_fp8"), 2048, 989.4, 0.4)
    assert "| 0 | 0, 31 (embedding, head) | 1 |" in text  # the V layout: rank 0 holds the first and last stage
    assert "| 15 | 15, 16 | 4 |" in text and "memory of the busiest pipeline rank" in text


def test_dry_run_names_the_rope_scaling():
    from megafp8.train.plan import dry_run

    yarn = ["model.vocab_size=384", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
            "model.rope_scaling.original_max_position_embeddings=64", "model.rope_theta=50000"]
    assert "ffn 768, RoPE theta 50000, yarn x4 from 64 tokens, vocab 384" in dry_run(load_config("tiny_dense", yarn),
                                                                                    1, 100.0, 0.4)
    assert "RoPE theta 10000, vocab" in dry_run(load_config("tiny_dense", yarn[:1]), 1, 100.0, 0.4)


@pytest.mark.parametrize("config, keep", [("tiny_dense_fp8", True), ("tiny_moe_fp8", True),
                                          ("tiny_dense_fp8", False), ("tiny_moe_fp8", False)])
def test_planned_fp8_weight_copies_are_what_the_layers_keep(tiny_overrides, config, keep):
    """After a step, every dense FP8 layer holds its quantized weight and (unless `fp8_keep_weight_transpose` is
    false) its transposed copy, with block scales; every expert projection its quantized weight only: the plan's
    `fp8_weight_copies` is their size (BF16-kept layers hold none). Transposes made in backward are planned as the
    largest one's, of the experts and (when not kept) of the dense layers."""
    from megafp8.parallel import ParallelDims
    from megafp8.parallel.experts import ExpertLinear
    from megafp8.train.trainer import Trainer

    overrides = tiny_overrides + ["model.vocab_size=384", "training.steps=1", "optimizer.warmup_steps=1",
                                  "precision.fp8_backend=reference", f"precision.fp8_keep_weight_transpose={keep}"]
    cfg = load_config(config, overrides)
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    trainer.train_step()
    owners = [m for m in trainer.model.modules() if getattr(m, "fp8_cache", None) is not None]
    caches = [m.fp8_cache for m in owners]
    live = sum(t.numel() * t.element_size() for c in caches for t in c.entry.tensors() if t is not None)
    assert len(caches) >= 4 and live > 0
    planned = make_plan(cfg, 1).bytes_per_rank
    assert planned["fp8_weight_copies"] == live
    copies = {expert: [sum(t.numel() * t.element_size() for t in c.entry.tensors()[:2]) for c, m in zip(caches, owners)
                       if not c.keep_transpose and isinstance(m, ExpertLinear) == expert] for expert in (True, False)}
    assert (config == "tiny_moe_fp8") == bool(copies[True])
    assert keep != bool(copies[False])
    assert planned.get("fp8_expert_transpose_in_backward", 0) == max(copies[True], default=0)
    assert planned.get("fp8_dense_transpose_in_backward", 0) == max(copies[False], default=0)


def test_plan_tool_has_its_own_usage(capsys):
    from megafp8.train.main import plan_main

    with pytest.raises(SystemExit):
        plan_main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]  # the usage lines, before the description
    assert usage.startswith("usage: plan.py") and "--dry-run" not in usage and "--print-config" not in usage


@pytest.mark.parametrize("option, value, expected", [
    ("--world-size", "-2", "argument --world-size: -2 must be at least 1"),  # printed "all -2 GPU(s)" and negative
    ("--world-size", "0", "argument --world-size: 0 must be at least 1"),    # tokens/s; 0 was taken as 1
    ("--mfu", "5", "argument --mfu: 5 must be at most 1 (a fraction: 0.4 is 40%)"),
    ("--mfu", "-1", "argument --mfu: -1 must be a number above 0"),
    ("--peak-tflops", "-100", "argument --peak-tflops: -100 must be a number above 0"),
])
def test_the_dry_run_refuses_impossible_planning_figures(capsys, option, value, expected):
    from megafp8.train.main import main

    with pytest.raises(SystemExit) as exit:
        main(["--config", "tiny_dense", "--dry-run", option, value, "model.vocab_size=384"])
    assert exit.value.code == 2 and expected in capsys.readouterr().err


def test_dry_run_labels_tokens_per_second_as_the_clusters_total():
    text = make_plan(load_config("tiny_dense", ["model.vocab_size=384"]), 8).render(peak_tflops=1000, mfu=0.4)
    line = next(line for line in text.splitlines() if line.startswith("tokens/s"))
    total = make_plan(load_config("tiny_dense", ["model.vocab_size=384"]), 8).tokens_per_s(1000, 0.4)
    assert f"all 8 GPU(s) together: {total:,.0f} ({total / 8:,.0f} per GPU)" in line


@pytest.mark.parametrize("world_size", [8, 16, 512])
def test_too_few_ranks_for_671b_states_the_minimum(world_size):
    from megafp8.config.validate import validate_for_world

    with pytest.raises(ConfigError, match=r"launch a multiple of 1024 ranks \(at least 1024 = tp x pp x ep\)"):
        validate_for_world(load_config("671b_fp8"), world_size)


def test_the_pipeline_layout_is_built_once_and_passed_down(monkeypatch):
    """make_plan builds the layout once for every pipeline rank (or takes the caller's), and each rank's model is
    built from its stages: the same parameters as the whole model's, split."""
    import megafp8.train.plan as planning

    built = []
    monkeypatch.setattr(planning, "build_layout", lambda *args: built.append(args) or build_layout(*args))
    cfg = load_config("tiny_dense", ["model.vocab_size=384", "parallel.pp=2", "parallel.pp_schedule=zbv"])
    plan = make_plan(cfg, 2)
    assert len(built) == 1
    assert make_plan(cfg, 2, planning.pipeline_layout(cfg)).bytes_per_rank == plan.bytes_per_rank and len(built) == 2
    assert [row[1:3] for row in plan.pipeline] == [("0, 3 (embedding, head)", 2), ("1, 2", 2)]
    assert sum(row[3] for row in plan.pipeline) == plan.total_params


def test_each_pipeline_rank_holds_its_micro_batches_in_flight():
    """1F1B: the first rank holds pp micro-batches' activations, the last one (with the head's logits); never more
    than the step has. The dry run says what the activation lines count."""
    base = ["model.vocab_size=384", "model.num_layers=4", "parallel.pp=2", "training.micro_batch_size=4"]
    one, two = (make_plan(load_config("tiny_dense", base + [f"training.global_batch_size={4 * m}"]), 2)
                for m in (1, 2))
    (first_one, last_one), (first_two, last_two) = ([row[4] for row in plan.pipeline] for plan in (one, two))
    assert first_two > first_one and last_two == last_one
    assert two.busiest_rank == 0 and two.bytes_per_rank["logits_and_loss"] == 0  # the head is on rank 1
    assert "2 micro-batch(es) in flight" in two.render(100.0, 0.4)
