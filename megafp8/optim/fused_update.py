"""One kernel per shard for the optimizer's update on CUDA: the clipping scale, AdamW and the cast of the updated
FP32 master into the model's weights, each element read and written once.

Unfused, a step passes over every parameter four times after the norm: `_foreach_mul_` scales the gradients (read
and write, 8 bytes a parameter), torch's fused AdamW reads the master, gradient and moments and writes them back (28
bytes), and the publish copies the master into the model's BF16 weights (6 bytes). This kernel does the same in 30
bytes (the scaled gradient is not written back: nothing reads it after the step), 12 fewer a parameter.

Its arithmetic is torch's fused AdamW's on CUDA as its source reads in torch 2.13
(`aten/src/ATen/native/cuda/fused_adam_utils.cuh`, ADAMW mode, FP32 operands), operation for operation: every scalar
rounded to FP32; the decay `param -= lr * weight_decay * param` as one FMA; both moments as torch's two nested FMAs;
the bias corrections `1 - beta**step` from CUDA's `powf`, which this module has torch's own pow kernel compute on
the device (`bias_corrections`); square root and divisions correctly rounded; the clipping scale as the FP32
multiply `_foreach_mul_` does. A GPU test holds it to the unfused path's bits (`tests/test_optim.py`): a torch
release that changes its kernel's arithmetic fails it. The kernel runs on CUDA only (Triton, imported lazily);
elsewhere the unfused path runs.

With BF16 moments (`optimizer.moment_dtype: bf16`, as DeepSeek-V3) the kernel reads them widened to FP32, computes
the same FP32 update, and rounds the new moments to BF16 (to nearest) when it stores them, as the unfused path
(`DistributedAdamW._step_shard`) does. That path computes in FP32 with torch's element-wise ops (a lerp for the
first moment, FP32(1 - beta) where the kernel has 1 - FP32(beta), the bias corrections in FP64 on the host), so the
two agree within BF16 rounding of the moments, not bit for bit. The kernel moves 22 bytes a parameter; by our count
the unfused path moves ~180 as the trainer calls it (with a device-side skip flag: a copy of the master, three
selects), ~118 without (FP32 copies of both moments, then one pass per operation).
"""
import functools
import importlib.util
import struct
from typing import Optional

import torch

_BLOCK = 1024


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_update_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, skip_ptr,
                            corrections_ptr, n, decay_end, lr: tl.float32, neg_lr_weight_decay: tl.float32,
                            beta1: tl.float32, beta2: tl.float32, eps: tl.float32, HAS_COEF: tl.constexpr,
                            HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        param = tl.load(master_ptr + offs, mask=mask, other=0.0)
        skipped = False
        if HAS_SKIP:  # callers pass 0.0 or 1.0 (torch's found_inf skips at exactly 1.0)
            skipped = tl.load(skip_ptr) != 0
        if not skipped:
            grad = tl.load(grad_ptr + offs, mask=mask, other=0.0)
            if HAS_COEF:
                grad = grad * tl.load(coef_ptr)  # as `_foreach_mul_(grads, coef)`
            # FP32 moments, or BF16 ones widened (exactly) to FP32
            exp_avg = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # param -= lr * weight_decay * param, contracted as nvcc does; only where the shard decays (torch skips
            # it at zero decay, where it would turn -0.0 into 0.0 and inf into nan). The negated product comes from
            # the host: Triton negates as 0 - x, which would give +0.0 for lr = 0 where torch has -0.0.
            param = tl.where(offs < decay_end, tl.fma(neg_lr_weight_decay, param, param), param)
            exp_avg = tl.fma(beta1, exp_avg, tl.fma(-beta1, grad, grad))
            grad_sq = grad * grad
            exp_avg_sq = tl.fma(beta2, exp_avg_sq, tl.fma(-beta2, grad_sq, grad_sq))
            step_size = tl.math.div_rn(lr, tl.load(corrections_ptr))
            bias_correction2_sqrt = tl.sqrt_rn(tl.load(corrections_ptr + 1))
            denom = tl.math.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
            param = param - tl.math.div_rn(step_size * exp_avg, denom)
            tl.store(master_ptr + offs, param, mask=mask)
            # BF16 moments are rounded (to nearest) only when stored: this step's update used them in FP32
            tl.store(exp_avg_ptr + offs, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
            tl.store(exp_avg_sq_ptr + offs, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + offs, param.to(out_ptr.dtype.element_ty), mask=mask)

    return adamw_update_kernel


@functools.cache  # asked at every clip and step
def fused_update_reason(device: torch.device) -> Optional[str]:
    """Why the fused update cannot run for tensors on `device` (None: it can)."""
    if device.type != "cuda":
        return f"the fused update is a CUDA kernel; on {device.type} the unfused passes run"
    if torch.version.hip is not None:  # its arithmetic follows torch's CUDA kernel, not the ROCm build's
        return "the fused update follows torch's CUDA fused AdamW; on ROCm the unfused passes run"
    if torch.cuda.get_device_capability(device) < (8, 0):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"the fused update is tested on compute capability 8.0 and up (Triton's supported range); on "
                f"{major}.{minor} the unfused passes run")
    if importlib.util.find_spec("triton") is None:
        return "the fused update needs Triton, which is not installed"
    return None


def bias_corrections(betas: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[1 - beta1**step, 1 - beta2**step], FP32 on the device, from `betas` (FP32, [beta1, beta2]) and the 0-d FP32
    `step`, both on that device. On CUDA torch's pow kernel calls the same `powf` as its fused AdamW, so the kernel
    gets that kernel's bias corrections without a host sync."""
    return 1 - torch.pow(betas, step)


def adamw_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  out: torch.Tensor, decay_end: int, corrections: torch.Tensor, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float, coef: Optional[torch.Tensor] = None,
                  skip: Optional[torch.Tensor] = None) -> None:
    """One shard's update in place: `master` (FP32, flat), `exp_avg` and `exp_avg_sq` (both FP32, or both BF16:
    computed in FP32, rounded when stored) updated from `grad` (FP32; times the 0-d FP32 `coef` when given), with
    weight decay on elements [0, decay_end), and `out` (the model's flat weights for this shard, any float dtype)
    set to the updated master. Where the 0-d `skip` is nonzero nothing is updated and `out` gets the master as it
    is. `corrections` from `bias_corrections`; with a weight decay of zero pass `decay_end=0`."""
    n = master.numel()
    for t in (grad, exp_avg, exp_avg_sq, out):
        assert t.numel() == n and t.is_contiguous() and t.device == master.device, "adamw_update_: mismatched shard"
    assert master.dtype == grad.dtype == torch.float32 and master.is_contiguous(), "adamw_update_: FP32 master, grad"
    assert exp_avg.dtype == exp_avg_sq.dtype in (torch.float32, torch.bfloat16), "adamw_update_: moment dtype"
    assert corrections.dtype == torch.float32 and corrections.numel() == 2, "adamw_update_: corrections"
    if n == 0:
        return
    _kernel()[(-(-n // _BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, out, coef if coef is not None else master,
        skip if skip is not None else master, corrections, n, min(max(decay_end, 0), n), lr,
        -(_fp32(lr) * _fp32(weight_decay)), beta1, beta2, eps, HAS_COEF=coef is not None, HAS_SKIP=skip is not None,
        BLOCK=_BLOCK)


def _fp32(value: float) -> float:
    """`value` rounded to FP32 (to nearest), as torch's kernel rounds its double arguments. The product of two such
    values is exact in a Python float, so its one rounding to FP32 at the launch is the device's FP32 multiply."""
    return struct.unpack("f", struct.pack("f", value))[0]
