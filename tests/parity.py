"""The parity harness of the parallel tests: each parallel layout against its unsharded self (DESIGN.md, section 5).

Whole model. `ParityRuns` (the module-scoped `parity` fixture of conftest.py) trains a tiny config at the reference
layout (one rank, in the test process) and at a parallel layout (gloo ranks from `tests.distributed.spawn`), with the
same data, seeds and overrides but the layout's `parallel.*` ones, each run in a run directory of its own. Reference
runs are cached for the test module, so every layout of a module compares with the same ones. `assert_parity` holds
two runs to a `Tolerance`: every step's loss and gradient norm, every evaluation, and each parameter's gradient at
the first optimizer step (reduced over every group and clipped, gathered to its full shape: `full_grads`).

    ref, got = parity.check(["precision.recipe=bf16"], ["parallel.tp=2"], world=2, tol=LOW_PRECISION_TOL)

The variant need not be a layout: any change that must not move the numbers (`training.recompute=full`, one rank,
`EXACT_TOL`) compares the same way.

Single layers, built side by side on each rank at TP=1/EP=1 and sharded: `assert_close` compares a tensor with the
reference's, `grad_pairs` pairs each parameter's gradient with the reference's piece of it.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from megafp8.config import load_config
from megafp8.parallel import ParallelDims, TensorParallel, gather_param, is_expert, local_piece, tp_shard_of
from megafp8.parallel.flat import all_gather_flat
from megafp8.train.trainer import Trainer
from tests.distributed import spawn


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a parallel run may be from its reference: relative on each step's loss (and each evaluation's) and
    gradient norm; `grads`: each parameter's first-step gradient, as a fraction of the reference's largest element.
    None: not compared."""

    loss: float
    grad_norm: Optional[float] = None
    grads: Optional[float] = None


EXACT_TOL = Tolerance(loss=0.0, grad_norm=0.0, grads=0.0)  # bit for bit
FP32_TOL = Tolerance(loss=1e-5, grad_norm=1e-5, grads=1e-5)  # the same operations; only summation orders differ
LOW_PRECISION_TOL = Tolerance(loss=5e-3, grad_norm=3e-2)  # BF16 and FP8 over a few steps: BF16-rounded partial sums


@dataclasses.dataclass
class Run:
    """What rank 0 saw of a training run."""

    steps: int  # training.steps
    records: list[dict[str, Any]]  # the metrics records, train and eval
    grads: dict[str, torch.Tensor]  # every parameter's gradient at the first optimizer step (`full_grads`)
    bubble: Optional[float]  # the pipeline schedule's idle fraction (None without pipeline parallelism)

    @property
    def train(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == "train"]

    @property
    def val_losses(self) -> list[float]:
        return [r["val_loss"] for r in self.records if r["kind"] == "eval"]


def assert_parity(ref: Run, got: Run, tol: Tolerance, evals: int = 0) -> None:
    """`got` trained every step that `ref` did, ran `evals` evaluations like it, and is within `tol` of it."""
    assert ref.steps == got.steps
    assert [r["step"] for r in got.train] == [r["step"] for r in ref.train] == list(range(1, ref.steps + 1))
    for a, b in zip(ref.train, got.train):
        for loss in ("loss", "lm_loss", "mtp_loss"):  # with MTP, its parts too
            if loss in a:
                assert math.isclose(a[loss], b[loss], rel_tol=tol.loss), (a["step"], loss, a[loss], b[loss])
        if tol.grad_norm is not None:
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=tol.grad_norm), (a["step"], a["grad_norm"],
                                                                                         b["grad_norm"])
    assert len(got.val_losses) == len(ref.val_losses) == evals
    for a, b in zip(ref.val_losses, got.val_losses):
        assert math.isclose(a, b, rel_tol=tol.loss), ("validation loss", a, b)
    if tol.grads is not None:
        assert ref.grads.keys() == got.grads.keys()
        for name, expected in ref.grads.items():
            assert_close(got.grads[name], expected, name, tol.grads)


