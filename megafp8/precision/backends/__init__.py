"""FP8 GEMM backends behind one narrow seam (`Fp8Backend`), and their registry.

- `reference`: any device; the definition (FP8 casts, then FP32 matmuls).
- `triton`: CUDA GPUs with FP8 tensor cores; our Triton quantizers, fused producers and GEMMs.
- `cublas`: SM90; cuBLASLt's blockwise-scaled GEMMs (`F.scaled_mm`) fed by the Triton quantizers, and cuBLASLt
  called directly for weight gradients added into `main_grad` (`megafp8.precision.kernels.cublaslt`).
- `hopper`: SM90 with Triton's Gluon; `cublas` with the experts' grouped GEMMs on the warp-specialized Gluon kernel
  (what `auto` picks where DeepGEMM is not installed).
- `deepgemm`: where DeepSeek's DeepGEMM is installed and passes its check; `hopper` with the dense fprop and dgrad
  on DeepGEMM's 1x128 x 128x128 kernel (what `auto` picks there).

A backend is one class: its `name`, its `priority` (`auto` picks the available backend of highest priority) and
`unavailable_reason(device)`. Adding one means writing the class, listing it in `REGISTERED`, and letting the
conformance test (`tests/test_fp8_backends.py`) check it against the reference.
"""
from __future__ import annotations

from typing import Optional

import torch

from megafp8.config import ConfigError
from megafp8.precision.backends.cublas_backend import CublasBackend
from megafp8.precision.backends.deepgemm_backend import DeepGemmBackend
from megafp8.precision.backends.hopper_backend import HopperBackend
from megafp8.precision.backends.reference import Fp8Backend, QuantizedWeight, StaleExperts
from megafp8.precision.backends.triton_backend import TritonBackend

REGISTERED: tuple[type[Fp8Backend], ...] = (Fp8Backend, TritonBackend, CublasBackend, HopperBackend, DeepGemmBackend)
AUTO = "auto"


def backend_names() -> tuple[str, ...]:
    """What `precision.fp8_backend` accepts: `auto` and every registered backend's name."""
    return (AUTO, *(cls.name for cls in REGISTERED))


def _backend_class(name: str) -> type[Fp8Backend]:
    for cls in REGISTERED:
        if cls.name == name:
            return cls
    raise ConfigError(f"precision.fp8_backend={name!r} is not a backend; choose one of {', '.join(backend_names())}")


def check_backend_name(name: str) -> None:
    """Raise a ConfigError naming the choices if `name` is neither `auto` nor a registered backend."""
    if name != AUTO:
        _backend_class(name)


def why_unavailable(name: str, device: torch.device) -> Optional[str]:
    """None if backend `name` can run on `device`, else the reason."""
    return _backend_class(name).unavailable_reason(device)


def passed_over(chosen: Fp8Backend, device: torch.device) -> list[tuple[str, str]]:
    """(name, reason) for each backend that `auto` would have preferred to `chosen` on `device` and that misses only
    a need of its own (the backend it extends runs here): what the start-up log says, so that a run on an H200
    which fell back to `hopper` says why `deepgemm` did not run (DeepGEMM not installed, or failing its check),
    while one on an older GPU is not told of every SM90 backend."""
    return [(cls.name, reason) for cls in REGISTERED
            if cls.priority > chosen.priority and issubclass(cls.__base__, Fp8Backend)
            and cls.__base__.unavailable_reason(device) is None
            and (reason := cls.unavailable_reason(device)) is not None]


def common_choice(names: list[str]) -> str:
    """The backend every rank can run, of the ones each rank's `auto` chose: the one of lowest priority (each
    backend extends the one below it, so a rank that runs one runs every backend below it)."""
    return min((_backend_class(name) for name in names), key=lambda cls: cls.priority).name


def backend_by_name(name: str) -> Fp8Backend:
    """A new object of the registered backend `name`, unchecked: for code that runs a backend `select_backend`
    already chose (the traced FP8 ops carry its name, not the object)."""
    return _backend_class(name)()


def select_backend(name: str, device: torch.device) -> Fp8Backend:
    """The backend `name` for `device` (`auto`: the available one of highest priority); an error says why one
    cannot run."""
    if name == AUTO:  # a plain loop: torch.compile traces it where a layer picks its backend in compiled code
        best = Fp8Backend
        for cls in REGISTERED:
            if cls.priority > best.priority and cls.unavailable_reason(device) is None:
                best = cls
        return best()
    cls = _backend_class(name)
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise ConfigError(f"{reason}: set precision.fp8_backend=auto or reference")
    return cls()


__all__ = ["REGISTERED", "Fp8Backend", "QuantizedWeight", "StaleExperts", "backend_by_name", "backend_names",
           "check_backend_name", "common_choice", "passed_over", "select_backend", "why_unavailable"]
