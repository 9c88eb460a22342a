"""The optimizer update's Triton kernels (imported lazily by `megafp8.optim.fused_update`: CPU-only installs never
need Triton).

- `adamw_update_kernel`: the clipping scale, AdamW and the cast into the model's weights over a flat range.
- `adamw_update_quantize_kernel`: the same update over one weight (N, K) or stacked experts (E, N, K), a 128x128
  block a program, which then quantizes the block's new model weights (as just stored) into the layer's FP8 cache
  with `megafp8.precision.kernels.tiles.store_weight_block`, the standalone weight quantizer's code: the next
  forward's weight without a pass over the weights of its own.

Both compute each element with `adamw_elements`, so an element's bits do not depend on which kernel updated it.
"""
import triton
import triton.language as tl

from megafp8.precision.kernels import tiles


@triton.jit
def _load(ptr, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=mask, other=0.0)
    return tl.load(ptr)


@triton.jit
def _store(ptr, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, value, mask=mask)
    else:
        tl.store(ptr, value)


@triton.jit
def adamw_elements(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, corrections_ptr, offs, mask,
                   skipped, decayed, lr, neg_lr_weight_decay, beta1, beta2, eps, HAS_COEF: tl.constexpr,
                   MASKED: tl.constexpr):
    """Update the elements at `offs` (where `mask`, if MASKED) in place and store the model's weights at
    out_ptr + offs: torch's fused AdamW (CUDA, ADAMW mode, FP32) operation for operation; the elements where
    `decayed` (a tensor like `offs`, or one flag for all) decay. Where `skipped` nothing changes and the weights
    get the master as it is. Returns the weights as stored."""
    param = _load(master_ptr + offs, mask, MASKED)
    if not skipped:
        grad = _load(grad_ptr + offs, mask, MASKED)
        if HAS_COEF:
            grad = grad * tl.load(coef_ptr)  # as `_foreach_mul_(grads, coef)`
        # FP32 moments, or BF16 ones widened (exactly) to FP32
        exp_avg = _load(exp_avg_ptr + offs, mask, MASKED).to(tl.float32)
        exp_avg_sq = _load(exp_avg_sq_ptr + offs, mask, MASKED).to(tl.float32)
        # param -= lr * weight_decay * param, contracted as nvcc does; only where the shard decays (torch skips it
        # at zero decay, where it would turn -0.0 into 0.0 and inf into nan). The negated product comes from the
        # host: Triton negates as 0 - x, which would give +0.0 for lr = 0 where torch has -0.0.
        param = tl.where(decayed, tl.fma(neg_lr_weight_decay, param, param), param)
        exp_avg = tl.fma(beta1, exp_avg, tl.fma(-beta1, grad, grad))
        grad_sq = grad * grad
        exp_avg_sq = tl.fma(beta2, exp_avg_sq, tl.fma(-beta2, grad_sq, grad_sq))
        step_size = tl.math.div_rn(lr, tl.load(corrections_ptr))
        bias_correction2_sqrt = tl.sqrt_rn(tl.load(corrections_ptr + 1))
        denom = tl.math.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
        param = param - tl.math.div_rn(step_size * exp_avg, denom)
        _store(master_ptr + offs, param, mask, MASKED)
        # BF16 moments are rounded (to nearest) only when stored: this step's update used them in FP32
        _store(exp_avg_ptr + offs, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask, MASKED)
        _store(exp_avg_sq_ptr + offs, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask, MASKED)
    weights = param.to(out_ptr.dtype.element_ty)
    _store(out_ptr + offs, weights, mask, MASKED)
    return weights


@triton.jit
def _skipped(skip_ptr, HAS_SKIP: tl.constexpr):
    skipped = False
    if HAS_SKIP:  # callers pass 0.0 or 1.0 (torch's found_inf skips at exactly 1.0)
        skipped = tl.load(skip_ptr) != 0
    return skipped


@triton.jit
def adamw_update_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, skip_ptr,
                        corrections_ptr, n, decay_end, lr: tl.float32, neg_lr_weight_decay: tl.float32,
                        beta1: tl.float32, beta2: tl.float32, eps: tl.float32, HAS_COEF: tl.constexpr,
                        HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    adamw_elements(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, corrections_ptr, offs,
                   offs < n, _skipped(skip_ptr, HAS_SKIP), offs < decay_end, lr, neg_lr_weight_decay, beta1, beta2,
                   eps, HAS_COEF, True)


