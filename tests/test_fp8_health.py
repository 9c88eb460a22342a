"""FP8 health statistics on constructed tensors, and the sampled monitor in a training run."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.precision import E4M3
from megafp8.precision.health import fp8_stats, fp8_stats_of_rows
from megafp8.train import Trainer


def test_stats_of_a_constructed_tensor():
    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (2, 256), generator=g) * 2 - 1
    # |x| in [0.3, 0.45] with a 1.0 heading every tile: nothing underflows, and only that 1.0 reaches the
    # maximum (0.45 / 1.0 * 448 = 201.6 rounds far below 448).
    x = signs * (0.3 + 0.15 * torch.rand(2, 256, generator=g))
    x[:, ::128] = 1.0
    x[0, :128] = 1e-3  # tile (0, 0): a 1e6 outlier flushes its 127 neighbours (1e-3 / (1e6 / 448) < 2^-10)
    x[0, 0] = 1e6
    x[1, 128:] = 3.0  # tile (1, 1): all equal, so all 128 sit at the maximum
    stats = {k: v.item() for k, v in fp8_stats(x, E4M3).items()}
    assert stats["amax"] == 1e6
    assert stats["underflow"] == pytest.approx(127 / 512)
    # One element at the maximum in each of the three other tiles (their max-abs), 128 in the constant tile.
    assert stats["at_max"] == pytest.approx((3 + 128) / 512)
    x_clean = signs * (0.3 + 0.15 * torch.rand(2, 256, generator=g))
    clean = fp8_stats(x_clean, E4M3)
    assert clean["underflow"].item() == 0.0
    assert 28 < clean["snr_db"].item() < 40  # 3 mantissa bits: ~30 dB
    zeros = fp8_stats(torch.zeros(2, 128), E4M3)
    assert zeros["underflow"].item() == 0.0 and zeros["at_max"].item() == 0.0
    assert zeros["snr_db"].item() == math.inf  # quantized exactly (0 / 0 gave -inf: "all noise")


@pytest.mark.parametrize("blocks", [False, True], ids=["1x128 tiles", "128x128 blocks"])
def test_stats_by_chunks_of_rows_are_the_whole_tensors(blocks):
    """Computed a chunk of rows at a time (a ragged last chunk included, whole 128-row blocks for weights), the
    statistics are those of the whole tensor: the same maximum and counts, the same SNR up to summation order; the
    row maker is asked for no more rows at a time than a chunk holds."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(640, 256, generator=g) * torch.logspace(-6, 2, 640).unsqueeze(1)  # rows far apart in scale
    x[3, 5] = 0.0
    whole = fp8_stats(x, E4M3, blocks=blocks, chunk_elements=x.numel())
    asked = []

    def rows(start, stop):
        asked.append((start, stop))
        return x[start:stop]
    chunk_elements = 256 * 100  # 100 rows: 7 chunks of 1x128 tiles (the last 40 rows), or 128-row ones: 5
    chunked = fp8_stats_of_rows(rows, 640, 256, E4M3, blocks=blocks, chunk_elements=chunk_elements)
    assert asked[0] == (0, 128 if blocks else 100) and asked[-1][1] == 640 and len(asked) == (5 if blocks else 7)
    for key in ("amax", "underflow", "at_max"):
        assert chunked[key].item() == whole[key].item(), key
    assert chunked["snr_db"].item() == pytest.approx(whole["snr_db"].item(), rel=1e-9)
    assert 0 < whole["underflow"].item() < 1 and whole["at_max"].item() > 0


