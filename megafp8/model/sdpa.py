"""Which kernel runs the attention core (`model.attention_backend`): one of SDPA's backends, chosen per device.

Left to itself, `F.scaled_dot_product_attention` picks a backend by heuristics that differ between torch versions and
between calls: on an H200 with torch 2.11 it ran cuDNN's kernels inside our models (judged by step times), but
FlashAttention-2 (and the memory-efficient kernel for MLA's heads) for the same shapes called alone. On Hopper
(compute capability 9.x) cuDNN's fused attention is the fastest for training shapes at the same numerics (softmax in
FP32 either way): forward + backward 1.7x FlashAttention-2 on our dense shapes and 9.5x the memory-efficient kernel
on MLA's (`benchmarks/attention.py`, `docs/benchmarks.md`, sixteenth session; whole steps did not change, torch
already ran cuDNN there). On Ampere and Blackwell it is reported slower (huggingface/transformers#48163: 0.82x on
an A100, 0.88x on an RTX PRO 6000 Blackwell), so it is preferred on Hopper only:

- `auto`: on Hopper, cuDNN first, then torch's order (FlashAttention-2, memory-efficient, math) for shapes cuDNN
  does not take; elsewhere torch's own order, unchanged.
- `torch`: torch's own order on every device (no preference set).
- `cudnn`, `flash`, `efficient`, `math`: that backend only. `cudnn` needs an NVIDIA GPU and `efficient` a GPU (a
  ConfigError at build time elsewhere); SDPA raises, after warning why, where a backend cannot run the shapes
  (e.g. `flash` with MLA's narrower values).

The choice is resolved once, for the device the model is built on (a model moved to another device afterwards
keeps it; the trainer builds on the device it trains on), and applied around each SDPA call with
`torch.nn.attention.sdpa_kernel`, which `torch.compile` traces (no graph break); Megatron-LM's `--attention-backend`
is the same kind of setting.
"""
from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Optional, Union, get_args

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megafp8.config.errors import ConfigError
from megafp8.config.schema import AttentionBackend

ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
_ONLY = MappingProxyType({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH})  # read-only
# cuDNN first; then torch's order for the shapes it does not take.
_HOPPER_ORDER = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH)

Backends = Optional[tuple[SDPBackend, ...]]  # in order of preference; None: torch's own order


def sdpa_backends(choice: str, device_type: str, capability: Optional[tuple[int, int]], hip: bool = False) -> Backends:
    """The SDPA backends `choice` (a `model.attention_backend` value) allows on a device of `device_type` with CUDA
    compute `capability` (None off CUDA), in order of preference; None leaves torch's order as it is."""
    if choice not in ATTENTION_BACKENDS:
        raise ConfigError(f"model.attention_backend={choice!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
    on_gpu = device_type in ("cuda", "meta")  # meta: a model built for its shapes only
    if (choice == "cudnn" and (not on_gpu or hip)) or (choice == "efficient" and not on_gpu):
        where = "a ROCm GPU" if on_gpu else device_type
        needs = "NVIDIA GPUs" if choice == "cudnn" else "GPUs"
        raise ConfigError(f"model.attention_backend={choice} runs on {needs} only, and this model is built on "
                          f"{where}: use `auto` (or `math`)")
    if choice == "torch":
        return None
    if choice == "auto":
        hopper = device_type == "cuda" and not hip and capability is not None and capability[0] == 9
        return _HOPPER_ORDER if hopper else None
    return (_ONLY[choice],)


def sdpa_backends_for(choice: str, device: Optional[Union[torch.device, str]]) -> Backends:
    """`sdpa_backends` for the device a module is built on (`device` None: torch's default device). A meta device
    (a model built for its shapes only) keeps torch's order."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return sdpa_backends(choice, device.type, capability, hip=torch.version.hip is not None)


def attention_kernels(backends: Backends) -> contextlib.AbstractContextManager:
    """The context to call SDPA in: `backends` preferred in their order, or nothing changed where None."""
    if backends is None:
        return contextlib.nullcontext()
    return sdpa_kernel(list(backends), set_priority=True)
