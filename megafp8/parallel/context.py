"""Context parallelism (`parallel.cp`): the ranks of a context-parallel group share each sequence's tokens.

The sequence is cut into 2 x cp equal chunks and rank r keeps chunks r and 2cp-1-r (the "zig-zag" order of
Megatron-LM's and torchtitan's context parallelism): under causal attention a chunk's work grows with its place in
the sequence, and each rank's pair of chunks then costs the same. Everything but attention is per token, so each
rank runs its own tokens only: 1/cp of the activations, the GEMMs and the loss.

Attention gathers the keys and values of the whole sequence from the group (an all-gather along the tokens, whose
backward reduce-scatters their gradients back; Llama 3's all-gather form of context parallelism, not a ring) and
attends each local chunk to the keys up to its own end, causally aligned to the bottom right (query i of chunk j
sees keys 0 .. j x chunk + i). On CUDA that is FlashAttention-2 (`aten._flash_attention_forward`, whose causal
mask is bottom-right aligned and which takes grouped-query heads as they are) or, where the key and value widths
differ (MLA), the memory-efficient kernel with its bottom-right causal mask; elsewhere the same arithmetic in plain
torch (`lower_right_attention_reference`, FP32 softmax), which the GPU test holds the kernels to. Both are
differentiable aten ops that `torch.compile` traces.

Context-parallel ranks are carved out of the data-parallel ones, innermost (`ParallelDims`): they hold the same
weights, so their gradients are reduced with the data-parallel group's, and the sequences they share count once in
the global batch.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megafp8.parallel.collectives import gather_from_sp
from megafp8.parallel.dims import ContextParallel


def natural_order(cp: int) -> list[int]:
    """For the chunks gathered rank by rank (rank 0's two, then rank 1's, ...), where each sequence chunk lies:
    entry j is the gathered index of chunk j."""
    where = [0] * (2 * cp)
    for rank in range(cp):
        first, second = rank, 2 * cp - 1 - rank
        where[first], where[second] = 2 * rank, 2 * rank + 1
    return where


def gather_sequence(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """(B, T / cp, ...) local tokens -> (B, T, ...) the whole sequences in order, from every rank of the group; its
    gradient goes back to each rank's own tokens, summed over the group."""
    if not cp.enabled:
        return x
    batch, local = x.shape[:2]
    rest = x.shape[2:]
    rows = x.transpose(0, 1).reshape(local, -1)  # tokens first (a view where x is one already): one all-gather
    gathered = gather_from_sp(rows, cp.collective_group())  # (cp x local, B x rest), rank by rank
    chunks = gathered.view(2 * cp.size, local // 2, -1)
    # In sequence order: one copy, its chunks picked by host-side indices (no index tensor to move to the device)
    ordered = torch.cat([chunks[i] for i in natural_order(cp.size)])
    return ordered.view(cp.size * local, batch, *rest).transpose(0, 1)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                      scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this rank's queries (B, T / cp, heads, dim), in its local chunk order, to the whole
    sequences' keys and values, given as this rank's (B, T / cp, kv heads, dim). Returns (B, T / cp, heads, v dim)."""
    kv_width = k.shape[-1]
    # One copy, tokens first, for one gather of both: `gather_sequence` then sends it without another copy.
    kv = torch.cat([k.transpose(0, 1), v.transpose(0, 1)], dim=-1).transpose(0, 1)
    kv = gather_sequence(kv, cp)  # (B, T, kv heads, dim + v dim): a view of the gathered tokens-first rows
    return attend_chunks(q, kv[..., :kv_width], kv[..., kv_width:], cp, scale)


def attend_chunks(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, cp: ContextParallel,
                  scale: Optional[float] = None) -> torch.Tensor:
    """This rank's two query chunks (B, T / cp, heads, dim) against the whole sequences' keys and values (B, T,
    kv heads, dim), each chunk seeing the keys up to its own end."""
    chunk = q.shape[1] // 2
    outs = []
    for i, j in enumerate(cp.chunks()):
        seen = (j + 1) * chunk  # keys up to this chunk's end
        outs.append(lower_right_attention(q[:, i * chunk:(i + 1) * chunk], k_all[:, :seen], v_all[:, :seen], scale))
    return torch.cat(outs, dim=1)


def lower_right_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention aligned to the bottom right: q (B, Lq, H, D) are the last Lq positions of the keys' Lk, so
    query i sees keys 0 .. Lk - Lq + i. k, v: (B, Lk, H_kv, D / Dv), H a multiple of H_kv. -> (B, Lq, H, Dv)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return lower_right_attention_reference(q, k, v, scale)
    lq, lk = q.shape[1], k.shape[1]
    if k.shape[-1] == v.shape[-1]:  # FlashAttention-2: bottom-right causal, grouped-query heads as they are
        return torch.ops.aten._flash_attention_forward(q, k, v, None, None, lq, lk, 0.0, True, False, scale=scale)[0]
    groups = q.shape[2] // k.shape[2]  # the memory-efficient kernel (MLA's narrower values) takes equal heads
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    else:  # contiguous: compiled, torch's shape rule for its backward gives the key's gradient the key's strides,
        k, v = k.contiguous(), v.contiguous()  # which the kernel does not write (H100, torch 2.11)
    return torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, lq, lk, 0.0, 2, torch.is_grad_enabled(), scale=scale)[0]  # 2: bottom-right causal


def lower_right_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    scale: Optional[float] = None) -> torch.Tensor:
    """`lower_right_attention` in plain torch: scores and softmax in FP32, the output in q's dtype."""
    lq, lk, heads, dim = q.shape[1], k.shape[1], q.shape[2], q.shape[-1]
    groups = heads // k.shape[2]
    kf = k.float().repeat_interleave(groups, dim=2)
    vf = v.float().repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * (dim ** -0.5 if scale is None else scale)
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(q.dtype)


class _AllReduceBoth(torch.autograd.Function):
    """Sum over the group forward and backward: a quantity every rank computes whole from every rank's partial
    sums, each rank's loss counting it once (its gradient reaches each rank's part from every rank)."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        x = x.clone()
        dist.all_reduce(x, group=cp.group)
        return x

    @staticmethod
    def backward(ctx, dy):
        dy = dy.clone()
        dist.all_reduce(dy, group=ctx.cp.group)
        return dy, None


def sum_over_context(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Per-sequence partial sums (e.g. the MoE balance loss's) summed over the ranks sharing the sequences."""
    return _AllReduceBoth.apply(x, cp) if cp.enabled else x


def share_of_group(count: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """cp x this rank's `count` / the group's total (a float scalar; no gradient): the weight that turns each rank's
    mean over its own items into its part of the group's mean over all of them, the ranks' results averaged."""
    if not cp.enabled:
        return torch.ones_like(count, dtype=torch.float32)
    total = count.detach().clone()
    dist.all_reduce(total, group=cp.group)
    return count.detach() * cp.size / total.clamp(min=1)
