#!/usr/bin/env python
"""The optimizer step plus the FP8 weights' quantization for the next forward, two ways, on one GPU: the fused
update followed by each FP8 layer quantizing its new weight (`Fp8WeightCache.get`, as the first forward after a step
does), and the fused update quantizing the FP8 weights as it writes them (`DistributedAdamW.
quantize_weights_in_update`, what training runs), after which the caches are current.

    PYTHONPATH=. python benchmarks/optimizer_step.py --model 8b-layers 1b moe --iters 20

The model is built as a run builds it (`train_step.py`'s shapes, FP8 recipe, one rank, buckets as configured), with
random gradients. Printed per model: the median GPU time of each form (CUDA events around the step and the
quantizations, all on the device), and whether both leave the same bits in the masters, the moments, the weights and
the FP8 caches.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megafp8.config import load_config  # noqa: E402
from megafp8.parallel import ParallelDims  # noqa: E402
from megafp8.precision import GemmLayer, PrecisionRecipe  # noqa: E402
from megafp8.train.build import build_model, build_optimizer  # noqa: E402

from train_step import MODELS  # noqa: E402


def build(model: str, fuse: bool, device: torch.device):
    """The model's FP8 layers, its optimizer (weights quantized by the update if `fuse`) and random gradients."""
    cfg = load_config(None, MODELS[model] + ["precision.recipe=fp8", "optimizer.lr=3e-4", "optimizer.warmup_steps=0"])
    recipe = PrecisionRecipe.from_config(cfg.precision)
    dims = ParallelDims.single()
    torch.manual_seed(0)
    net = build_model(cfg, cfg.model, recipe, device, tp=dims.tensor_parallel, ep=dims.expert_parallel)
    optimizer = build_optimizer(net, cfg, dims)
    if not fuse:
        optimizer.quantize_weights_in_update([])
    layers = [m for m in net.modules() if isinstance(m, GemmLayer) and m.runs_fp8]
    g = torch.Generator(device=device).manual_seed(1)
    for bucket in optimizer.buckets.buckets:
        bucket.grads_flat.normal_(0.0, 1e-3, generator=g)
    return net, optimizer, layers


def quantize_all(layers) -> None:
    """What the first forward after a step does for each FP8 layer: quantize its weight if it changed."""
    for layer in layers:
        fp8 = layer.recipe.fp8
        layer.fp8_cache.get(layer.weight, layer.fp8_backend_for(layer.weight.device), fp8.fmt,
                            fp8.power_of_two_scales)


def time_steps(optimizer, layers, iters: int) -> tuple[list[float], int]:
    """GPU ms of each step + quantizations (after one untimed, which fills the caches and compiles the kernels),
    and how many layers the forward quantized in the last step."""
    quantize_all(layers)
    optimizer.clip_grad_norm()
    optimizer.step(3e-4)
    quantize_all(layers)
    times = []
    for _ in range(iters):
        optimizer.clip_grad_norm()
        before = sum(layer.fp8_cache.quantize_count for layer in layers)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        optimizer.step(3e-4)
        counts = sum(layer.fp8_cache.quantize_count for layer in layers)
        quantize_all(layers)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        by_forward = sum(layer.fp8_cache.quantize_count for layer in layers) - counts
        assert sum(layer.fp8_cache.quantize_count for layer in layers) - before == len(layers)
    return times, by_forward


def state(optimizer, layers) -> list[torch.Tensor]:
    tensors = [t for s in optimizer.shards for t in (s.master, s.exp_avg, s.exp_avg_sq)]
    tensors += [b.params_flat for b in optimizer.buckets.buckets]
    tensors += [t for layer in layers for t in layer.fp8_cache.entry.tensors() if t is not None]
    return tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                              b.reshape(-1).contiguous().view(torch.uint8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["8b-layers"], choices=[m for m in MODELS if m != "config"])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| model | FP8 layers | update, then the forward quantizes (ms) | update quantizes (ms) | saved | "
          "same bits |")
    print("|---|---|---|---|---|---|")
    for model in args.model:
        medians, states, quantized = {}, {}, {}
        for fuse in (False, True):
            net, optimizer, layers = build(model, fuse, device)
            times, by_forward = time_steps(optimizer, layers, args.iters)
            medians[fuse], states[fuse], quantized[fuse] = statistics.median(times), state(optimizer, layers), \
                by_forward
            num_layers = len(layers)
            del net, optimizer, layers
            torch.cuda.empty_cache()
        assert quantized[False] > 0 and quantized[True] == 0, quantized  # who quantized in the timed steps
        same = len(states[True]) == len(states[False]) and all(map(same_bits, states[True], states[False]))
        print(f"| {model} | {num_layers} | {medians[False]:.2f} | {medians[True]:.2f} | "
              f"{medians[False] - medians[True]:.2f} ms ({1 - medians[True] / medians[False]:.1%}) | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
