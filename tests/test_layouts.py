"""The layout search (`tools/plan.py --layouts`): every TP x PP x EP x DP layout checked as the launch checks it,
planned, and the one with the least model parallelism that fits recommended."""
from __future__ import annotations

import subprocess
import sys

import pytest
from megafp8.config import load_config
from megafp8.config.validate import validate_for_world
from megafp8.train import layouts
from megafp8.train.layouts import search_layouts
from megafp8.train.main import plan_main
from megafp8.train.preview import layouts_main
from megafp8.train.plan import GIB
from tests.conftest import REPO, torchrun_env

# Two heads of 128 (so TP=2 holds whole FP8 tiles, TP=4 would split a head).
WIDE = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128", "model.vocab_size=512"]


def _by_sizes(options):
    return {(o.tp, o.pp, o.ep): o for o in options}


def test_the_recommendation_is_the_least_model_parallelism_that_fits():
    cfg = load_config("tiny_dense", WIDE)
    roomy = search_layouts(cfg, 4, 80 * GIB)
    by = _by_sizes(roomy)
    assert set(by) == {(1, 1, 1), (2, 1, 1), (1, 2, 1), (4, 1, 1), (2, 2, 1), (1, 4, 1)}
    assert (roomy[0].tp, roomy[0].pp, roomy[0].dp) == (1, 1, 4) and roomy[0].fits  # plain data parallelism
    refused = by[4, 1, 1]  # the launch's own check, its message kept
    assert not refused.fits and refused.planned_gib is None and "num_heads" in refused.problem
    assert roomy[-1] is refused  # refused layouts last
    # A GPU between the DP and the TP=2 plans: DP no longer fits, TP=2 (no bubble) comes before PP=2.
    assert by[1, 1, 1].planned_gib > by[2, 1, 1].planned_gib
    gpu = (by[1, 1, 1].planned_gib + by[2, 1, 1].planned_gib) / 2 / 0.9 * GIB
    tight = search_layouts(cfg, 4, gpu)
    assert (tight[0].tp, tight[0].pp, tight[0].dp) == (2, 1, 2) and tight[0].planned_gib <= 0.9 * gpu / GIB
    assert "needs" in _by_sizes(tight)[1, 1, 1].problem
    fitting = [o for o in tight if o.fits]
    assert [o.cost() for o in fitting] == sorted(o.cost() for o in fitting)
    # The recommended overrides are a layout the launch accepts.
    validate_for_world(load_config("tiny_dense", WIDE + tight[0].overrides), 4)


def test_a_moe_model_is_also_offered_expert_parallelism():
    """Where its experts fit replicated, plain data parallelism is recommended before expert parallelism (on two
    H200s the MoE model's DP=2 ran 1.21x EP=2's throughput in FP8, 1.23x in BF16: docs/benchmarks.md, job R)."""
    cfg = load_config("tiny_moe_fp8", ["model.vocab_size=512"])
    options = search_layouts(cfg, 4, 80 * GIB)
    assert (options[0].tp, options[0].pp, options[0].ep, options[0].dp) == (1, 1, 1, 4) and options[0].fits
    by = _by_sizes(options)
    assert {ep for (tp, pp, ep) in by if (tp, pp) == (1, 1)} == {1, 2, 4}  # every divisor of dp = 4
    assert all(o.dp % o.ep == 0 for o in by.values())
    assert by[1, 1, 2].fits and by[1, 1, 2].planned_gib < by[1, 1, 1].planned_gib  # experts split over two ranks
    assert "parallel.ep=2" in by[1, 1, 2].overrides


def test_layouts_that_recomputation_under_cuda_graphs_cannot_run_are_not_offered():
    """Recomputed blocks under CUDA graphs need blocks that compile whole: the search keeps expert parallelism's
    layouts (the experts run eagerly inside the blocks) out of the fitting ones, each with the launch's reason."""
    graphed = ["training.compile=true", "training.compile_mode=reduce-overhead", "training.recompute=full"]
    by = _by_sizes(search_layouts(load_config("tiny_moe_fp8", ["model.vocab_size=512"] + graphed), 4, 80 * GIB))
    assert by[1, 1, 1].fits and {ep for (tp, pp, ep) in by if (tp, pp) == (1, 1)} == {1, 2, 4}
    for (tp, pp, ep), option in by.items():
        if ep > 1:
            assert not option.fits and "runs the experts eagerly inside them" in option.problem, option


