"""Limits of the FP8 kernels that the host checks before a launch (no Triton needed to ask: the CPU tests and the
planner can import this where the kernels themselves cannot be)."""
from __future__ import annotations

import torch

INT32_OFFSETS = 2 ** 31  # offsets 0 .. 2^31 - 1


def check_offsets(what: str, *tensors: torch.Tensor) -> None:
    """Refuse, before any launch, tensors whose elements a quantizing kernel's int32 offsets cannot all address
    (row * stride + column past 2^31 would wrap around and read or write the wrong memory, silently). Weights
    stacked per expert pass their per-expert slice: the kernels index experts in int64."""
    for t in tensors:
        span = t.numel() if t.is_contiguous() else 1 + sum((size - 1) * stride
                                                            for size, stride in zip(t.shape, t.stride()) if size)
        if span > INT32_OFFSETS:
            raise ValueError(
                f"{what}: a {tuple(t.shape)} tensor spans {span:,} elements, past the 2^31 that the FP8 quantizing "
                f"kernels address; use fewer tokens per micro-batch (training.micro_batch_size or data.seq_len), "
                f"or for MoE more expert-parallel ranks")