@triton.jit
def adamw_update_quantize_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, skip_ptr,
                                 corrections_ptr, lr: tl.float32, neg_lr_weight_decay: tl.float32,
                                 beta1: tl.float32, beta2: tl.float32, eps: tl.float32,
                                 q_ptr, s_ptr, qt_ptr, st_ptr, n_blocks, K, stride_qe, stride_qn, stride_qte,
                                 stride_qtk, stride_se, stride_sn, stride_sk, stride_ste, stride_stn, stride_stk,
                                 FP8_MAX: tl.constexpr, POW2: tl.constexpr, TRANSPOSE: tl.constexpr,
                                 DECAY: tl.constexpr, HAS_COEF: tl.constexpr, HAS_SKIP: tl.constexpr,
                                 ROWS: tl.constexpr):
    """One 128x128 block (nb, kb) of weight e of a row-major (E, N, K) range (the pointers start at it): the
    update, ROWS rows at a time, keeping the max-abs of the weights it stores; then the block's weights read back
    (this program's own stores, from L2) and quantized with that max-abs by the standalone weight quantizer's
    arithmetic (`tiles.tile_scale`, `tiles.to_fp8`), w^T too with TRANSPOSE. Streamed in chunks, never the whole
    block in registers: few registers a program, so that enough programs share an SM to keep the update's loads
    in flight (the whole block in registers took 222 a thread, one program an SM)."""
    e = (tl.program_id(1) // n_blocks).to(tl.int64)
    nb = tl.program_id(1) % n_blocks
    kb = tl.program_id(0)
    # The block's first element; within it, offsets in int32 (ROWS rows a chunk, flat: 2-D chunks made layout
    # conversions), so that a thread's addresses stay few registers
    first = e * n_blocks * 128 * K + (nb * 128).to(tl.int64) * K + kb * 128
    chunk = tl.arange(0, ROWS * 128)
    in_chunk = (chunk // 128) * K + chunk % 128
    skipped = _skipped(skip_ptr, HAS_SKIP)
    running_max = tl.zeros([ROWS * 128], tl.float32)
    for r in tl.range(0, 128, ROWS, num_stages=1):
        weights = adamw_elements(master_ptr + first, grad_ptr + first, exp_avg_ptr + first, exp_avg_sq_ptr + first,
                                 out_ptr + first, coef_ptr, corrections_ptr, r * K + in_chunk, None, skipped, DECAY,
                                 lr, neg_lr_weight_decay, beta1, beta2, eps, HAS_COEF, False)
        running_max = tiles.max_propagating_nan(running_max, tl.abs(weights.to(tl.float32)))
    tl.debug_barrier()  # the block's weights, stored by every thread of the program, are read back by others
    scale, inv = tiles.tile_scale(tiles.amax(running_max, 0), FP8_MAX, POW2)
    q_first = q_ptr + e * stride_qe + (nb * 128).to(tl.int64) * stride_qn + kb * 128
    if TRANSPOSE:  # 2-D chunks, each stored transposed too: w^T's 32 columns of 128 rows
        rows, cols = tl.arange(0, 32), tl.arange(0, 128)
        qt_first = qt_ptr + e * stride_qte + (kb * 128).to(tl.int64) * stride_qtk + nb * 128
        for r in tl.range(0, 128, 32, num_stages=1):
            w = tl.load(out_ptr + first + (r + rows)[:, None] * K + cols[None, :]).to(tl.float32)
            q = tiles.to_fp8(w, inv, FP8_MAX, q_ptr.dtype.element_ty)
            tl.store(q_first + (r + rows)[:, None] * stride_qn + cols[None, :], q)
            tl.store(qt_first + cols[:, None] * stride_qtk + (r + rows)[None, :], tl.trans(q))
        tl.store(st_ptr + e * stride_ste + kb * stride_stn + nb * stride_stk, scale)
    else:
        in_q = (chunk // 128) * stride_qn + chunk % 128
        for r in tl.range(0, 128, ROWS, num_stages=1):
            w = tl.load(out_ptr + first + r * K + in_chunk).to(tl.float32)
            tl.store(q_first + r * stride_qn + in_q, tiles.to_fp8(w, inv, FP8_MAX, q_ptr.dtype.element_ty))
    tl.store(s_ptr + e * stride_se + nb * stride_sn + kb * stride_sk, scale)
