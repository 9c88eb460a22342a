"""Resharding is exact: a checkpoint saved at one layout, loaded at another and saved again holds the same state,
tensor for tensor and bit for bit (weights, buffers, FP32 masters, AdamW moments) and the same step, data position,
loss scale, RNG and non-finite count, in both checkpoint forms.

Each case trains two steps at layout A and saves there in both forms (the sharded form writes this rank's boxes, the
full form gathers: the two must agree); a run at layout B then resumes from each and saves in the full form, which
must equal what A saved. Losses alone (tests/test_checkpoint_sharded.py) would miss a swapped expert or a fused
shard re-interleaved wrongly in a state that training has not yet read (exp_avg_sq, an unused expert's rows)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megafp8.checkpoint import find_latest, load_checkpoint
from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.train.trainer import Trainer
from tests.distributed import spawn
from tests.test_mla import MLA_OVERRIDES

FORMATS = ("sharded", "full")


def _trainer(config: str, overrides: list[str], world: int) -> Trainer:
    cfg = load_config(config, overrides)
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single(),
                   torch.device("cpu"))


def _save_worker(rank: int, world: int, config: str, overrides: list[str], root: Path) -> None:
    """Train two steps, then save the same state in both forms (`root/<form>`)."""
    trainer = _trainer(config, overrides + ["checkpoint.resume=none", f"checkpoint.dir={root / 'sharded'}",
                                            "checkpoint.format=sharded"], world)
    for _ in range(2):
        trainer.train_step()
    trainer.save()
    trainer.checkpointer.sharded, trainer.checkpointer.directory = False, root / "full"
    trainer.save()


def _resave_worker(rank: int, world: int, config: str, overrides: list[str], source: Path, out: Path) -> None:
    """Resume from `source` and save again at once, in the full form, under `out`."""
    trainer = _trainer(config, overrides + [f"checkpoint.resume={source}", f"checkpoint.dir={out}",
                                            "checkpoint.format=full", f"run_name={out.name}"], world)
    assert trainer.step == 2
    trainer.save()


def _run(world: int, fn, *args) -> None:
    if world == 1:
        fn(0, 1, *args)
    else:
        spawn(world, fn, *args)


def assert_same_state(expected: dict, got: dict, what: str) -> None:
    """Every tensor and every non-tensor part of two checkpoints equal, bit for bit (the configs aside)."""
    for key in sorted(set(expected) | set(got)):
        if key == "config":
            continue
        assert key in expected and key in got, f"{what}: '{key}' only in one checkpoint"
        _assert_equal(expected[key], got[key], f"{what}: {key}")


def _assert_equal(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, sorted(a), sorted(b) if isinstance(b, dict)
                                                                else b)
        for k in a:
            _assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (where, (a.float() - b.float()).abs().max().item())
    else:
        assert a == b, (where, a, b)


def _assert_trained(state: dict) -> None:
    """The state compared is not vacuous: two optimizer steps were taken and moved the moments and the selection
    biases (a comparison of zeros would pass whatever the resharding did)."""
    skipped = state["nonfinite"]["skips_in_a_row"]
    assert state["step"] == 2 and state["optimizer"]["step"] == 2 - skipped  # a skipped step leaves the LR schedule
    if skipped:
        return  # every step skipped (the FP16 case): the tensors are the initial ones
    moments = state["optimizer"]["exp_avg_sq"]
    assert all(t.count_nonzero() > 0 for t in moments.values()), [n for n, t in moments.items() if not t.any()]
    biases = [t for name, t in state["model"].items() if name.endswith("expert_bias")]
    assert all(t.count_nonzero() > 0 for t in biases)


def check_resharding(config: str, overrides: list[str], saved_at: tuple[int, list[str]],
                     loaded_at: tuple[int, list[str]], tmp_path: Path) -> None:
    world, layout = saved_at
    _run(world, _save_worker, config, overrides + layout, tmp_path / "a")
    saved = {form: find_latest(tmp_path / "a" / form) for form in FORMATS}
    reference = load_checkpoint(saved["full"])
    _assert_trained(reference)
    assert_same_state(reference, load_checkpoint(saved["sharded"]), "sharded vs full at the saving layout")
    load_world, load_layout = loaded_at
    for form in FORMATS:
        out = tmp_path / f"b_{form}"
        _run(load_world, _resave_worker, config, overrides + load_layout, saved[form], out)
        assert_same_state(reference, load_checkpoint(find_latest(out)), f"{form} saved at {layout}, loaded at "
                                                                        f"{load_layout}")


MOE = ["model.num_layers=3", "training.global_batch_size=8", "training.micro_batch_size=2"]


TP_HEADS = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
            "model.vocab_size=512"]  # whole heads and 128-wide shards at TP=2
TP_MOE = TP_HEADS + ["model.moe.ffn_hidden_size=256"]  # the shared expert's shards, too
SMALL_BUCKETS = ["optimizer.bucket_size_mb=0.05"]  # several buckets, ZeRO ranges that start and end mid-row


SLOW = pytest.mark.slow  # the rest of the layout matrix: the default cases above each cover its mechanism


@pytest.mark.parametrize("saved_at, loaded_at", [
    pytest.param((2, ["parallel.ep=2"]), (1, []), id="ep2_to_ep1"),
    pytest.param((1, []), (2, ["parallel.ep=2"]), id="ep1_to_ep2", marks=SLOW),
    pytest.param((2, ["parallel.ep=2"] + SMALL_BUCKETS), (2, SMALL_BUCKETS), id="ep2_to_dp2_small_buckets", marks=SLOW),
    pytest.param((2, ["parallel.pp=2", "parallel.pp_layout=E,t|t*2,L"]), (1, []), id="pp2_to_one_rank", marks=SLOW),
    pytest.param((4, ["parallel.ep=2"] + SMALL_BUCKETS), (1, []), id="ep2_edp2_to_one_rank", marks=SLOW),
    pytest.param((4, ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"] + TP_MOE), (1, TP_MOE),
                 id="tp2_ep2_to_one_rank", marks=SLOW),
])
def test_moe_state_reshards_exactly_between_ep_layouts(tiny_overrides, tmp_path, saved_at, loaded_at):
    """Every expert's weight, master and moments in its place, the router and its selection bias (moved by the
    balancing hook, outside AdamW) carried."""
    check_resharding("tiny_moe_fp8", tiny_overrides + MOE, saved_at, loaded_at, tmp_path)


TP_MLA_MTP = MLA_OVERRIDES + ["model.num_heads=4", "model.vocab_size=512", "model.mtp_depth=1", "model.num_layers=2",
                              "precision.recipe=bf16"]
PP_MODEL = ["model.num_layers=4", "model.vocab_size=512", "precision.recipe=bf16"]


@pytest.mark.parametrize("model, saved_at, loaded_at", [
    pytest.param(TP_MLA_MTP, (2, ["parallel.tp=2"]), (1, []), id="tp2_mla_mtp"),
    pytest.param(PP_MODEL + ["model.mtp_depth=1"], (2, ["parallel.pp=2", "parallel.pp_schedule=zbv",
                                                        "parallel.pp_layout=E,t*2|t|t|L"]), (1, []),
                 id="pp2_zbv_uneven_mtp"),
    pytest.param(TP_HEADS, (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]), (1, []), id="tp2_gqa_sp",
                 marks=SLOW),
    pytest.param(TP_HEADS + SMALL_BUCKETS, (4, ["parallel.tp=2"]), (2, ["parallel.tp=2"]), id="tp2_dp2_to_tp2",
                 marks=SLOW),
    pytest.param(PP_MODEL, (2, ["parallel.pp=2", "parallel.pp_layout=E,t|t*3,L"]), (1, []), id="pp2_uneven",
                 marks=SLOW),
    pytest.param(PP_MODEL, (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                "parallel.pp_layout=E,t|t|t|t,L"]), (1, []), id="pp2_virtual", marks=SLOW),
    pytest.param(PP_MODEL + ["model.mtp_depth=1"], (1, []), (2, ["parallel.pp=2", "parallel.pp_schedule=dualpipev"]),
                 id="pp1_to_dualpipev_mtp", marks=SLOW),
    pytest.param(PP_MODEL, (2, ["parallel.pp=2", "parallel.pp_layout=E,t|t*3,L"]),
                 (2, ["parallel.pp=2", "parallel.pp_layout=E,t*3|t,L"]), id="pp2_to_another_pp2_layout", marks=SLOW),
])
def test_dense_state_reshards_exactly(tiny_overrides, tmp_path, model, saved_at, loaded_at):
    """Fused [q; k; v] / [gate; up] and MLA's projections re-interleaved from TP shards; stages of uneven and
    V-shaped pipelines (the MTP module beside the embedding it shares) merged into one rank."""
    check_resharding("tiny_dense", tiny_overrides + model, saved_at, loaded_at, tmp_path)


def test_fp16_scaler_and_skip_count_carry_across_layouts(tiny_overrides, tmp_path, capsys):
    """The non-tensor state a layout change must carry: a loss scale stuck at its minimum where every step
    overflows, so both steps are skipped and counted (`nonfinite`), the scaler's hysteresis spent. `inspect` shows
    the count (a run resumed from it is that much nearer `training.max_consecutive_skips`)."""
    from tools.convert_checkpoint import main as convert

    fp16 = ["precision.recipe=fp16", "precision.loss_scale_initial=1e30", "precision.loss_scale_min=1e30"] + TP_HEADS
    check_resharding("tiny_dense", tiny_overrides + fp16, (2, ["parallel.tp=2"]), (1, []), tmp_path)
    state = load_checkpoint(find_latest(tmp_path / "b_sharded"))
    assert state["nonfinite"]["skips_in_a_row"] == 2 and state["loss_scaler"], state
    assert convert(["inspect", str(find_latest(tmp_path / "b_sharded"))]) == 0
    assert ("non-finite steps: 2 skipped in a row from step 1 (the run stops at training.max_consecutive_skips="
            in capsys.readouterr().out)


def test_converted_checkpoints_resume_to_the_identical_state(tiny_overrides, tmp_path, capsys):
    """`tools/convert_checkpoint.py consolidate` and `shard` keep every tensor and every part bit for bit, and what
    they write resumes at another layout to that same state (MoE saved at EP=2, resumed on one rank)."""
    from tools.convert_checkpoint import main as convert

    config, overrides = "tiny_moe_fp8", tiny_overrides + MOE
    _run(2, _save_worker, config, overrides + ["parallel.ep=2"], tmp_path / "a")
    sharded, full = find_latest(tmp_path / "a" / "sharded"), find_latest(tmp_path / "a" / "full")
    reference = load_checkpoint(full)
    _assert_trained(reference)
    assert convert(["consolidate", str(sharded), "--out", str(tmp_path / "consolidated")]) == 0
    assert convert(["shard", str(full), "--out", str(tmp_path / "resharded")]) == 0
    assert convert(["inspect", str(sharded)]) == 0
    assert "optimizer step 2" in capsys.readouterr().out
    for name in ("consolidated", "resharded"):
        converted = find_latest(tmp_path / name)
        assert_same_state(reference, load_checkpoint(converted), name)
        _run(1, _resave_worker, config, overrides, converted, tmp_path / f"resumed_{name}")
        assert_same_state(reference, load_checkpoint(find_latest(tmp_path / f"resumed_{name}")), f"{name} resumed")


def _steps_worker(rank: int, world: int, config: str, overrides: list[str], steps: int, out: Path) -> None:
    """Take `steps` more training steps (resuming from `checkpoint.dir` if it holds a checkpoint), then save there;
    rank 0 records each step's loss (averaged over the ranks: each holds its own batches' mean; no pipeline) and
    gradient norm in `out`."""
    trainer = _trainer(config, overrides, world)
    records = []
    for _ in range(steps):
        loss, grad_norm = trainer.train_step()
        if world > 1:
            dist.all_reduce(loss)
        records.append((loss.item() / world, grad_norm.item()))
    trainer.save()
    if rank == 0:
        torch.save(records, out)


@pytest.mark.parametrize("config, model, layout, form", [
    pytest.param("tiny_moe_fp8", MOE, ["parallel.ep=2"], "sharded", id="moe_ep2-sharded"),
    pytest.param("tiny_moe_fp8", MOE, ["parallel.ep=2"], "full", id="moe_ep2-full", marks=SLOW),
    pytest.param("tiny_dense", TP_MLA_MTP, ["parallel.tp=2"], "sharded", id="mla_mtp_tp2-sharded", marks=SLOW),
    pytest.param("tiny_dense", TP_MLA_MTP, ["parallel.tp=2"], "full", id="mla_mtp_tp2-full", marks=SLOW),
])
def test_a_resumed_run_is_the_straight_run(tiny_overrides, tmp_path, config, model, layout, form):
    """Four steps straight, or two, a checkpoint and two more: the same losses, gradient norms and final state, bit
    for bit (the selection biases and the FP8 weight caches included: a stale cache would move the losses)."""
    overrides = tiny_overrides + model + layout + [f"checkpoint.format={form}"]
    _run(2, _steps_worker, config, overrides + [f"checkpoint.dir={tmp_path / 's'}", "run_name=s"], 4, tmp_path / "s.pt")
    broken = overrides + [f"checkpoint.dir={tmp_path / 'r'}", "run_name=r"]
    _run(2, _steps_worker, config, broken, 2, tmp_path / "r1.pt")
    _run(2, _steps_worker, config, broken, 2, tmp_path / "r2.pt")
    assert torch.load(tmp_path / "s.pt") == torch.load(tmp_path / "r1.pt") + torch.load(tmp_path / "r2.pt")
    assert_same_state(load_checkpoint(find_latest(tmp_path / "s")), load_checkpoint(find_latest(tmp_path / "r")),
                      "straight vs resumed")


@pytest.mark.parametrize("config, model, layout", [
    pytest.param("tiny_dense", TP_HEADS, [], id="dense_dp2"),
    pytest.param("tiny_moe_fp8", MOE, ["parallel.ep=2"], id="moe_ep2"),
])
def test_a_run_resumed_at_another_layout_continues_the_straight_run(tiny_overrides, tmp_path, config, model, layout):
    """Two FP32 steps on two ranks (DP=2: ZeRO-sharded optimizer, half of each global batch per rank; or EP=2: the
    experts split), then two on one rank: the losses and gradient norms of an uninterrupted one-rank run to 1e-5 (the
    layouts differ only in summation order). A data position, learning-rate step or selection bias that did not carry
    across the change would move them by far more (another batch: ~1e-2)."""
    overrides = tiny_overrides + model + ["precision.recipe=fp32", "checkpoint.format=sharded"]
    _run(1, _steps_worker, config, overrides + [f"checkpoint.dir={tmp_path / 's'}", "run_name=s"], 4,
         tmp_path / "s.pt")
    broken = overrides + [f"checkpoint.dir={tmp_path / 'r'}", "run_name=r"]
    _run(2, _steps_worker, config, broken + layout, 2, tmp_path / "r1.pt")
    _run(1, _steps_worker, config, broken, 2, tmp_path / "r2.pt")
    straight, resumed = torch.load(tmp_path / "s.pt"), torch.load(tmp_path / "r1.pt") + torch.load(tmp_path / "r2.pt")
    for step, (a, b) in enumerate(zip(straight, resumed), start=1):
        assert a == pytest.approx(b, rel=1e-5), (step, a, b)


def _init_worker(rank: int, world: int, config: str, overrides: list[str], root: Path) -> None:
    """Save the freshly initialized state (step 0) under `root`."""
    _trainer(config, overrides + ["checkpoint.resume=none", f"checkpoint.dir={root}"], world).save()


@pytest.mark.parametrize("config, model, world, layout", [
    pytest.param("tiny_dense", TP_MLA_MTP, 2, ["parallel.tp=2"], id="tp2_mla_mtp"),
    pytest.param("tiny_dense", PP_MODEL + ["model.mtp_depth=1"], 2, ["parallel.pp=2", "parallel.pp_schedule=zbv"],
                 id="pp2_zbv_mtp"),
    pytest.param("tiny_moe_fp8", MOE + TP_MOE, 4, ["parallel.tp=2", "parallel.ep=2"], id="tp2_ep2"),
])
def test_a_checkpoint_holds_the_unsharded_layout(tiny_overrides, tmp_path, config, model, world, layout):
    """A round trip through one layout cannot tell a consistently wrong full tensor (a fused shard interleaved as
    [q_0; q_1; k_0; ...] on save and read back the same way) from a right one. Initialization draws every
    parameter at its full shape and keeps the layout's piece (`megafp8/model/init.py`), the piece the parity tests
    check the layers compute with: so the step-0 checkpoint of any layout must be the one-rank model's, tensor for
    tensor."""
    _run(world, _init_worker, config, tiny_overrides + model + layout + ["run_name=a"], tmp_path / "a")
    _run(1, _init_worker, config, tiny_overrides + model + ["run_name=b"], tmp_path / "b")
    sharded, single = load_checkpoint(find_latest(tmp_path / "a")), load_checkpoint(find_latest(tmp_path / "b"))
    for part in ("model", "optimizer"):  # the RNG is each process's own at step 0
        _assert_equal(single[part], sharded[part], part)
