"""Activation recomputation (`training.recompute: full`: the same numbers, less memory kept for backward) and per-block
`torch.compile` (`training.compile`: the FP8 linears traced, their weight caches prepared outside the graph)."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from megafp8.config import load_config
from megafp8.model import Transformer, apply_compile, apply_recompute, init_weights
from megafp8.parallel import ParallelDims
from megafp8.precision import PrecisionRecipe
from megafp8.train.plan import make_plan
from megafp8.train.trainer import Trainer
from tests.parity import EXACT_TOL, Tolerance

MOE = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
       "model.vocab_size=512", "model.moe.ffn_hidden_size=128", "model.moe.aux_loss_coeff=0.01"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo's cache of a function (eight entries) lasts the whole process, and the
    blocks' compiled functions are one code object for every model; earlier tests' models would fill it. And a shape
    seen second compiles a graph of its own, static as the first, not one with symbolic shapes: the tests that
    measure what a block keeps per token run two batch sizes, and the symbolic graph's shape reasoning (sympy) took
    most of their CPU time (this file 161-185 s -> 122 s on a 2-core machine); a training run's micro-batches are
    one shape."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


@pytest.mark.parametrize("config, extra", [("tiny_dense", []), ("tiny_moe_fp8", MOE)], ids=["dense", "moe"])
def test_recomputation_gives_the_same_losses_gradients_and_expert_loads(parity, config, extra):
    """FP32: recomputed blocks give bit-identical gradients and losses; the routers count each token once (the
    balance statistics and selection biases match)."""
    # 2 steps: the first step's gradients and both losses, the second after the routers' bias update
    base = extra + ["precision.recipe=fp32", "training.steps=2", "training.eval_interval=0"]
    plain, again = parity.check(base, ["training.recompute=full"], 1, EXACT_TOL, config)
    parity.check(base, ["training.recompute=full", "training.recompute_layers=1"], 1, EXACT_TOL, config)
    if config == "tiny_moe_fp8":
        for a, b in zip(plain.train, again.train):
            assert a["moe_load_cv"] == b["moe_load_cv"] and a["moe_bias_abs_max"] == b["moe_bias_abs_max"]
            assert b["moe_dropped_tokens"] == 0  # counted once: a double count would show as negative drops


def kept_for_backward(model, tokens=None) -> tuple[int, torch.Tensor]:
    """(bytes autograd keeps for backward during the forward of `model` on `tokens`, the loss); with `tokens` None,
    `model` is a function of nothing and its result is returned."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model() if tokens is None else model(tokens, tokens)
    return total, loss


def _saved_bytes(model, tokens) -> int:
    return kept_for_backward(model, tokens)[0]


def test_recomputation_keeps_far_less_for_backward(tiny_overrides):
    cfg = load_config("tiny_dense", tiny_overrides + ["model.num_layers=4", "model.vocab_size=512"]).model
    model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), 64)
    init_weights(model, cfg, 0)
    tokens = torch.randint(0, 512, (4, 64))
    kept = _saved_bytes(model, tokens)
    assert apply_recompute(model, "full") == 4
    kept_recomputing = _saved_bytes(model, tokens)
    assert kept_recomputing < 0.5 * kept, (kept, kept_recomputing)
    # the planner's estimate falls too
    base = ["model.size=1b", "model.vocab_size=32768", "data.seq_len=2048", "training.micro_batch_size=8"]
    plain = make_plan(load_config("tiny_dense", base), 8).bytes_per_rank["activations"]
    full = make_plan(load_config("tiny_dense", base + ["training.recompute=full"]), 8).bytes_per_rank["activations"]
    assert full < 0.3 * plain and math.isfinite(full)