def test_long_sequences_are_offered_context_parallelism_when_asked(capsys):
    """`--max-cp`: each layout also with context parallelism up to that size; at 8K tokens a sequence on a GPU too
    small for plain data parallelism, CP=2 (the same degree as TP=2, preferred) fits and is recommended, the
    table grows a cp column, and the overrides say parallel.cp=2. Without it no cp column, no CP layout."""
    long = WIDE + ["data.seq_len=8192", "training.micro_batch_size=1", "training.global_batch_size=4"]
    cfg = load_config("tiny_dense", long)
    options = search_layouts(cfg, 4, 80 * GIB, max_cp=4)
    by = {(o.tp, o.pp, o.ep, o.cp): o for o in options}
    assert {cp for (tp, pp, ep, cp) in by if (tp, pp) == (1, 1)} == {1, 2, 4}
    plain, halves = by[1, 1, 1, 1], by[1, 1, 1, 2]
    assert halves.planned_gib < plain.planned_gib
    gpu = (plain.planned_gib + halves.planned_gib) / 2 / 0.9 * GIB
    tight = search_layouts(cfg, 4, gpu, max_cp=4)
    assert (tight[0].tp, tight[0].pp, tight[0].cp) == (1, 1, 2), [(o.tp, o.pp, o.cp, o.fits) for o in tight]
    assert "parallel.cp=2" in tight[0].overrides
    validate_for_world(load_config("tiny_dense", long + tight[0].overrides), 4)
    args = ["--config", "tiny_dense", "--world-size", "4", "--layouts", *long, "--gpu-gib", f"{gpu / GIB}"]
    assert plan_main(args + ["--max-cp", "4"]) == 0
    out = capsys.readouterr().out
    assert "| | tp | pp | ep | cp | dp |" in out and "parallel.cp=2" in out
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "| cp |" not in out and "parallel.cp" not in out
    assert plan_main(args[:-1] + ["0.001"]) == 0
    assert "set training.recompute=full, try context parallelism (--max-cp 8), or use" in capsys.readouterr().out


def test_layouts_command_line(capsys):
    cmd = [sys.executable, "tools/plan.py", "--config", "tiny_dense", "--world-size", "4", "--layouts",
           "--gpu-gib", "80", *WIDE]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| recommended | 1 | 1 | 1 | 4 |" in result.stdout
    assert "recommended overrides: parallel.tp=1 parallel.sequence_parallel=false parallel.pp=1" in result.stdout
    args = ["--config", "tiny_dense", "--world-size", "4", "--layouts", *WIDE]
    assert plan_main(args + ["--gpu-gib", "0.001"]) == 0
    assert ("- 5 layouts: too large for the GPU, the leanest needs 0.0 GiB per GPU, more than 0.0 (90% of the GPU's "
            "0.0); to fit, raise the GPU count, lower training.micro_batch_size, set training.recompute=full, or use a "
            "smaller model") in capsys.readouterr().out  # optimizer.sharded is on already
    light = ["training.micro_batch_size=1", "training.recompute=full", "optimizer.sharded=false"]
    assert plan_main(args + light + ["--gpu-gib", "0.001"]) == 0
    assert "to fit, raise the GPU count, set optimizer.sharded=true, or use a smaller model" in \
        capsys.readouterr().out  # 671b_fp8.yaml on 8 GPUs was told to set what it sets already
    assert plan_main(args + light + ["optimizer.sharded=true", "training.recompute_layers=1", "--gpu-gib", "0.001"]) == 0
    assert ("to fit, raise the GPU count, raise training.recompute_layers (now 1; null recomputes every "
            "block), or use a smaller model") in capsys.readouterr().out
    assert plan_main(args + ["--max-tp", "0"]) == 2
    assert "--layouts needs --world-size, --max-tp and --max-cp above 0 (got 4, 0, 1)" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "1e400"])
def test_layouts_refuse_a_gpu_size_that_is_no_positive_finite_number(capsys, value):
    """--gpu-gib inf was taken: "layouts on 4 GPU(s) of inf GiB", every layout fitting."""
    with pytest.raises(SystemExit) as exit:
        plan_main(["--config", "tiny_dense", "--world-size", "4", "--layouts", "--gpu-gib", value, *WIDE])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"plan.py: error: argument --gpu-gib: {value} must be a "
                                                        "number above 0")


