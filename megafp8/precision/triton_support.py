"""Where the package's Triton kernels outside the FP8 backends run (the loss's and the router's in
`megafp8.parallel`, the BF16 experts' weight-gradient add in `megafp8.precision.grouped`): CUDA GPUs of compute
capability 8.0 and up, the range our Triton kernels are tested on, as the fused optimizer update (the FP16 recipe's
V100s and T4s run the pure-torch twins); not ROCm; only with Triton installed (imported lazily: CPU-only installs
never need it)."""
from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache  # asked at every loss and routing
def triton_runs_on(device: torch.device) -> bool:
    """Whether this package's Triton kernels run on `device` (a CUDA device)."""
    return (torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 0)
            and importlib.util.find_spec("triton") is not None)