def test_recompute_layers_recomputes_each_ranks_first_blocks_and_the_planner_counts_what_they_keep(tiny_overrides):
    """`training.recompute_layers`: the first N blocks in forward order recompute, the rest keep their activations.
    The activations autograd keeps (CUDA-like norms) fall by the same amount for each recomputed block, from none to full, and
    the planner's activations fall by that amount too (within 1%); N = every block plans as `recompute_layers: null`."""
    from tests.test_plan_activations import cuda_like_norms_here, saved_bytes

    batch, seq, layers = 2, 128, 4
    overrides = tiny_overrides + [f"model.num_layers={layers}", "model.vocab_size=512", f"data.seq_len={seq}",
                                  f"training.micro_batch_size={batch}"]
    cfg = load_config("tiny_dense", overrides).model
    model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), seq)
    init_weights(model, cfg, 0)
    tokens = torch.randint(0, 512, (batch, seq))
    measured, planned = [], []
    for n in range(layers + 1):
        assert apply_recompute(model, "full", n) == n if n else apply_recompute(model, "none") == 0
        assert [model.layers[str(i)].recompute for i in range(layers)] == [i < n for i in range(layers)]
        with cuda_like_norms_here():  # distinct activation storages, as the planner counts them
            measured.append(saved_bytes(model, lambda: model(tokens, tokens))[0])
        recompute = ["training.recompute=full", f"training.recompute_layers={n}"] if n else []
        planned.append(make_plan(load_config("tiny_dense", overrides + recompute), 1).bytes_per_rank["activations"])
    per_block = measured[0] - measured[1]
    assert per_block > 0.5 * measured[0] / layers, measured  # a recomputed block keeps its input only
    assert [measured[n] - measured[n + 1] for n in range(layers)] == [per_block] * layers, measured
    for n in range(1, layers):
        assert planned[n] - planned[n + 1] == pytest.approx(planned[0] - planned[1])
    assert planned[0] - planned[1] == pytest.approx(per_block, rel=0.01), (planned, measured)
    full = make_plan(load_config("tiny_dense", overrides + ["training.recompute=full"]), 1).bytes_per_rank
    assert planned[layers] == full["activations"]
    assert apply_recompute(model, "full") == layers and apply_recompute(model, "full", layers + 3) == layers


def test_recompute_layers_needs_full_recomputation_and_a_count_the_model_has(tiny_overrides):
    """One error each, naming what to change: recompute_layers without `recompute: full`, and a count outside 1 to the
    model's blocks (layers plus MTP blocks)."""
    from megafp8.config import ConfigError

    with pytest.raises(ConfigError, match=r"training.recompute_layers=2 picks which blocks recompute, and "
                                          r"training.recompute=none recomputes none: set training.recompute=full"):
        load_config("tiny_dense", tiny_overrides + ["training.recompute_layers=2"])
    for n in (0, 6):
        with pytest.raises(ConfigError, match=rf"training.recompute_layers={n}: give 1 to 5 \(the model's 4 layers "
                                              r"and 1 MTP blocks\), or null for every block"):
            load_config("tiny_dense", tiny_overrides + ["model.num_layers=4", "model.mtp_depth=1",
                                                        "training.recompute=full", f"training.recompute_layers={n}"])


