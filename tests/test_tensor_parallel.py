"""Tensor and sequence parallelism on gloo ranks: every parallel layer against its unsharded self.

Tolerances. FP8 layers quantize bit-identically at any TP (checked exactly below), so TP and
TP=1 differ only where partial sums are rounded to BF16 before they are added across ranks
(row-parallel outputs, column-parallel input gradients) and in summation order. FP32 layers
must agree to 1e-5 of the reference's largest magnitude (this pins the sharding logic); BF16 and
FP8 layers to 2^-6 of it (2 to 4 BF16 ulps at that magnitude; we see 1, and exact weight
gradients). The FP32 loss: 1e-5 relative. Whole-model training over 5 steps: 0.5% on the loss,
3% on the gradient norm.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megafp8.checkpoint import find_latest, load_checkpoint
from megafp8.config import load_config
from megafp8.parallel import (
    ColumnParallelLinear,
    ParallelDims,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    rank_groups,
    shard_of,
    tp_shard_of,
    vocab_parallel_cross_entropy,
)
from megafp8.precision import Fp8Backend, PrecisionRecipe
from megafp8.train.main import main
from megafp8.train.trainer import Trainer
from tests.conftest import one_per_key
from tests.distributed import spawn
from tests.parity import FP32_TOL, LOW_PRECISION_TOL, assert_close, grad_pairs

N_TOKENS = 96  # not a multiple of 128: FP8 wgrad pads tokens
IN, PARTS, OUT = 256, (512, 512), 256  # column: 256 -> [512; 512] (fused, like gate/up); row: 512 -> 256


class RecordingBackend(Fp8Backend):
    """The reference backend, remembering every GEMM's operands (to check quantization bit for bit)."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def gemm_1x128_128x128(self, a, a_scale, b, b_scale, out_dtype):
        self.calls.append((a, a_scale, b, b_scale))
        return super().gemm_1x128_128x128(a, a_scale, b, b_scale, out_dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def _mlp_pair(recipe: PrecisionRecipe, tp: TensorParallel) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    """A column then a row layer with seeded full weights, this rank's shards loaded; under FP8 each records its
    GEMMs' operands (`RecordingBackend`)."""
    fp8 = recipe.fp8 is not None
    col = ColumnParallelLinear(IN, sum(PARTS), recipe, tp, parts=PARTS, fp8_backend=RecordingBackend() if fp8 else None)
    row = RowParallelLinear(sum(PARTS) // 2, OUT, recipe, tp, fp8_backend=RecordingBackend() if fp8 else None)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer, shape in ((col, (sum(PARTS), IN)), (row, (OUT, sum(PARTS) // 2))):
            full = torch.randn(shape, generator=g) * 0.05
            layer.weight.copy_(shard_of(full, tp_shard_of(layer.weight), tp.rank, tp.size))
    return col, row


def _run_mlp(col, row, x, dy):
    """silu(gate) * up through the pair, backward from the fixed output gradient dy; returns (output, input grad).
    (A fixed dy keeps FP8 gradient quantization identical too: a loss of y would feed BF16 rounding differences
    of y into dy, and one flipped FP8 rounding moves a value by 6%.)"""
    x = x.clone().requires_grad_(True)
    gate, up = col(x).chunk(2, dim=-1)
    y = row(torch.nn.functional.silu(gate) * up)
    y.backward(dy)
    return y, x.grad


def _layers_worker(rank, world, recipe_name, sp):
    tp = TensorParallel(dist.group.WORLD, world, rank, sp)
    recipe = PrecisionRecipe.from_name(recipe_name)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(N_TOKENS, IN, generator=g).to(recipe.param_dtype)
    dy_full = torch.randn(N_TOKENS, OUT, generator=g).to(recipe.param_dtype)
    ref_col, ref_row = _mlp_pair(recipe, TensorParallel.single())
    par_col, par_row = _mlp_pair(recipe, tp)
    y_ref, dx_ref = _run_mlp(ref_col, ref_row, x_full, dy_full)
    mine = (lambda t: t.chunk(world)[rank]) if sp else (lambda t: t)  # this rank's tokens under SP
    y, dx = _run_mlp(par_col, par_row, mine(x_full), mine(dy_full))
    frac = 1e-5 if recipe_name == "fp32" else 2**-6
    assert_close(y, mine(y_ref), "output", frac)
    assert_close(dx, mine(dx_ref), "input gradient", frac)
    for name, grad, expected in grad_pairs(nn.ModuleList([par_col, par_row]), nn.ModuleList([ref_col, ref_row]), tp):
        assert_close(grad, expected, f"{name} gradient", frac)
    if recipe.fp8 is None:
        return
    # Bit-identical quantization: the fprop GEMM operands of each TP shard are slices of TP=1's.
    a, a_scale, w, w_scale = ref_col.fp8_backend.calls[0]
    pa, pa_scale, pw, pw_scale = par_col.fp8_backend.calls[0]
    assert _same_bits(pa, a) and _same_bits(pa_scale.contiguous(), a_scale.contiguous())  # the (gathered) input
    assert _same_bits(pw, shard_of(w, tp_shard_of(par_col.weight), rank, world))
    assert _same_bits(pw_scale, shard_of(w_scale, tp_shard_of(par_col.weight).__class__(0, tuple(
        p // 128 for p in PARTS)), rank, world))
    a, a_scale, w, w_scale = ref_row.fp8_backend.calls[0]
    pa, pa_scale, pw, pw_scale = par_row.fp8_backend.calls[0]
    k = a.shape[1] // world
    assert _same_bits(pa, a[:, rank * k:(rank + 1) * k].contiguous())
    assert _same_bits(pa_scale, a_scale[:, rank * k // 128:(rank + 1) * k // 128].contiguous())
    assert _same_bits(pw, w[:, rank * k:(rank + 1) * k].contiguous())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_parallel_linears_match_their_unsharded_selves(world, recipe, sp):
    spawn(world, _layers_worker, recipe, sp)


def _compiled_layers_worker(rank, world):
    """Compiled with Inductor, the FP8 column + row pair (two linears, and the fused SwiGLU MLP), with and without
    sequence parallelism, keeps its collectives in its graph: no graph break, and the bits of the same layers run
    eagerly."""
    for sp in (False, True):
        _compiled_layers_match_eager(rank, world, sp)


def _compiled_layers_match_eager(rank, world, sp):
    from torch._dynamo.utils import counters
    from megafp8.parallel import swiglu_mlp

    tp = TensorParallel(dist.group.WORLD, world, rank, sp)
    col, row = _mlp_pair(PrecisionRecipe.from_name("fp8"), tp)
    g = torch.Generator().manual_seed(1)
    tokens = 256  # under SP 128 per rank: the input is quantized before its gather, which moves FP8 bytes
    x_full = torch.randn(tokens, IN, generator=g).to(torch.bfloat16)
    dy_full = torch.randn(tokens, OUT, generator=g).to(torch.bfloat16)
    mine = (lambda t: t.chunk(world)[rank]) if sp else (lambda t: t)

    def run(fn):
        col.weight.grad = row.weight.grad = None
        x = mine(x_full).clone().requires_grad_(True)
        y = fn(x)
        y.backward(mine(dy_full))
        return y, x.grad, col.weight.grad, row.weight.grad

    def linears(x):
        return row(col(x).chunk(2, dim=-1)[0])  # no element-wise op between: Inductor would round it its own way

    def fused(x):
        return swiglu_mlp(x, col, row)
    for name, fn in (("linears", linears), ("fused MLP", fused)):
        eager = run(fn)
        torch._dynamo.reset()
        counters.clear()
        compiled = run(torch.compile(fn))
        assert not counters["graph_break"], (name, sp, dict(counters["graph_break"]))
        for what, a, b in zip(("y", "dx", "d col", "d row"), eager, compiled):
            assert torch.equal(a, b), f"{name}, sp={sp}: {what} differs compiled"


def test_compiled_fp8_parallel_layers_keep_their_collectives_in_the_graph():
    spawn(2, _compiled_layers_worker)


def _embedding_loss_worker(rank, world, sp):
    tp = TensorParallel(dist.group.WORLD, world, rank, sp)
    vocab, dim = 512, 64
    g = torch.Generator().manual_seed(2)
    table = torch.randn(vocab, dim, generator=g)
    head = torch.randn(vocab, dim, generator=g) * 0.1
    tokens = torch.randint(0, vocab, (4, 24), generator=g)
    targets = torch.randint(0, vocab, (4, 24), generator=g)

    def run(tp):
        """The embedding and LM head with this rank's shards of the seeded tables, after backward; the loss."""
        emb = VocabParallelEmbedding(vocab, dim, torch.float32, tp)
        lm = ColumnParallelLinear(dim, vocab, PrecisionRecipe.from_name("fp32"), tp)
        with torch.no_grad():
            emb.weight.copy_(shard_of(table, tp_shard_of(emb.weight), tp.rank, tp.size))
            lm.weight.copy_(shard_of(head, tp_shard_of(lm.weight), tp.rank, tp.size))
        loss = vocab_parallel_cross_entropy(lm(torch.tanh(emb(tokens))), targets, tp)
        loss.backward()
        return nn.ModuleDict({"embedding": emb, "lm_head": lm}), loss

    ref, loss_ref = run(TensorParallel.single())
    par, loss = run(tp)
    assert math.isclose(loss.item(), loss_ref.item(), rel_tol=1e-5)
    for name, grad, expected in grad_pairs(par, ref, tp):  # both sharded by vocabulary rows
        assert_close(grad, expected, f"{name} gradient", 1e-4)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_vocab_parallel_embedding_and_loss_match_unsharded(world, sp):
    spawn(world, _embedding_loss_worker, sp)


def _bytes_worker(rank, world, out_path):
    tp = TensorParallel(dist.group.WORLD, world, rank, True)
    moved: list[int] = []
    import megafp8.parallel.collectives as collectives

    original = collectives.all_gather_flat

    def counting(output, inp, *args, **kwargs):
        moved.append(inp.numel() * inp.element_size())
        return original(output, inp, *args, **kwargs)

    collectives.all_gather_flat = counting
    try:
        sizes = {}
        x = torch.randn(128, 512).bfloat16()
        for name in ("bf16", "fp8"):
            layer = ColumnParallelLinear(512, 256, PrecisionRecipe.from_name(name), tp)
            torch.nn.init.normal_(layer.weight, std=0.02)
            for training in (False, True):
                moved.clear()
                with torch.set_grad_enabled(training):
                    layer(x)
                sizes[name, training] = sum(moved)
    finally:
        collectives.all_gather_flat = original
    if rank == 0:
        torch.save(sizes, out_path)


def test_sequence_parallel_gather_moves_fp8_bytes(tmp_path):
    spawn(2, _bytes_worker, tmp_path / "bytes.pt")
    sizes = torch.load(tmp_path / "bytes.pt")
    # FP8: 1 byte per element + one FP32 scale per 128 elements = 0.516x BF16's 2 bytes. Training gathers the input
    # quantized along its features (forward GEMM) and along its tokens (weight gradient), each from the BF16
    # original: 2 x 0.516x; evaluation only the first.
    assert sizes["bf16", False] == sizes["bf16", True] == 128 * 512 * 2
    assert sizes["fp8", False] / sizes["bf16", False] == (1 + 4 / 128) / 2
    assert sizes["fp8", True] == 2 * sizes["fp8", False]


# -------------------------------------------------------------------------------- whole model

TP_MODEL = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
            "model.vocab_size=512", "training.steps=5", "training.eval_interval=0", "optimizer.grad_clip=1.0"]


LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
           "tp2_sp_dp2_sharded": ["parallel.tp=2", "parallel.sequence_parallel=true", "optimizer.sharded=true"]}


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_tp2_training_matches_tp1(parity, recipe, layout):
    parity.check(TP_MODEL + [f"precision.recipe={recipe}"], LAYOUTS[layout], 2, LOW_PRECISION_TOL)


def test_compiled_fp8_tp2_sp_training_matches_tp1(parity):
    """Compiled, the FP8 layers of a TP=2 + SP model run with their collectives in the graph (the layer test above
    checks there is no graph break) and train as the eager TP=1 run does. (`training.compile_comm_overlap`, which
    lets Inductor move the collectives' waits, is checked to reach torch.compile in tests/test_recompute.py.)"""
    parity.check(TP_MODEL + ["precision.recipe=fp8"], LAYOUTS["tp2_sp"] + ["training.compile=true"], 2,
                 LOW_PRECISION_TOL)


def test_fp8_tp2_sp_with_x_in_blocks_for_wgrad_matches_tp1(parity):
    """`precision.fp8_wgrad_input_blocks`: under sequence parallelism each rank quantizes its own token shard (whole
    128-token blocks) and the FP8 x^T is gathered with its block scales; row-parallel layers split x's features at
    128-feature block boundaries. So TP=2 + SP trains as TP=1 does with the same switch."""
    parity.check(TP_MODEL + ["precision.recipe=fp8", "precision.fp8_wgrad_input_blocks=true"], LAYOUTS["tp2_sp"], 2,
                 LOW_PRECISION_TOL)


def test_tp2_with_mla_and_mtp_matches_tp1(parity):
    """MLA attention and one MTP depth (shared embedding and vocab-parallel head, ignored targets) at TP=2 + SP."""
    mla = ["model.attention.kind=mla", "model.attention.q_lora_rank=128", "model.attention.kv_lora_rank=128",
           "model.attention.qk_nope_head_dim=64", "model.attention.qk_rope_head_dim=64",
           "model.attention.v_head_dim=64", "model.num_heads=4", "model.mtp_depth=1"]
    parity.check(TP_MODEL + mla + ["precision.recipe=bf16"], LAYOUTS["tp2_sp"], 2, LOW_PRECISION_TOL)


def test_tp2_with_data_parallel_and_sharded_optimizer_matches_one_rank(parity):
    """TP=2 x DP=2 (world 4), sequence parallel, ZeRO-sharded optimizer: the norm gradients summed over TP and
    the clipping norm counted across both groups give the single-rank run."""
    parity.check(TP_MODEL + ["precision.recipe=bf16"], LAYOUTS["tp2_sp_dp2_sharded"], 4, LOW_PRECISION_TOL)


@pytest.mark.parametrize("layout, world", [("tp2", 2), ("tp2_sp", 2), ("tp2_sp_dp2_sharded", 4)])
def test_every_gradient_and_the_grad_norm_match_tp1(parity, layout, world):
    """FP32, one step: each parameter's reduced gradient (norm weights summed over TP under SP, counted once in
    the norm) equals TP=1's to 1e-5 of its largest element."""
    one_step = ["training.steps=1", "optimizer.warmup_steps=1"]
    parity.check(TP_MODEL + ["precision.recipe=fp32", "optimizer.grad_clip=0"] + one_step, LAYOUTS[layout], world,
                 FP32_TOL)


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_query_key_norm_gradients_are_summed_over_tp(parity, layout):
    """`model.attention.qk_norm` (Qwen3): one norm weight all heads share, each TP rank's gradient of it from its own
    heads only, with or without SP: summed over TP, it equals TP=1's (FP32, one step, every gradient)."""
    one_step = ["training.steps=1", "optimizer.warmup_steps=1"]
    parity.check(TP_MODEL + ["model.attention.qk_norm=true", "precision.recipe=fp32", "optimizer.grad_clip=0"]
                 + one_step, LAYOUTS[layout], 2, FP32_TOL)


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_qkv_bias_gradients_match_tp1(parity, layout):
    """`model.attention.qkv_bias` (Qwen2): the bias split over TP as the projection's rows (whole heads), its
    gradient each rank's own: every gradient equals TP=1's (FP32, one step)."""
    one_step = ["training.steps=1", "optimizer.warmup_steps=1"]
    parity.check(TP_MODEL + ["model.attention.qkv_bias=true", "precision.recipe=fp32", "optimizer.grad_clip=0"]
                 + one_step, LAYOUTS[layout], 2, FP32_TOL)


def test_fp8_tp2_with_query_key_norms_matches_tp1(parity):
    """Under FP8 the QKV projection's quantizer does not fuse RoPE's backward when the query/key norms lie between
    them: the unfused path trains at TP=2 + SP as at TP=1."""
    parity.check(TP_MODEL + ["model.attention.qk_norm=true", "precision.recipe=fp8"], LAYOUTS["tp2_sp"], 2,
                 LOW_PRECISION_TOL)


def _save_worker(rank, world, overrides):
    cfg = load_config("tiny_dense", overrides)
    dims = ParallelDims.build(tp=cfg.parallel.tp, ep=cfg.parallel.ep, sequence_parallel=cfg.parallel.sequence_parallel)
    Trainer(cfg, dims, torch.device("cpu")).fit()


@pytest.mark.parametrize("attention", [[], ["model.attention.qkv_bias=true", "model.attention.qk_norm=true"]],
                         ids=["plain", "qkv_bias_qk_norm"])
def test_tp2_checkpoint_resumes_at_tp1(tiny_overrides, tmp_path, attention):
    """Checkpoints hold full tensors by name: a TP=2 run's checkpoint resumes at TP=1 with the same weights (Qwen2's
    QKV bias gathered part by part as the projection's rows, Qwen3's shared query/key norms once)."""
    base = tiny_overrides + TP_MODEL + attention + ["training.steps=3", "checkpoint.interval=3",
                                                   f"checkpoint.dir={tmp_path}/ck"]
    spawn(2, _save_worker, base + ["parallel.tp=2", "parallel.sequence_parallel=true"])
    saved = load_checkpoint(find_latest(tmp_path / "ck"))
    assert saved["model"]["layers.0.attn.qkv_proj.weight"].shape == (3 * 256, 128)  # full, not a shard
    if attention:
        assert saved["model"]["layers.0.attn.qkv_bias"].shape == (3 * 256,)
        assert saved["model"]["layers.0.attn.q_norm.weight"].shape == (128,)
    resumed = Trainer(load_config("tiny_dense", base + ["training.steps=4"]), ParallelDims.single(),
                      torch.device("cpu"))
    assert resumed.step == 3
    state = resumed.model.state_dict()
    assert all(torch.equal(state[k], saved["model"][k]) for k in saved["model"])
    resumed.fit()
    assert resumed.step == 4


# ------------------------------------------------------------------------------------- layouts

def test_rank_placement_keeps_tensor_parallel_innermost():
    groups = rank_groups(16, tp=2, pp=2, ep=2)
    assert groups["tp"][:2] == [[0, 1], [2, 3]]
    assert groups["dp"][0] == [0, 2, 4, 6] and groups["pp"][0] == [0, 8]
    assert groups["ep"][0] == [0, 2] and groups["edp"][0] == [0, 4]
    for kind, members in groups.items():  # every rank in exactly one group of each kind
        assert sorted(r for g in members for r in g) == list(range(16)), kind


def _timeout_worker(rank: int, world: int, signals) -> None:
    cfg = load_config("tiny_dense", ["parallel.tp=2", "parallel.timeout_minutes=0.05"])  # 3 s
    dims = ParallelDims.from_config(cfg.parallel)
    late = 10.0  # this rank's data-parallel peer (dp_rank 1) joins the all-reduce 10 s late: too late at 3 s
    if dims.dp_rank == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError):  # (under torch's default the all-reduce completed when the peer came)
            dist.all_reduce(torch.ones(1), group=dims.dp_group)
        assert time.monotonic() - started < late
        (signals / f"gave_up.{rank}").touch()
    else:
        # Late: until its peer has given up (3 s when the timeout holds; the suite need not sit out all 10 s), and
        # at most 10 s (when it does not hold, the peer is still waiting then and the all-reduce completes).
        peer = next(r for r in dist.get_process_group_ranks(dims.dp_group) if r != rank)
        deadline = time.monotonic() + late
        while not (signals / f"gave_up.{peer}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            dist.all_reduce(torch.ones(1), group=dims.dp_group)
        except RuntimeError:
            pass  # its peer has given up: this one fails too, or after its own timeout


def test_parallel_timeout_applies_to_every_process_group(tmp_path):
    """`parallel.timeout_minutes` holds on the tensor-, data-, pipeline- and expert-parallel groups, not only on the
    default group: a new group takes torch's own default (30 minutes on gloo) unless given one, so a collective that
    one rank of a DP group missed waited half an hour."""
    spawn(4, _timeout_worker, tmp_path)


def test_layer_rejects_a_shard_off_the_tile_grid():
    tp = TensorParallel(None, 2, 0)
    with pytest.raises(ValueError, match="gives 64 per tensor-parallel rank, not a multiple of 128"):
        ColumnParallelLinear(256, 128, PrecisionRecipe.from_name("bf16"), tp)
    with pytest.raises(ValueError, match="in_features = 258 does not divide over 4 tensor-parallel ranks"):
        RowParallelLinear(258, 256, PrecisionRecipe.from_name("bf16"), TensorParallel(None, 4, 0))


def test_launch_with_a_bad_layout_fails_with_one_clear_error(tiny_overrides, capsys):
    # One process cannot hold tp=2: one line on stderr names the setting, before any process group exists.
    assert main(["--config", "tiny_dense", *one_per_key(tiny_overrides, TP_MODEL), "parallel.tp=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 rank(s) cannot be split into tp=2" in err[0] and "parallel.tp" in err[0], err
