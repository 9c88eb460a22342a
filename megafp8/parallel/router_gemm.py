"""The MoE router's logits, x @ W^T in FP32 (the router is an FP32 island: DESIGN.md section 3), and their gradients.

The definition is the pure-torch twin (`router_logits_reference`): `F.linear(x.float(), W)` forward; backward, the
input's gradient grad @ W in FP32 rounded once to x's dtype, the weight's grad^T @ x in FP32, as autograd gives
them for that expression. On CUDA GPUs where the package's Triton kernels run (`triton_support`), the three GEMMs run
as one Triton FP32 kernel (`router_gemm_kernels`): IEEE FP32 products and sums as in the twin, in another order (as
any two FP32 GEMM libraries differ), reading the BF16 input as it is instead of an FP32 copy. cuBLAS's FP32 kernels
for these shapes took 2.45 ms of a 3.2B MoE step on an H100 (job IH). Traced by `torch.compile` as two custom ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megafp8.precision.triton_support import triton_runs_on


def router_logits_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The twin: (N, hidden) x, (E, hidden) FP32 weight -> (N, E) FP32 logits."""
    return F.linear(x.float(), weight)


def router_logits_backward_reference(grad: torch.Tensor, x: torch.Tensor,
                                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's gradients: (d x in x's dtype, d weight FP32) for the logits' gradient `grad` (N, E) FP32."""
    return (grad @ weight).to(x.dtype), grad.t() @ x.float()


def kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton kernel computes these: a CUDA 2-D input of 32 bits or fewer and an FP32 weight, on a GPU
    the package's Triton kernels run on."""
    return (x.is_cuda and x.dim() == 2 and x.element_size() <= 4 and x.is_floating_point()
            and weight.dtype == torch.float32 and triton_runs_on(x.device))


@torch.library.custom_op("megafp8::router_logits", mutates_args=())
def _logits_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if kernel_fits(x, weight):
        from megafp8.parallel import router_gemm_kernels

        return router_gemm_kernels.fp32_gemm(x, weight.t(), torch.float32)
    return router_logits_reference(x, weight)


@_logits_op.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("megafp8::router_logits_backward", mutates_args=())
def _logits_backward_op(grad: torch.Tensor, x: torch.Tensor,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel_fits(x, weight):
        from megafp8.parallel import router_gemm_kernels

        return (router_gemm_kernels.fp32_gemm(grad, weight, x.dtype),
                router_gemm_kernels.fp32_gemm(grad.t(), x, torch.float32))
    return router_logits_backward_reference(grad, x, weight)


@_logits_backward_op.register_fake
def _(grad, x, weight):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _logits_op(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dweight = _logits_backward_op(grad.float().contiguous(), x, weight)
        return dx, dweight


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(N, hidden) x (BF16 or FP32), (E, hidden) FP32 weight -> (N, E) FP32 logits x @ W^T, products and sums in
    FP32; the gradients as `router_logits_backward_reference` defines them."""
    return _RouterLogits.apply(x, weight)