class ParityRuns:
    """Training runs of the tiny configs at any layout over `base` overrides (the tiny model and its data), each in
    its own run directory under `root`; the one-rank reference runs cached."""

    def __init__(self, base: Sequence[str], root: Path) -> None:
        self.base, self.root = list(base), root
        self._references: dict[tuple[str, tuple[str, ...]], Run] = {}
        self._count = 0

    def run(self, world: int, overrides: Sequence[str], config: str = "tiny_dense") -> Run:
        """Train `config` with the base and `overrides` on `world` ranks (one: in this process)."""
        self._count += 1
        name = f"run{self._count}"
        overrides = [*self.base, f"logging.output_dir={self.root}", f"run_name={name}", *overrides]
        if world == 1:
            return _train(0, 1, config, overrides)
        out = self.root / f"{name}.pt"
        spawn(world, _train_worker, config, overrides, out)
        return Run(**torch.load(out))

    def reference(self, overrides: Sequence[str], config: str = "tiny_dense") -> Run:
        """The one-rank run of `overrides`, trained once per test module."""
        key = (config, tuple(overrides))
        if key not in self._references:
            self._references[key] = self.run(1, overrides, config)
        return self._references[key]

    def check(self, overrides: Sequence[str], variant: Sequence[str], world: int, tol: Tolerance,
              config: str = "tiny_dense", evals: int = 0) -> tuple[Run, Run]:
        """`assert_parity` of `overrides` plus `variant` (a layout's `parallel.*` settings, or any change that must
        not move the numbers) on `world` ranks against the reference run of `overrides`; returns (reference, run)
        for further checks."""
        ref = self.reference(overrides, config)
        got = self.run(world, [*overrides, *variant], config)
        assert_parity(ref, got, tol, evals)
        return ref, got


def _train(rank: int, world: int, config: str, overrides: list[str]) -> Optional[Run]:
    """Train on this rank (of `world`, ranks already joined), capturing the first step's gradients; rank 0's
    `Run`."""
    cfg = load_config(config, overrides)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, torch.device("cpu"))
    grads = capture_first_step_grads(trainer)
    records = trainer.fit()
    if rank != 0:
        return None
    return Run(cfg.training.steps, records, grads, getattr(trainer.pipeline, "bubble", None))


def _train_worker(rank: int, world: int, config: str, overrides: list[str], out_path: Path) -> None:
    run = _train(rank, world, config, overrides)
    if run is not None:
        torch.save(dataclasses.asdict(run), out_path)


def full_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient at its full shape: data-parallel shards, tensor-parallel shards and
    expert-parallel slices gathered (collective); under pipeline parallelism rank 0 gets every stage's."""
    buckets, dims = trainer.grad_buckets, trainer.dims
    names = {p: n for n, p in trainer.model.named_parameters()}
    grads = {}
    for bucket in buckets.buckets:
        flat = buckets.shard_grads(bucket)
        if buckets.sharded and bucket.group_size > 1:
            whole = torch.empty(bucket.numel)
            all_gather_flat(whole, flat, group=bucket.group)
            flat = whole
        for p, offset in zip(bucket.params, bucket.offsets):
            grads[names[p]] = gather_param(flat[offset:offset + p.numel()].view_as(p), p, trainer.tp,
                                           trainer.ep).clone()
    if dims.pp_group is not None and dims.rank % (dims.tp * dims.dp) == 0:  # rank 0's pipeline
        stages = [None] * dims.pp if dims.rank == 0 else None
        dist.gather_object(grads, stages, dst=0, group=dims.pp_group)
        if dims.rank == 0:
            grads = {name: g for stage in stages for name, g in stage.items()}
    return grads


def capture_first_step_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """A dict that fills, at the trainer's first optimizer step, with every parameter's gradient as the optimizer
    sees it (reduced over every group and clipped; `full_grads`), the step itself then running as usual."""
    captured: dict[str, torch.Tensor] = {}
    real_step = trainer.optimizer.step

    def step(lr, apply=None):
        if not captured:
            captured.update(full_grads(trainer))
        real_step(lr, apply)
    trainer.optimizer.step = step
    return captured


# ------------------------------------------------------------------------------------------ single layers

def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, frac: float) -> None:
    """The largest difference is at most `frac` of `expected`'s largest magnitude."""
    err = (actual.float() - expected.float()).abs().max().item()
    bound = frac * expected.float().abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def grad_pairs(layer: nn.Module, ref: nn.Module, tp: TensorParallel,
               tokens_split_over: Optional[dist.ProcessGroup] = None) -> Iterator[tuple[str, torch.Tensor,
                                                                                        torch.Tensor]]:
    """(name, gradient, expected) for each parameter of a parallel `layer` and its unsharded `ref` after backward:
    expected is this rank's piece of the reference's gradient (its TP shard, its experts' rows). Replicated
    parameters' gradients are summed over `tokens_split_over`, the group whose ranks ran different tokens (the TP
    group under sequence parallelism, the EP group), the reference having run all of them."""
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad
        if tokens_split_over is not None and tp_shard_of(p) is None and not is_expert(p):
            grad = grad.clone()
            dist.all_reduce(grad, group=tokens_split_over)
        yield name, grad, local_piece(ref_params[name].grad, p, tp)