def test_when_no_layout_fits_the_reasons_are_given_not_memory(capsys, monkeypatch):
    """Every layout refused by the launch's checks (heads, the global batch) was summed up as "no layout fits: raise
    the GPU count, ... or use a smaller model", advice about memory where memory was not the matter. Each reason is
    given once with its count of layouts, the commonest first, and only so many of them."""
    args = ["--config", "tiny_dense", "--world-size", "12", "--layouts", "--gpu-gib", "80", "model.vocab_size=512",
            "model.num_layers=2", "training.global_batch_size=7", "training.micro_batch_size=1"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    header = "no layout fits, for these reasons (each layout's in the why not column):\n"
    assert header in out, out[-600:]
    table, summary = out.split(header)
    lines = summary.splitlines()
    assert [line.split(": ")[0] for line in lines] == ["- 2 layouts"] * 3 + ["- 1 layout"] * 3
    assert ("- 2 layouts: model.num_heads=4 is not divisible by parallel.tp=3: every tensor-parallel rank needs whole "
            "heads (change model.num_heads), or set parallel.tp to one that splits this model: 1") in lines
    why_not = {row.split(" | ")[-1].removesuffix(" |") for row in table.splitlines() if row.startswith("|  |")}
    assert {line.split(": ", 1)[1] for line in lines} == why_not and len(why_not) == 6
    assert "GPU count" not in summary and "smaller model" not in summary
    monkeypatch.setattr(layouts, "MAX_REASONS", 4)
    assert plan_main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "- and 2 more reasons, for 2 layouts"


@pytest.mark.parametrize("own", [["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
                                 ["parallel.pp=2", "parallel.pp_layout=E,t*2|t*2,L"],
                                 ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                  "parallel.pp_virtual_stages=2", "training.global_batch_size=16"]],
                         ids=["dp set", "pp_layout set", "interleaved"])
def test_every_fitting_layout_s_overrides_are_accepted_by_the_launch_on_top_of_the_config_s_own(own):
    """A layout is checked with the config's parallel.dp, pp_layout and pp_virtual_stages replaced, but its
    overrides did not say so: the launch, given the config with them, refused the recommended layout (parallel.dp=2
    at four data-parallel ranks, a two-stage pp_layout at pp=1, two virtual stages of four layers at pp=4)."""
    args = WIDE + ["model.num_layers=4"] + own
    options = [o for o in search_layouts(load_config("tiny_dense", args), 4, 80 * GIB) if o.fits]
    assert len(options) > 1
    for option in options:
        validate_for_world(load_config("tiny_dense", args + option.overrides), 4)


def test_a_vocabulary_read_from_the_data_is_padded_for_each_layout_s_tensor_parallel_size(monkeypatch):
    """model.vocab_size null is the data's tokenizer's, padded as the launch pads it for its TP: 400 ids are 512 at
    TP=1 and 768 at TP=3. The search padded it once, for the config's TP, and refused TP=3: "model.vocab_size=512 does
    not split evenly over parallel.tp=3: make it a multiple of 3, or null" (it was null, and the launch runs it)."""
    from types import SimpleNamespace

    from megafp8.train import plan

    monkeypatch.setattr(plan, "read_meta", lambda path: SimpleNamespace(vocab_size=400, tokenizer="tok.json"))
    three_heads = ["model.num_heads=3", "model.attention.num_kv_heads=3", "model.attention.head_dim=128",
                   "model.hidden_size=384", "model.ffn_hidden_size=384", "data.seq_len=192",
                   "training.global_batch_size=6", "training.micro_batch_size=1"]
    table = layouts_main(load_config("tiny_dense", three_heads), 3, 80, max_tp=8)  # `tools/plan.py --layouts`
    assert "| fits | 3 | 1 | 1 | 1 |" in table and "split evenly" not in table, table
    tp3 = _by_sizes(search_layouts(load_config("tiny_dense", three_heads), 3, 80 * GIB))[3, 1, 1]
    launched = load_config("tiny_dense", three_heads + tp3.overrides)
    validate_for_world(plan.with_vocab(launched), 3)
    assert plan.with_vocab(launched).model.vocab_size == 768