def _one_block_model(tiny_overrides, recipe: str):
    """(the tiny dense model with one block in `recipe`, FP8 layers converted; its model config), sequences of 64."""
    from megafp8.model import Fp8Converter

    full = load_config("tiny_dense", tiny_overrides + ["model.num_layers=1", "model.vocab_size=512",
                                                       f"precision.recipe={recipe}"])
    cfg, recipe_ = full.model, PrecisionRecipe.from_config(full.precision)
    model = Transformer(cfg, recipe_, 64)
    init_weights(model, cfg, 0)
    Fp8Converter(full.precision, recipe_, cfg.num_layers).convert(model)
    return model, cfg


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_a_compiled_recomputed_block_keeps_only_its_input(tiny_overrides, recipe):
    """Compiled with recomputation, a block is one compiled function under checkpointing: what it keeps for backward
    per token is its input, as eager checkpointing keeps (measured as what doubling the batch adds: the parameters,
    FP8 weight caches and the RNG state the compiled checkpoint also references do not grow with it); its output and
    input gradient are eager's."""
    model, cfg = _one_block_model(tiny_overrides, recipe)
    block = model.layers[0]
    assert any(getattr(m, "runs_fp8", False) for m in block.modules()) == (recipe == "fp8")
    inputs = {batch: torch.randn(batch * 64, cfg.hidden_size, dtype=torch.bfloat16) for batch in (2, 4)}

    def run(batch: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        leaf = inputs[batch].clone().requires_grad_(True)
        kept, (out, _) = kept_for_backward(lambda: block(leaf, model.rope, batch, 64))
        out.float().square().mean().backward()
        return kept, out.detach(), leaf.grad

    def per_two_sequences() -> tuple[int, torch.Tensor, torch.Tensor]:
        (small, _, _), (large, out, grad) = run(2), run(4)
        return large - small, out, grad

    kept_eager, out_eager, grad_eager = per_two_sequences()
    apply_recompute(model, "full")
    kept_recomputed, _, grad_recomputed = per_two_sequences()
    apply_compile(model, backend="aot_eager", recompute_in_graph=True)
    assert model.layers[0].compiled_recomputation is not None
    kept_compiled, out_compiled, grad_compiled = per_two_sequences()
    input_bytes = inputs[2].numel() * inputs[2].element_size()
    assert kept_recomputed == kept_compiled == input_bytes < 0.1 * kept_eager, (kept_eager, kept_compiled)
    assert torch.equal(out_compiled, out_eager) and torch.equal(grad_compiled, grad_recomputed)


# (BF16 is slow-marked: FP8 exercises the same pass over autograd.Functions, custom ops inside; ~25 s each on the
# 2-core CPU machine)
@pytest.mark.parametrize("recipe", [pytest.param("bf16", marks=pytest.mark.slow), "fp8"])
def test_inductor_recomputes_the_linears_that_torch_2_11_leaves_unmarked(tiny_overrides, monkeypatch, recipe):
    """torch 2.11 traces the operations inside an `autograd.Function`'s forward (every linear's, routing its weight
    gradient into `main_grad`) without the checkpointed region's recompute marks, and Inductor's partitioner then
    saves the GEMMs' outputs (job HU: ~0.6 GiB a ~1B block on the GPU). torch 2.13 marks them; the marks are taken off
    here as 2.11 leaves them, before `RecomputeTheWholeForward` runs. Without the pass the block keeps more than its
    input; with it, its input only, and the same output and input gradient to BF16 rounding (Inductor on the CPU,
    caches off)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from megafp8.model import recompute_pass

    model, cfg = _one_block_model(tiny_overrides, recipe)
    for p in model.parameters():  # the linears add their weight gradients into main_grad: their autograd.Function
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    block = model.layers[0]
    inputs = {batch: torch.randn(batch * 64, cfg.hidden_size, dtype=torch.bfloat16) for batch in (2, 4)}
    apply_recompute(model, "full")
    marked = []
    original = recompute_pass.mark_the_forward_for_recomputation

    def as_torch_2_11(graph, fix: bool) -> int:
        for node in graph.nodes:  # what the linears' autograd.Functions (megafp8/precision) trace, unmarked
            frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', node.meta.get("stack_trace") or "")
            if any("megafp8/precision/" in file and function == "forward" for file, function in frames):
                node.meta.pop("recompute", None)
                node.meta.pop("ac_graph_id", None)
        marked.append(original(graph) if fix else 0)
        return marked[-1]

    def run(fix: bool):
        torch._dynamo.reset()
        monkeypatch.setattr(recompute_pass, "mark_the_forward_for_recomputation", lambda g: as_torch_2_11(g, fix))
        apply_compile(model, backend="inductor", recompute_in_graph=True)
        results = {}
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            for batch in (2, 4):
                leaf = inputs[batch].clone().requires_grad_(True)
                kept, (out, _) = kept_for_backward(lambda: block(leaf, model.rope, batch, 64))
                out.float().square().mean().backward()
                results[batch] = kept, out.detach(), leaf.grad
        return results[4][0] - results[2][0], results[4][1], results[4][2]

    kept_unmarked, out_unmarked, grad_unmarked = run(fix=False)
    kept_fixed, out_fixed, grad_fixed = run(fix=True)
    input_bytes = inputs[2].numel() * inputs[2].element_size()
    assert kept_unmarked > 2 * input_bytes and kept_fixed == input_bytes, (kept_unmarked, kept_fixed, input_bytes)
    assert any(marked), marked  # the pass put the marks back
    # (the two partitions give Inductor different kernels to fuse: the same numbers to BF16 rounding)
    torch.testing.assert_close(out_fixed, out_unmarked, rtol=2 ** -6, atol=2 ** -6)
    torch.testing.assert_close(grad_fixed, grad_unmarked, rtol=2 ** -6, atol=2 ** -6)


def test_compiled_recomputation_counts_each_token_once_and_changes_no_number(parity):
    """Compiled MoE blocks with recomputation: the routers count each token once (the forward graph's buffer update;
    the recomputation inside the compiled backward does not repeat it), and the losses, gradients and balance
    statistics are those of the same compiled run without recomputation (FP8 on the reference backend: compiled
    MoE blocks need BF16 operands for `torch._grouped_mm`, so no FP32 run)."""
    # 2 steps: the second runs the compiled graphs again after the routers' bias update from the first's counts
    base = MOE + ["training.steps=2", "training.eval_interval=0", "model.num_layers=2", "training.compile=true",
                  "logging.fp8_health_interval=0"]
    plain, again = parity.check(base, ["training.recompute=full", "training.recompute_compiled=in_graph"], 1,
                                EXACT_TOL, "tiny_moe_fp8")
    for a, b in zip(plain.train, again.train):
        assert a["moe_load_cv"] == b["moe_load_cv"] and a["moe_bias_abs_max"] == b["moe_bias_abs_max"]
        assert b["moe_dropped_tokens"] == 0  # counted once: a double count would show as negative drops


def test_recompute_under_cuda_graphs_needs_blocks_that_compile_whole(tiny_overrides):
    """Recomputed blocks under CUDA graphs are recomputed inside their compiled backward, which needs the block in one
    graph: layouts whose layers run eagerly inside the blocks (expert parallelism's experts, a zero-bubble
    schedule's deferred weight gradients) are refused in one line that says what to change, and so is asking for
    the recomputation around the compiled code (or choosing how to recompute where nothing compiled recomputes);
    without CUDA graphs, or without those layouts, the same settings load."""
    from megafp8.config import ConfigError

    graphed = ["training.compile=true", "training.compile_mode=reduce-overhead", "training.recompute=full"]
    refusals = {"parallel.ep=2": r"parallel.ep=2 runs the experts eagerly inside them",
                "parallel.pp=2 parallel.pp_schedule=dualpipev": r"parallel.pp_schedule=dualpipev defers weight "
                                                                 r"gradients, whose layers run eagerly inside them"}
    for layout, why in refusals.items():
        with pytest.raises(ConfigError, match=r"training.recompute=full under CUDA graphs \(training.compile_mode="
                                              rf"reduce-overhead\) needs blocks that compile into one graph, and {why}: "
                                              r"set training.compile_mode=default, or training.recompute=none"):
            load_config("tiny_moe_fp8", tiny_overrides + graphed + layout.split())
        load_config("tiny_moe_fp8", tiny_overrides + graphed[:1] + graphed[2:] + layout.split())  # no graphs
    for layout in ("parallel.pp=2", "parallel.pp=2 parallel.pp_schedule=1f1b", "parallel.tp=2"):
        load_config("tiny_moe_fp8", tiny_overrides + graphed + layout.split())
    for setting, missing in ((["training.recompute=full"], "training.compile=true"),
                             (["training.compile=true"], "training.recompute=full"),
                             ([], "training.compile=true and training.recompute=full")):
        with pytest.raises(ConfigError, match=rf"training.recompute_compiled=in_graph says how compiled blocks "
                                              rf"recompute, and this run has none: set {missing}, or drop "
                                              r"recompute_compiled"):
            load_config("tiny_dense", tiny_overrides + setting + ["training.recompute_compiled=in_graph"])
    with pytest.raises(ConfigError, match=r"training.recompute_compiled=around replays the compiled blocks inside "
                                          r"backward, which CUDA graphs \(training.compile_mode=reduce-overhead\) "
                                          r"cannot: the replay overwrites the other blocks' outputs. Set "
                                          r"training.recompute_compiled=auto, or training.compile_mode=default"):
        load_config("tiny_moe_fp8", tiny_overrides + graphed + ["training.recompute_compiled=around"])


def test_auto_recomputes_inside_the_compiled_graph_wherever_blocks_compile_whole(tiny_overrides):
    """`training.recompute_compiled: auto` resolves to the compiled backward with and without CUDA graphs, and to
    recomputing around the compiled code where layers run eagerly inside the blocks (expert parallelism, zero-bubble
    schedules: without CUDA graphs, which refuse those layouts); nothing compiled recomputes without both settings.
    The dry run's note counts each block's input either way (what the GPU measured since job HV)."""
    from megafp8.config.validate import recomputes_in_compiled_graph
    base = tiny_overrides + ["model.vocab_size=512", "training.compile=true", "training.recompute=full"]
    cases = {(): True, ("training.compile_mode=reduce-overhead",): True,
             ("training.compile_mode=max-autotune-no-cudagraphs",): True,
             ("training.recompute_compiled=around",): False, ("training.recompute=none",): False,
             ("training.compile=false",): False, ("parallel.ep=2",): False,
             ("parallel.pp=2", "parallel.pp_schedule=zbv"): False, ("parallel.pp=2",): True}
    for extra, in_graph in cases.items():
        cfg = load_config("tiny_moe_fp8" if "parallel.ep=2" in extra else "tiny_dense", base + list(extra))
        assert recomputes_in_compiled_graph(cfg) == in_graph, extra
    note = make_plan(load_config("tiny_dense", base), 1).activations_note
    assert "each block's input (recomputed in backward)" in note and "more" not in note, note


def test_a_block_that_breaks_its_graph_recomputes_around_its_compiled_code(tiny_overrides):
    """A compiled block whose code breaks its graph under checkpointing (here: its attention made eager) cannot be
    traced whole: it recomputes by checkpointing around its compiled code, as eager code does (the same losses as
    the eager run's recomputation), and says nothing; under CUDA graphs the same block is refused in one line."""
    from megafp8.config import ConfigError

    cfg = load_config("tiny_dense", tiny_overrides + ["model.num_layers=1", "model.vocab_size=512"]).model
    x = torch.randn(2 * 64, cfg.hidden_size, dtype=torch.bfloat16)

    def block_breaking_its_graph(compiled: bool):
        model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), 64)
        init_weights(model, cfg, 0)
        model.layers[0].attn.forward = torch.compiler.disable(model.layers[0].attn.forward)
        apply_recompute(model, "full")
        if compiled:
            apply_compile(model, backend="aot_eager", recompute_in_graph=True)
        return model.layers[0], model.rope

    def grad(block, rope) -> torch.Tensor:
        leaf = x.clone().requires_grad_(True)
        block(leaf, rope, 2, 64)[0].float().square().mean().backward()
        return leaf.grad

    eager = grad(*block_breaking_its_graph(compiled=False))
    block, rope = block_breaking_its_graph(compiled=True)
    assert block.compiled_recomputation is not None
    assert torch.equal(grad(block, rope), eager) and block.compiled_recomputation is None  # fell back for good
    assert torch.equal(grad(block, rope), eager)
    block, rope = block_breaking_its_graph(compiled=True)
    block.under_cuda_graphs = True
    with pytest.raises(ConfigError, match=r"training.recompute under CUDA graphs .* needs blocks that compile into "
                                          r"one graph, and this block cannot be traced whole \(.*\): set "
                                          r"training.compile_mode=default, or training.recompute=none"):
        grad(block, rope)


@pytest.mark.parametrize("config, recipe", [("tiny_dense", "bf16"), ("tiny_dense", "fp8"), ("tiny_moe_fp8", "fp8")])
def test_compiled_blocks_train_like_eager_blocks(parity, config, recipe):
    """training.compile: the blocks run through torch.compile (FP8 linears as custom ops inside; a MoE block whole,
    its experts' grouped GEMMs included) and, with recomputation too, track the eager run's losses (fused
    elementwise kernels round BF16 differently)."""
    base = [f"precision.recipe={recipe}", "training.steps=3", "training.eval_interval=0"]
    if config == "tiny_moe_fp8":
        base += ["model.num_layers=2", "optimizer.warmup_steps=1", "logging.fp8_health_interval=0"]
    parity.check(base, ["training.compile=true", "training.recompute=full"], 1, Tolerance(loss=5e-3), config)


def test_a_dense_fp8_block_compiles_into_one_graph(tiny_overrides):
    """No graph break in a dense FP8 block: its four FP8 linears are custom ops inside the compiled graph (a graph
    break per linear would split the block into pieces, each with its own guards and wrappers on the host)."""
    trainer = Trainer(load_config("tiny_dense", tiny_overrides + ["precision.recipe=fp8", "training.steps=1",
                                                                  "optimizer.warmup_steps=1"]),
                      ParallelDims.single(), torch.device("cpu"))
    model, cfg = trainer.model, trainer.cfg
    block = model.layers[0]
    batch, seq = cfg.training.micro_batch_size, cfg.data.seq_len
    x = torch.randn(batch * seq, trainer.model_cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    assert sum(m.runs_fp8 for m in block.modules() if hasattr(m, "runs_fp8")) >= 3
    explained = torch._dynamo.explain(block._forward)(x, model.rope, batch, seq)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_compile_mode_reaches_torch_compile(tiny_overrides, monkeypatch):
    """`training.compile_mode` is the mode every block is compiled with (`default` passes none), by Inductor, its
    recomputed form too. With `training.compile_comm_overlap` the mode's options are spelled out (torch.compile takes
    a mode or options, not both) with Inductor's comm/compute reordering added."""
    calls = []

    def recording_compile(fn, mode=None, options=None, backend="inductor", fullgraph=False):
        calls.append((mode, options) if backend == "inductor" else backend)
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    overlap = {"reorder_for_compute_comm_overlap": True}
    for mode, comm_overlap, (want_mode, want_options) in (
            ("default", False, (None, None)), ("reduce-overhead", False, ("reduce-overhead", None)),
            ("default", True, (None, overlap)), ("reduce-overhead", True, (None, {"triton.cudagraphs": True, **overlap}))):
        calls.clear()
        Trainer(load_config("tiny_dense", tiny_overrides + ["training.compile=true", f"training.compile_mode={mode}",
                                                            f"training.compile_comm_overlap={comm_overlap}"]),
                ParallelDims.single(), torch.device("cpu"))
        assert calls and all(m == want_mode for m, _ in calls), (mode, calls)
        for _, options in calls:
            if want_options is None:
                assert options is None
            else:  # the reordering passes: those this torch has
                assert {k: options[k] for k in want_options} == want_options, options
                assert options["reorder_for_compute_comm_overlap_passes"], options


def _fail_on_recompile_limit():
    """Make Dynamo raise at its recompile limit instead of silently falling back to eager. Through Dynamo's own
    config.patch: pytest >= 9.2's monkeypatch restores this config attribute by deleting it, which hides it from every
    later test."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def test_fp8_health_sampling_never_breaks_the_compiled_blocks(tiny_overrides):
    """Sampled steps run the blocks uncompiled, so the FP8 health hooks never enter a graph. (Traced, each layer's
    hook was compiled anew, and 16 FP8 linears passed torch._dynamo's limit of 8 recompiles; made eager but traced
    around, they broke every block's graph at step 0, and torch.compile kept those broken graphs for every later step:
    the cause of the slower compiled FP8 step at commit 0800a78.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(load_config("tiny_dense", tiny_overrides + [
        "precision.recipe=fp8", "training.compile=true", "model.num_layers=4", "logging.fp8_health_interval=2",
        "training.steps=4", "training.eval_interval=0"]), ParallelDims.single(), torch.device("cpu"))
    with _fail_on_recompile_limit():
        trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    sampled = [r for r in records if r["kind"] == "fp8_health"]
    assert [r["step"] for r in sampled] == [1, 3]
    fp8_layers = {n for n, m in trainer.model.named_modules() if getattr(m, "runs_fp8", False)}
    assert len(fp8_layers) > torch._dynamo.config.recompile_limit
    assert set(sampled[-1]["layers"]) == fp8_layers
    assert all(set(kinds) == {"input", "weight", "grad"} for kinds in sampled[-1]["layers"].values())
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


def test_compiled_blocks_quantize_each_weight_once_per_version_outside_the_graph(tiny_overrides):
    """Compiled blocks prepare their FP8 weight caches eagerly and their shared graph reads each block's own: no
    weight quantization in the graph, once per weight version over any number of micro-batches, and after an
    in-place update (an optimizer step) the new weight in forward and backward, bit for bit as eager FP8 with
    freshly quantized weights."""
    cfg = load_config("tiny_dense", tiny_overrides + ["model.num_layers=2", "model.vocab_size=512"]).model
    model = Transformer(cfg, PrecisionRecipe.from_name("fp8"), 64)
    init_weights(model, cfg, 0)
    batch, seq = 2, 64
    x = torch.randn(batch * seq, cfg.hidden_size, dtype=torch.bfloat16)
    blocks = [model.layers[i] for i in range(2)]
    torch._dynamo.reset()
    assert apply_compile(model, backend="aot_eager") == 2  # exact bits
    eager_forwards = [block.uncompiled_forward for block in blocks]
    fp8 = [[m for m in block.prepared_linears if m.runs_fp8] for block in blocks]
    assert [len(layers) for layers in fp8] == [4, 4]

    def run(block, forward):
        """Output, input gradient and weight gradients of one forward and backward."""
        xi = x.clone().requires_grad_()
        for p in block.parameters():
            p.grad = None
        out = forward(xi, model.rope, batch, seq)[0]
        out.float().square().mean().backward()
        return [out, xi.grad] + [p.grad for p in block.parameters()]

    def eager_fresh(i):
        """Block i run eagerly on freshly quantized weights."""
        for layer in fp8[i]:
            layer.fp8_cache.clear()
        return run(blocks[i], eager_forwards[i])

    for _ in range(3):  # micro-batches of one step
        compiled = [run(block, block) for block in blocks]
    assert [m.fp8_cache.quantize_count for layers in fp8 for m in layers] == [1] * 8
    explained = torch._dynamo.explain(blocks[1].uncompiled_forward)(x, model.rope, batch, seq)
    assert explained.graph_break_count == 0
    graph_code = "\n".join(g.print_readable(print_output=False) for g in explained.graphs)  # subgraphs included
    assert "megafp8.gemm_1x128_128x128" in graph_code and "megafp8.quantize_weight" not in graph_code
    assert len(re.findall(r"\bL_\w+_fp8_cache_entry_w_fp8: ", graph_code)) == 4  # the graph's inputs
    for i in range(2):
        assert all(torch.equal(a, b) for a, b in zip(compiled[i], eager_fresh(i))), f"block {i}"
    before = [m.fp8_cache.quantize_count for layers in fp8 for m in layers]
    with torch.no_grad():  # an optimizer step writes the weights in place
        for layer in fp8[0] + fp8[1]:
            layer.weight.mul_(-1.0)
    updated = [run(block, block) for block in blocks]
    assert [m.fp8_cache.quantize_count for layers in fp8 for m in layers] == [n + 1 for n in before]
    for i in range(2):
        assert not torch.equal(updated[i][0], compiled[i][0])
        assert all(torch.equal(a, b) for a, b in zip(updated[i], eager_fresh(i))), f"block {i} after the update"


def test_compiled_blocks_prepare_layers_that_switch_to_fp8_later(tiny_overrides):
    """`precision.fp8_start_step`: the blocks compile while every linear is BF16; after the switch each FP8 weight
    is still quantized once per step, outside the graph."""
    torch._dynamo.reset()
    trainer = Trainer(load_config("tiny_dense", tiny_overrides + [
        "precision.recipe=fp8", "precision.fp8_start_step=1", "training.compile=true", "training.steps=3",
        "training.eval_interval=0", "logging.fp8_health_interval=0"]), ParallelDims.single(), torch.device("cpu"))
    trainer.fit()
    caches = [m.fp8_cache for m in trainer.model.modules() if getattr(m, "runs_fp8", False)]
    assert caches and all(c.prepared and c.quantize_count == 2 for c in caches)


@pytest.mark.parametrize("recompute_compiled", ["around", "in_graph"])
def test_every_compiled_fp8_block_runs_one_shared_graph_across_steps(tiny_overrides, recompute_compiled):
    """Nine compiled FP8 blocks, each reading its own weight caches, over steps that re-quantize every weight: one
    Dynamo graph for all of them and no recompilation (guards on each cache's address would need one graph per
    block and pass the limit of 8). The first four recompute (`training.recompute_layers`): around the compiled
    code they share its graph; in the compiled backward they share one more function, their forward under
    checkpointing."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(load_config("tiny_dense", tiny_overrides + [
        "precision.recipe=fp8", "training.compile=true", "model.num_layers=9", "training.steps=3",
        "training.eval_interval=0", "logging.fp8_health_interval=0", "training.recompute=full",
        "training.recompute_layers=4", f"training.recompute_compiled={recompute_compiled}"]),
        ParallelDims.single(), torch.device("cpu"))
    assert len(trainer.model.layers) > torch._dynamo.config.recompile_limit
    assert [block.recompute for block in trainer.model.layers.values()] == [True] * 4 + [False] * 5
    in_graph = recompute_compiled == "in_graph"
    with _fail_on_recompile_limit():
        trainer.fit()
    assert counters["stats"]["unique_graphs"] == 1 + in_graph
    assert all((block.compiled_recomputation is not None) == in_graph for block in trainer.model.layers.values())
    assert all(m.fp8_cache.quantize_count == 3 for m in trainer.model.modules() if getattr(m, "runs_fp8", False))


def test_blocks_know_when_their_compile_mode_uses_cuda_graphs(tiny_overrides, monkeypatch):
    """Every mode whose Inductor options turn CUDA graphs on (`reduce-overhead`, `max-autotune`) marks the compiled
    blocks, which then copy their outputs out of the graph pool in evaluation (`Block._outside_the_graph_pool`; the
    copy itself runs on CUDA only: `tests/test_fp8_gpu.py` evaluates under CUDA graphs), and makes `auto`
    recompute them inside their compiled backward."""
    from megafp8.model.transformer import Block, uses_cuda_graphs

    assert [uses_cuda_graphs(m) for m in ("default", "reduce-overhead", "max-autotune",
                                           "max-autotune-no-cudagraphs")] == [False, True, True, False]
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    for mode, graphs in (("default", False), ("reduce-overhead", True), ("max-autotune", True)):
        trainer = Trainer(load_config("tiny_dense", tiny_overrides + ["training.compile=true",
                                                                      f"training.compile_mode={mode}"]),
                          ParallelDims.single(), torch.device("cpu"))
        blocks = [m for m in trainer.model.modules() if isinstance(m, Block)]
        assert blocks and all(b.under_cuda_graphs == graphs for b in blocks), mode
        # `training.recompute_compiled`: `auto` recomputes inside the compiled backward here
        for how in ("auto", "in_graph") + (("around",) if not graphs else ()):
            trainer = Trainer(load_config("tiny_dense", tiny_overrides + [
                "training.compile=true", f"training.compile_mode={mode}", "training.recompute=full",
                f"training.recompute_compiled={how}"]), ParallelDims.single(), torch.device("cpu"))
            in_graph = how != "around"
            assert all((b.compiled_recomputation is not None) == in_graph for b in trainer.model.layers.values())


def test_compiled_blocks_key_torchs_caches_to_megafp8s_sources(tiny_overrides, monkeypatch, tmp_path):
    """Every compiled block (and compiled recomputation) compiles with a hash of megafp8's sources in torch's cache
    key tag, after the user's own tag: another tree's or version's cached code is never served (job HW). The hash
    follows every source file's path and contents."""
    from pathlib import Path
    from megafp8.model import compile_cache

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: lambda *a, **k: (
        seen.append(torch.compiler.config.cache_key_tag), fn(*a, **k))[1])
    cfg = load_config("tiny_dense", tiny_overrides + ["model.num_layers=2", "model.vocab_size=512"]).model
    model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), 64)
    init_weights(model, cfg, 0)
    apply_recompute(model, "full")
    with torch.compiler.config.patch(cache_key_tag="mine"):  # (a config patch: monkeypatch's undo deletes it)
        apply_compile(model, backend="aot_eager")
        tokens = torch.randint(0, 512, (2, 64))
        model(tokens, tokens)
        assert torch.compiler.config.cache_key_tag == "mine"  # only while compiled code runs
    fingerprint = compile_cache.code_fingerprint()
    assert len(seen) == 2 and set(seen) == {f"mine|megafp8:{fingerprint}"}, seen
    assert fingerprint == compile_cache.source_fingerprint(Path(compile_cache.__file__).resolve().parent.parent)

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("y = 2\n")
    first = compile_cache.source_fingerprint(tmp_path / "pkg")
    assert compile_cache.source_fingerprint(tmp_path / "pkg") == first
    (tmp_path / "pkg" / "b.py").write_text("y = 3\n")
    changed = compile_cache.source_fingerprint(tmp_path / "pkg")
    (tmp_path / "pkg" / "b.py").rename(tmp_path / "pkg" / "c.py")
    assert len({first, changed, compile_cache.source_fingerprint(tmp_path / "pkg")}) == 3