def test_stats_take_each_chunks_sums_from_the_given_function():
    """`sums` (a backend's `health_sums`) measures every chunk in place of `chunk_sums`; the reference backend's is
    `chunk_sums` itself, so the statistics are the same either way."""
    from megafp8.precision.backends import Fp8Backend

    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 256, generator=g).bfloat16()
    seen = []

    def sums(x2d, fmt, blocks, power_of_two):
        seen.append((tuple(x2d.shape), x2d.dtype, blocks, power_of_two))
        return Fp8Backend().health_sums(x2d, fmt, blocks, power_of_two)

    got = fp8_stats(x, E4M3, power_of_two=True, chunk_elements=256 * 128, sums=sums)
    want = fp8_stats(x, E4M3, power_of_two=True, chunk_elements=256 * 128)
    assert seen == [((128, 256), torch.bfloat16, False, True)] * 2 + [((44, 256), torch.bfloat16, False, True)]
    assert {k: v.item() for k, v in got.items()} == {k: v.item() for k, v in want.items()}


def test_the_monitor_measures_with_each_layers_backend(tiny_overrides, monkeypatch):
    """The sampled monitor takes its sums from each FP8 layer's backend (`Fp8Backend.health_sums`: on a GPU the
    one-pass kernel), for inputs, weights and output gradients alike."""
    from megafp8.precision.backends import Fp8Backend

    calls = []
    original = Fp8Backend.health_sums

    def counting(self, x2d, fmt, blocks, power_of_two):
        calls.append(blocks)
        return original(self, x2d, fmt, blocks, power_of_two)

    monkeypatch.setattr(Fp8Backend, "health_sums", counting)
    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["training.steps=1", "optimizer.warmup_steps=1",
                                                          "training.eval_interval=0", "logging.fp8_health_interval=1",
                                                          "precision.fp8_backend=reference"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    trainer.fit()
    layers = sum(1 for m in trainer.model.modules() if getattr(m, "runs_fp8", False))
    assert calls.count(True) == layers  # one weight each (a single chunk)
    assert calls.count(False) >= 2 * layers  # inputs and output gradients, a chunk or more each


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_health_kernel_matches_the_reference_on_the_gpu(fmt_name, dtype):
    """On CUDA (the real FP8 conversion): tiles and blocks, power-of-two scales or not, values spanning 1e-12 to
    1e15 (subnormals and flushed values in every tile kind), zero rows, constant tiles, tiles holding inf and nan or
    inf alone, tiles whose squares sum past FP32's range, strided columns and no rows: the same counts, the same
    non-finite maxima and energies where the reference's are, and finite ones equal (energies to 1e-6)."""
    from megafp8.precision.formats import FORMATS
    from megafp8.precision.health import chunk_sums
    from megafp8.precision.kernels.health import health_sums

    fmt, cuda = FORMATS[fmt_name], torch.device("cuda")
    g = torch.Generator(device=cuda).manual_seed(3)
    x = torch.randn(1000, 512, device=cuda, generator=g) * torch.logspace(-12, 6, 1000, device=cuda).unsqueeze(1)
    x[:, ::97] *= 1e4  # outliers that flush their tiles' small values in E4M3
    x[400, 0] = 1e15  # and one that flushes its tile's others in E5M2 too (a range of ~1e20 within the tile)
    x[11] = 0.0
    x[300, 128:256] = -5.0
    bad = x[:256].clone()
    bad[3, 7], bad[130, 300] = float("nan"), float("inf")
    infinite = x[:256].clone()
    infinite[130, 300] = float("inf")  # a nan noise, an inf signal and maximum, counts as the reference's
    huge = torch.full((256, 256), 1e18, device=cuda)  # squares past FP32's range in a tile's sum, finite in FP64
    huge[:, 1::2] = -3e17
    cases = ((False, x), (True, x[:896]), (False, x[:, 256:]), (False, bad), (True, bad), (False, infinite),
             (True, infinite), (False, huge), (True, huge), (False, x[:, ::2]), (False, x[:0]))
    for blocks, source in cases:
        rows = source.to(dtype)
        for pow2 in (False, True):
            want, got = chunk_sums(rows, fmt, blocks, pow2), health_sums(rows, fmt, blocks, pow2)
            for key in ("underflow", "nonzero", "at_max"):
                assert got[key].item() == want[key].item(), (blocks, pow2, key)
            assert got["amax"].dtype == want["amax"].dtype and got["signal"].dtype == want["signal"].dtype
            for key in ("amax", "signal", "noise"):
                mine, ref = got[key].item(), want[key].item()
                assert math.isnan(mine) == math.isnan(ref) and math.isinf(mine) == math.isinf(ref), (blocks, key, ref)
                if math.isfinite(ref):
                    assert mine == (ref if key == "amax" else pytest.approx(ref, rel=1e-6)), (blocks, pow2, key)
            if source is huge:
                assert math.isfinite(got["signal"].item()) and got["signal"].item() > 1e39
            if source is x:
                assert 0 < want["underflow"] < want["nonzero"] and want["at_max"] > 0


def test_weight_stats_use_blocks():
    w = torch.full((128, 256), 2.0)
    w[:, 128:] = 1.0
    assert fp8_stats(w, E4M3, blocks=True)["at_max"].item() == 1.0  # every block is constant
    assert fp8_stats(w, E4M3, blocks=True)["snr_db"].item() > 100


def test_monitor_samples_every_n_steps_and_warns(tiny_overrides, caplog):
    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["training.steps=4", "training.eval_interval=0",
                                                          "logging.fp8_health_interval=2", "logging.fp8_at_max_warn=0.0"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    with caplog.at_level("WARNING", logger="megafp8"):
        trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    health = [r for r in records if r["kind"] == "fp8_health"]
    assert [r["step"] for r in health] == [1, 3]
    layers = health[0]["layers"]
    assert set(layers) == {n for n, m in trainer.model.named_modules() if getattr(m, "runs_fp8", False)}
    assert "lm_head" not in layers
    for kinds in layers.values():
        assert set(kinds) == {"input", "weight", "grad"}
        assert all(0 <= s["underflow"] <= 1 and s["snr_db"] > 20 for s in kinds.values())
    assert "fp8 health of layers.0.attn.qkv_proj input" in caplog.text
    assert not any(m._forward_hooks for m in trainer.model.modules())  # hooks removed after the sampled step
    unmonitored = Trainer(load_config("tiny_dense_fp8", tiny_overrides + [
        "training.steps=4", "training.eval_interval=0", "logging.fp8_health_interval=0", "run_name=plain"]),
        ParallelDims.single(), torch.device("cpu"))
    plain = [r["loss"] for r in unmonitored.fit() if r["kind"] == "train"]
    assert plain == [r["loss"] for r in records if r["kind"] == "train"]  # watching changes nothing


def test_a_sampled_mlp_reports_the_same_health_by_chunks_of_rows(tiny_overrides, monkeypatch):
    """The fused SwiGLU MLP's observer measures SwiGLU's output and gu's gradient (made from gu and da) a chunk of
    rows at a time: with chunks of 32 rows the health report is the one-chunk report (SNRs up to summation
    order)."""
    import megafp8.precision.health as health

    def report(name):
        cfg = load_config("tiny_dense_fp8", tiny_overrides + ["training.steps=1", "optimizer.warmup_steps=1",
                                                              "training.eval_interval=0",
                                                              "logging.fp8_health_interval=1", f"run_name={name}"])
        trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
        trainer.fit()
        records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        return next(r for r in records if r["kind"] == "fp8_health")["layers"]

    whole = report("whole")
    monkeypatch.setattr(health, "CHUNK_ELEMENTS", 32 * 256)
    chunked = report("chunked")
    assert set(chunked) == set(whole) and "layers.0.mlp.gate_up_proj" in whole
    for layer, kinds in whole.items():
        for kind, stats in kinds.items():
            for stat, value in stats.items():
                assert chunked[layer][kind][stat] == pytest.approx(value, rel=1e-6, abs=1e-12), (layer, kind, stat)


def _mlp_health(monkeypatch, fused: bool, recompute: bool = False, micro_batches: int = 1) -> tuple:
    """One sampled forward and backward of an FP8 SwiGLU MLP (reference backend) called as blocks call it, with its
    input norm as a keyword; unfused (`fuses_norm` off), its two linears run as modules and their own hooks see their
    tensors. The input is the residual stream, ~100x the scale of its normalized form."""
    from megafp8.model.mlp import SwiGLU
    from megafp8.model.norm import RMSNorm
    from megafp8.parallel import ColumnParallelLinear, TensorParallel
    from megafp8.precision import Fp8Recipe, PrecisionRecipe
    from megafp8.train.fp8_health import Fp8HealthMonitor

    if not fused:
        monkeypatch.setattr(ColumnParallelLinear, "fuses_norm", lambda self, rows: False)
    torch.manual_seed(0)
    recipe = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference"))
    model = nn.ModuleDict({"norm": RMSNorm(256, 1e-6, torch.bfloat16), "mlp": SwiGLU(256, 384, recipe,
                                                                                      TensorParallel.single())})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "proj" in name:
                param.normal_(0, 0.05)
    x = (torch.randn(2, 128, 256) * 100).bfloat16().requires_grad_()
    monitor = Fp8HealthMonitor(model, interval=1, underflow_warn=1.0, at_max_warn=1.0)
    assert monitor.arm(0)
    seen = {}
    if fused:  # what the fused function hands its observer, kept by a wrapper around the monitor's
        observer = model["mlp"].observer
        forward, backward = observer.forward, observer.backward
        observer.forward = lambda gu: (seen.setdefault("gu", gu.clone()), forward(gu))
        observer.backward = lambda dy, gu, da: (seen.update(dy=dy.clone(), da=da.clone()), backward(dy, gu, da))
    g = torch.Generator().manual_seed(1)
    for micro_batch in range(micro_batches):  # later micro-batches: other inputs, reported by none
        inputs = x if micro_batch == 0 else (torch.randn(2, 128, 256, generator=g) * 50).bfloat16()
        if recompute:  # as a recomputed (or sampled compiled) block: the forward runs again in backward
            y = torch.utils.checkpoint.checkpoint(lambda v: model["mlp"](v, norm=model["norm"]), inputs,
                                                  use_reentrant=False)
        else:
            y = model["mlp"](inputs, norm=model["norm"])
        y.backward(torch.randn(y.shape, generator=g) * 1e-3)
    report = monitor.collect(0)
    assert model["mlp"].observer is None and not any(m._forward_hooks for m in model.modules())
    return report, seen, recipe.fp8


def test_a_fused_mlps_health_is_what_its_linears_report_run_one_by_one(monkeypatch):
    """The fused FP8 MLP's hook and observer report what its projections quantize. Exactly: the gate/up input is
    norm(x) (the GEMM's input; the norm is passed as a keyword) and the output gradient is what the projections
    run unfused report; SwiGLU's output and gu's gradient are the statistics of swiglu(gu) and swiglu_backward(gu,
    da) in FP32, from the tensors the fused function made. Against the unfused run, whose gu comes from the norm's
    BF16 output (quantized from FP32 when fused) and whose SwiGLU runs in BF16, those two agree to FP8 rounding."""
    from megafp8.precision.health import fp8_stats
    from megafp8.precision.producers import swiglu, swiglu_backward

    fused, seen, fp8 = _mlp_health(monkeypatch, fused=True)
    with pytest.MonkeyPatch.context() as unfused_patch:
        unfused, _, _ = _mlp_health(unfused_patch, fused=False)
    assert set(fused) == set(unfused) == {"mlp.gate_up_proj", "mlp.down_proj"}
    assert fused["mlp.gate_up_proj"]["input"] == unfused["mlp.gate_up_proj"]["input"]
    assert fused["mlp.gate_up_proj"]["input"]["amax"] < 20  # normalized, not the ~100x residual stream
    assert fused["mlp.down_proj"]["grad"] == unfused["mlp.down_proj"]["grad"]
    as_floats = lambda stats: {k: v.float().item() for k, v in stats.items()}  # noqa: E731 (as `collect` reports)
    assert fused["mlp.down_proj"]["input"] == as_floats(fp8_stats(swiglu(seen["gu"]), fp8.fmt))
    assert fused["mlp.gate_up_proj"]["grad"] == as_floats(fp8_stats(swiglu_backward(seen["gu"], seen["da"]),
                                                                    fp8.grad_fmt))
    for name, kind in (("mlp.down_proj", "input"), ("mlp.gate_up_proj", "grad")):
        got, want = fused[name][kind], unfused[name][kind]
        assert got["amax"] == pytest.approx(want["amax"], rel=0.05), (name, kind)
        assert got["snr_db"] == pytest.approx(want["snr_db"], abs=1.0), (name, kind)
    for name in fused:
        assert fused[name]["weight"] == unfused[name]["weight"]


def test_a_fused_mlps_health_is_its_first_micro_batchs_under_recomputation(monkeypatch):
    """Recomputed (the forward runs again before backward) and followed by a second micro-batch, the fused MLP
    reports what one plain call on the first micro-batch reports: the observer measures its first forward and first
    backward only."""
    plain, _, _ = _mlp_health(monkeypatch, fused=True)
    recomputed, _, _ = _mlp_health(monkeypatch, fused=True, recompute=True, micro_batches=2)
    assert recomputed == plain


def test_an_mlp_whose_gate_up_projection_stays_bf16_reports_its_fp8_down_projection(tiny_overrides):
    """`precision.bf16_layers` keeping the gate/up projections in BF16: the MLP cannot run fused, its FP8 down
    projection reports through its own hook, and the BF16 gate/up projection is not measured (the MLP's hook, meant
    for the fused path, measured it as an FP8 layer and the sampled step 0 raised AttributeError)."""
    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["training.steps=2", "training.eval_interval=0",
                                                          "logging.fp8_health_interval=2",
                                                          "precision.bf16_layers=[layers.*.mlp.gate_up_proj]"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    layers = next(r for r in records if r["kind"] == "fp8_health")["layers"]
    assert set(layers) == {n for n, m in trainer.model.named_modules() if getattr(m, "runs_fp8", False)}
    assert "layers.0.mlp.gate_up_proj" not in layers
    assert set(layers["layers.0.mlp.down_proj"]) == {"input", "weight", "grad"}


def test_a_sample_left_armed_by_a_failed_step_is_detached_by_the_next_arm():
    """A step that raises between `arm` and `collect` leaves hooks, observers and the observed flags behind; the
    next `arm` detaches them first (no hook fires twice), and an unsampled step's `arm` leaves nothing attached."""
    from megafp8.model.mlp import SwiGLU
    from megafp8.parallel import TensorParallel
    from megafp8.precision import Fp8Recipe, PrecisionRecipe
    from megafp8.train.fp8_health import Fp8HealthMonitor

    recipe = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference"))
    model = nn.ModuleDict({"mlp": SwiGLU(256, 384, recipe, TensorParallel.single())})
    monitor = Fp8HealthMonitor(model, interval=2, underflow_warn=1.0, at_max_warn=1.0)
    hooks = lambda: sum(len(m._forward_hooks) for m in model.modules())  # noqa: E731
    assert monitor.arm(0)
    once = hooks()
    assert once == 3 and model["mlp"].observer is not None  # the two linears' hooks and the MLP's
    assert monitor.arm(2) and hooks() == once  # the step before raised: armed again, not twice
    assert not monitor.arm(3)
    assert hooks() == 0 and model["mlp"].observer is None


def test_monitor_covers_grouped_expert_linears(tiny_overrides):
    cfg = load_config("tiny_moe_fp8", tiny_overrides + ["training.steps=2", "training.eval_interval=0",
                                                        "logging.fp8_health_interval=1", "model.moe.ffn_hidden_size=128"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    layers = next(r for r in records if r["kind"] == "fp8_health")["layers"]
    experts = layers["layers.1.mlp.experts.gate_up_proj"]
    assert set(experts) == {"input", "weight", "grad"} and experts["weight"]["snr_db"] > 20


def test_a_sampled_step_keeps_no_more_for_backward_than_a_recomputed_one(tiny_overrides):
    """The sampled step runs compiled blocks uncompiled, where element-wise ops keep their intermediates, so it would
    set a compiled run's peak memory; they run recomputed instead, keeping for backward what `training.recompute:
    full` keeps (the blocks' inputs; the SwiGLU hooks hold the MLP inputs besides), less than an unsampled step.
    (Dynamo's eager backend stands in for Inductor: what is kept is the question, not the kernels.)"""
    from megafp8.model import Transformer, apply_compile, apply_recompute, init_weights
    from megafp8.precision import PrecisionRecipe
    from megafp8.train.fp8_health import Fp8HealthMonitor
    from tests.test_recompute import kept_for_backward

    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["model.num_layers=4", "model.vocab_size=512",
                                                          "precision.fp8_backend=reference"])
    model = Transformer(cfg.model, PrecisionRecipe.from_config(cfg.precision), 64)
    init_weights(model, cfg.model, 0)
    assert apply_compile(model, backend="eager") == 4
    tokens = torch.randint(0, 512, (4, 64))

    def saved_bytes() -> int:
        kept, loss = kept_for_backward(model, tokens)
        loss.backward()  # (the recomputation in backward keeps its tensors only while it runs)
        return kept

    plain = saved_bytes()
    monitor = Fp8HealthMonitor(model, 1, 1.0, 1.0)
    assert monitor.arm(0)
    sampled = saved_bytes()
    layers = monitor.collect(0)
    assert set(layers) == {n for n, m in model.named_modules() if getattr(m, "runs_fp8", False)}
    assert all(set(kinds) == {"input", "weight", "grad"} for kinds in layers.values())
    assert apply_recompute(model, "full") == 4
    recomputed = saved_bytes()
    assert sampled == recomputed < 0.8 * plain, (sampled, recomputed, plain)


def _health_records(run_dir) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "fp8_health"]


def _train_worker(rank: int, world: int, overrides: list[str]) -> None:
    cfg = load_config("tiny_dense_fp8", overrides)
    Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu")).fit()


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_pipelined_runs_health_records_every_stages_layers(tiny_overrides, tmp_path, schedule):
    """Rank 0 writes the record but holds only its own stages' layers: the other stages' reports are gathered (until
    that was fixed, a PP=2 run's records held half the model's layers). They are what a one-rank run reports."""
    from tests.distributed import spawn

    base = tiny_overrides + ["model.num_layers=4", "training.steps=2", "training.eval_interval=0",
                             "logging.fp8_health_interval=2", "precision.fp8_backend=reference"]
    one = Trainer(load_config("tiny_dense_fp8", base + ["run_name=one"]), ParallelDims.single(), torch.device("cpu"))
    one.fit()
    expected = _health_records(one.run_dir)[0]["layers"]
    assert {n.split(".")[1] for n in expected} == {"0", "1", "2", "3"}
    spawn(2, _train_worker, base + ["run_name=pp2", "parallel.pp=2", f"parallel.pp_schedule={schedule}"])
    [record] = _health_records(one.run_dir.parent / "pp2")
    assert record["layers"].keys() == expected.keys()
    for name, kinds in expected.items():  # the same weights and micro-batch: the same statistics
        for kind, stats in kinds.items():
            assert record["layers"][name][kind] == pytest.approx(stats, rel=1e-4), (name, kind)
