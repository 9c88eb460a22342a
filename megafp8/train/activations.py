"""Activation memory of one micro-batch: what each block keeps for backward, tensor by tensor, and the head's peak.

The count reads one pipeline rank's model built on the meta device (`megafp8.train.plan`): its tensor-parallel and
expert shards, and each GEMM layer's precision under the FP8 layer plan. Nothing is fitted to measured figures: each
term below is a tensor that an autograd node of the eager step keeps (`tests/test_plan_activations.py` measures them
on CPU with `saved_tensors_hooks` and holds this count to them). Notation: `n` tokens of the micro-batch (B x T, the
rows inside tensor-parallel regions), `m` of them in this rank's residual stream (n / tp under sequence
parallelism), `a` bytes per activation element (2; 4 under the FP32 recipe). "x^T in FP8" is an FP8 linear's copy of
its input for the weight gradient: 1x128 tiles along the tokens, 1 + 4/128 bytes per element, the tokens padded to
whole tiles (all n of them: under SP the FP8 bytes are all-gathered).

- RMSNorm run on its own keeps its FP32 input copy (m x width x 4; CUDA's fused `rms_norm` reads it in backward) and
  its inverse RMS (m x 4). An FP8 layer that takes the norm into its quantizer keeps the BF16 input instead.
- A linear keeps its input: BF16, the input itself (under SP the all-gathered copy, n rows); FP8, x^T in FP8.
- GQA attention: the rotated q and k and v's own copy (n x (q + 2 kv) widths: no view keeps the QKV output),
  the attention output (the flash kernel writes it (B, T, heads, dim): the output projection's input is a view of
  it) and the FP32 logsumexp (n x heads).
- MLA: the normed input, each projection's input (the down projections on the m local rows), the q_a and kv_a
  norms, v's own copy of its part of kv_b's output, the concatenated q and k, the attention output and logsumexp.
- SwiGLU, eager and unfused (BF16): the gate/up output gu (n x 2F), silu(gate) (n x F) and the product (n x F, the
  down projection's input). The fused FP8 SwiGLU (`megafp8.precision.fp8_mlp`) keeps gu and x^T in FP8 only.
- MoE: the norm; the router's FP32 input copy, its FP32 scores (m x experts), the chosen experts and their weights;
  the routing map; the balance loss's probabilities (when `aux_loss_coeff` > 0). The routed experts see m x top_k
  rows on average (under EP the rows a rank receives, assuming balanced routing): BF16 keeps the gathered rows, gu,
  silu(gate) and the product; the fused FP8 experts keep x^T in FP8 and gu in the padded expert layout (each
  expert's rows from a 128-row boundary, sized by its upper bound, rows + local experts x 127). The combine keeps
  the experts' output rows. Shared experts are a SwiGLU without a norm.
- The head (on the rank holding the last stage, once per loss: the main one and each MTP depth): the final norm,
  the LM head's BF16 input, and the loss's logits (n x vocab / tp, BF16, which `parallel.cross_entropy` reads again
  in backward) with 13 bytes per token. Its transient: the logits' gradient in their dtype.

Context parallelism (`parallel.cp`): the rows are the rank's share of each sequence (n = B x T / cp), and
attention keeps the keys and values gathered from the group (the whole sequences': n x cp rows) and, beside its
two chunks' outputs, their join (the output projection's input).

`training.compile`: Inductor's partitioner recomputes pointwise ops in backward instead of keeping their results,
and two such differences are modelled (measured on CPU, where they match the compiled blocks on an H200): a norm
keeps its input in the activation dtype, not the FP32 copy, and an unfused SwiGLU does not keep silu(gate). The FP8
functions are custom ops the partitioner cannot look into: compiled FP8 blocks keep what eager ones do.

Not counted: index maps held on autograd contexts rather than saved (int64, a few bytes per routed row), norm
weights' FP32 copies, the embedding's token ids, and the FP8-health steps (every `logging.fp8_health_interval`
steps the first micro-batch runs uncompiled, the experts' fused MLP as two grouped linears).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch.nn as nn

from megafp8.config import Config
from megafp8.model import Block, Transformer
from megafp8.model.attention import Attention
from megafp8.model.mla import MultiHeadLatentAttention
from megafp8.model.mlp import SwiGLU
from megafp8.model.moe import MoE, RoutedExperts
from megafp8.model.mtp import MtpModule
from megafp8.model.norm import RMSNorm
from megafp8.parallel import ColumnParallelLinear, ParallelLinear
from megafp8.precision import TILE

FP32_BYTES = 4
INDEX_BYTES = 8  # int64 token and row indices
FP8_TILED_BYTES = 1 + FP32_BYTES / TILE  # an FP8 byte per element plus one FP32 scale per 1x128 tile


@dataclass(frozen=True)
class MicroBatch:
    """The rows one micro-batch puts through a block on this rank, and how the blocks run."""

    tokens: int  # n: B x T / cp, the rows inside tensor-parallel regions (all-gathered under SP)
    local: int  # m: the residual stream's rows on this rank (tokens / tp under SP)
    compiled: bool  # `training.compile`: pointwise results are recomputed in backward
    cp: int = 1  # context-parallel ranks sharing each sequence (attention keeps the gathered keys and values)

    @classmethod
    def of(cls, cfg: Config) -> "MicroBatch":
        cp = cfg.parallel.cp
        tokens = cfg.training.micro_batch_size * cfg.data.seq_len // cp
        sp = cfg.parallel.sequence_parallel and cfg.parallel.tp > 1
        return cls(tokens, tokens // cfg.parallel.tp if sp else tokens, cfg.training.compile, cp)


@dataclass
class Saved:
    """Tensors kept for backward, by name: a tensor kept by several nodes (a view, the input of two layers) is one
    entry."""

    tensors: dict[str, float] = field(default_factory=dict)

    def keep(self, name: str, nbytes: float) -> None:
        self.tensors[name] = float(nbytes)

    @property
    def total(self) -> float:
        return sum(self.tensors.values())


def fp8_transposed(rows: int, cols: int) -> float:
    """Bytes of x^T in FP8 for x (rows, cols): 1x128 tiles along the rows (padded to whole tiles), FP32 scales."""
    return cols * -(-rows // TILE) * TILE * FP8_TILED_BYTES


def padded_expert_rows(rows: int, local_experts: int) -> int:
    """Rows of the FP8 experts' padded layout: each expert's rows from a 128-row boundary, sized on the host by its
    upper bound (`megafp8.precision.grouped.expert_rows` with device counts)."""
    return (rows + local_experts * (TILE - 1)) // TILE * TILE


def _act_bytes(norm: RMSNorm) -> int:
    return norm.weight.dtype.itemsize  # the recipe's activation dtype


def _norm(saved: Saved, name: str, rows: int, width: int, act: int, mb: MicroBatch,
          input_name: str, input_bytes: Optional[float] = None) -> None:
    """An RMSNorm run on its own: the FP32 copy of its input and the inverse RMS; compiled (or under FP32, where the
    copy is the input), the input `input_name` itself (`input_bytes`: its storage, where it is a view of more)."""
    if mb.compiled or act == FP32_BYTES:
        saved.keep(input_name, input_bytes if input_bytes is not None else rows * width * act)
    else:
        saved.keep(f"{name}.input_fp32", rows * width * FP32_BYTES)
    saved.keep(f"{name}.rstd", rows * FP32_BYTES)


def _gathered_rows(layer: ParallelLinear, rows: int, mb: MicroBatch) -> int:
    """Rows a linear multiplies: a column-parallel layer all-gathers the tokens under sequence parallelism."""
    return mb.tokens if isinstance(layer, ColumnParallelLinear) and layer.tp.sp else rows


def _linear_input(saved: Saved, layer: ParallelLinear, name: str, input_name: str, rows: int, width: int,
                  act: int, mb: MicroBatch) -> None:
    """What a linear keeps of its (rows, width) input `input_name`: x^T in FP8, or the BF16 input (all-gathered)."""
    gathered = _gathered_rows(layer, rows, mb)
    if layer.runs_fp8:
        saved.keep(f"{name}.input_fp8", fp8_transposed(gathered, width))
    elif gathered != rows:
        saved.keep(f"{name}.input_gathered", gathered * width * act)
    else:
        saved.keep(input_name, rows * width * act)


def _normed_input(saved: Saved, prefix: str, layer: ParallelLinear, norm: RMSNorm, mb: MicroBatch) -> None:
    """The norm of the residual stream and `layer`'s input: an FP8 layer that fuses the norm keeps the residual, the
    inverse RMS and x^T in FP8; otherwise the norm and the linear keep theirs."""
    width, act = norm.weight.shape[0], _act_bytes(norm)
    if layer.fuses_norm(mb.local):
        saved.keep(f"{prefix}.residual", mb.local * width * act)
        saved.keep(f"{prefix}.norm.rstd", mb.local * FP32_BYTES)
        saved.keep(f"{prefix}.input_fp8", fp8_transposed(_gathered_rows(layer, mb.local, mb), width))
        return
    _norm(saved, f"{prefix}.norm", mb.local, width, act, mb, f"{prefix}.residual")
    _linear_input(saved, layer, prefix, f"{prefix}.normed", mb.local, width, act, mb)


def _attention_output(saved: Saved, prefix: str, out_proj: ParallelLinear, heads: int, width: int, act: int,
                      mb: MicroBatch) -> None:
    """SDPA's output (n, width) and FP32 logsumexp, and the output projection's input (a view of that output;
    under context parallelism the two chunks' outputs joined, a copy)."""
    saved.keep(f"{prefix}.attention_out", mb.tokens * width * act)
    saved.keep(f"{prefix}.logsumexp", mb.tokens * heads * FP32_BYTES)
    if mb.cp > 1:
        saved.keep(f"{prefix}.attention_out_chunks", mb.tokens * width * act)
    _linear_input(saved, out_proj, f"{prefix}.out_proj", f"{prefix}.attention_out", mb.tokens, width, act, mb)


def _gqa(saved: Saved, attn: Attention, norm: RMSNorm, mb: MicroBatch) -> None:
    act, n = _act_bytes(norm), mb.tokens
    _normed_input(saved, "attn", attn.qkv_proj, norm, mb)
    q_width, kv_width = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    if attn.q_norm is not None:  # per head, on views of the QKV projection's output (compiled: that output itself)
        qkv_bytes = n * (q_width + 2 * kv_width) * act
        _norm(saved, "attn.q_norm", n * attn.n_heads, attn.head_dim, act, mb, "attn.qkv_out", qkv_bytes)
        _norm(saved, "attn.k_norm", n * attn.n_kv_heads, attn.head_dim, act, mb, "attn.qkv_out", qkv_bytes)
    saved.keep("attn.q_rotated", n * q_width * act)
    # Under context parallelism the keys and values gathered from the group: the whole sequences' (n x cp).
    saved.keep("attn.k_rotated", n * mb.cp * kv_width * act)
    saved.keep("attn.v", n * mb.cp * kv_width * act)  # its own copy: the QKV output itself is not kept
    _attention_output(saved, "attn", attn.out_proj, attn.n_heads, q_width, act, mb)


def _mla(saved: Saved, attn: MultiHeadLatentAttention, norm: RMSNorm, mb: MicroBatch) -> None:
    act, m, n = _act_bytes(norm), mb.local, mb.tokens
    hidden, heads = norm.weight.shape[0], attn.n_heads
    _norm(saved, "attn.norm", m, hidden, act, mb, "attn.residual")  # MLA applies its norm itself: never fused
    if hasattr(attn, "q_proj"):
        _linear_input(saved, attn.q_proj, "attn.q_proj", "attn.normed", m, hidden, act, mb)
    else:
        q_rank = attn.q_a_norm.weight.shape[0]
        _linear_input(saved, attn.q_a_proj, "attn.q_a", "attn.normed", m, hidden, act, mb)
        _norm(saved, "attn.q_a_norm", m, q_rank, act, mb, "attn.q_a_out")
        _linear_input(saved, attn.q_b_proj, "attn.q_b", "attn.q_a_normed", m, q_rank, act, mb)
    _linear_input(saved, attn.kv_a_proj, "attn.kv_a", "attn.normed", m, hidden, act, mb)
    # The compressed kv is a view of kv_a's output, which holds the rotary key too.
    _norm(saved, "attn.kv_a_norm", m, attn.kv_rank, act, mb, "attn.kv_a_out", m * (attn.kv_rank + attn.rope_dim) * act)
    _linear_input(saved, attn.kv_b_proj, "attn.kv_b", "attn.kv_normed", m, attn.kv_rank, act, mb)
    qk_width = heads * (attn.nope + attn.rope_dim)
    saved.keep("attn.v", n * mb.cp * heads * attn.v_dim * act)  # its own copy: kv_b's output itself is not kept
    saved.keep("attn.q", n * qk_width * act)
    saved.keep("attn.k", n * mb.cp * qk_width * act)  # under context parallelism, gathered (the whole sequences')
    _attention_output(saved, "attn", attn.out_proj, heads, heads * attn.v_dim, act, mb)


def _fused_fp8_swiglu(mlp: SwiGLU, rows: int) -> bool:
    """Whether `swiglu_mlp` runs this MLP as one fused FP8 function (its condition)."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    return gate_up.fuses_norm(rows) and down.runs_fp8 and down.recipe.fp8 == gate_up.recipe.fp8


def _swiglu(saved: Saved, prefix: str, mlp: SwiGLU, norm: Optional[RMSNorm], input_name: str, act: int,
            mb: MicroBatch) -> None:
    """A dense SwiGLU on this rank's m rows (of `norm` of them, where given): its input, gu, and unfused, silu(gate)
    (eager only) and the down projection's input."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    ffn, hidden = down.weight.shape[1], gate_up.weight.shape[1]  # this rank's FFN width
    if norm is not None:
        _normed_input(saved, prefix, gate_up, norm, mb)
    else:
        _linear_input(saved, gate_up, f"{prefix}.gate_up", input_name, mb.local, hidden, act, mb)
    rows = _gathered_rows(gate_up, mb.local, mb)
    saved.keep(f"{prefix}.gate_up_out", rows * 2 * ffn * act)  # kept whole: gate and up are views of it
    if _fused_fp8_swiglu(mlp, mb.local):
        return
    if not mb.compiled:
        saved.keep(f"{prefix}.silu", rows * ffn * act)
    _linear_input(saved, down, f"{prefix}.down", f"{prefix}.product", rows, ffn, act, mb)


def _routed_experts(saved: Saved, experts: RoutedExperts, rows: int, expert_parallel: bool, act: int,
                    mb: MicroBatch) -> None:
    """The routed experts' `rows` (tokens x top_k): fused FP8 in the padded layout, else two grouped linears around
    SwiGLU; and the rows the combine keeps."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    local_experts, two_ffn, hidden = gate_up.weight.shape
    ffn, padded = two_ffn // 2, padded_expert_rows(rows, local_experts)
    fp8 = gate_up.recipe.fp8
    if fp8 is not None and down.recipe.fp8 == fp8 and fp8.all_gemms:  # `RoutedExperts.forward`'s fused path
        saved.keep("experts.input_fp8", fp8_transposed(padded, hidden))
        saved.keep("experts.gate_up_out", padded * two_ffn * act)
        out_rows = padded
    else:
        for layer, name, width in ((gate_up, "experts.rows", hidden), (down, "experts.product", ffn)):
            saved.keep(f"{name}_fp8" if layer.runs_fp8 else name,
                       fp8_transposed(padded, width) if layer.runs_fp8 else rows * width * act)
        saved.keep("experts.gate_up_out", rows * two_ffn * act)
        if not mb.compiled:
            saved.keep("experts.silu", rows * ffn * act)
        out_rows = rows
    # Under EP the combine keeps the rows the all-to-all brought back, unpadded.
    saved.keep("experts.output", (rows if expert_parallel else out_rows) * hidden * act)


def _moe(saved: Saved, moe: MoE, norm: RMSNorm, mb: MicroBatch) -> None:
    act, m, hidden = _act_bytes(norm), mb.local, norm.weight.shape[0]
    router = moe.router
    experts, top_k = router.num_experts, router.top_k
    _norm(saved, "mlp.norm", m, hidden, act, mb, "mlp.residual")
    # The router multiplies an FP32 copy of the normed tokens (the tokens themselves under FP32).
    saved.keep("mlp.normed" if act == FP32_BYTES else "moe.router_input_fp32", m * hidden * FP32_BYTES)
    saved.keep("moe.scores", m * experts * FP32_BYTES)
    saved.keep("moe.chosen", m * top_k * INDEX_BYTES)
    if router.norm_topk:
        saved.keep("moe.topk_scores", m * top_k * FP32_BYTES)
        saved.keep("moe.topk_sum", m * FP32_BYTES)
    saved.keep("moe.combine_weights", m * top_k * FP32_BYTES)
    saved.keep("moe.routing_map", m * top_k * INDEX_BYTES)
    if moe.aux_coeff > 0:  # the sequence-wise balance loss (training)
        saved.keep("moe.balance_probs", m * experts * FP32_BYTES)
        saved.keep("moe.balance_index", m * (INDEX_BYTES + FP32_BYTES))
    _routed_experts(saved, moe.experts, m * top_k, moe.ep.enabled, act, mb)
    if moe.shared is not None:
        _swiglu(saved, "moe.shared", moe.shared, None, "mlp.normed", act, mb)


def block_saved(block: Block, mb: MicroBatch) -> Saved:
    """The tensors one transformer block keeps for backward for one micro-batch."""
    saved = Saved()
    if isinstance(block.attn, MultiHeadLatentAttention):
        _mla(saved, block.attn, block.attn_norm, mb)
    else:
        _gqa(saved, block.attn, block.attn_norm, mb)
    if isinstance(block.mlp, MoE):
        _moe(saved, block.mlp, block.mlp_norm, mb)
    else:
        _swiglu(saved, "mlp", block.mlp, block.mlp_norm, "mlp.residual", _act_bytes(block.mlp_norm), mb)
    return saved


def mtp_saved(module: MtpModule, mb: MicroBatch) -> Saved:
    """An MTP depth's norms, combining projection and block (its head and loss: `head_bytes`)."""
    saved = block_saved(module.block, mb)
    act, hidden = _act_bytes(module.hidden_norm), module.hidden_norm.weight.shape[0]
    eager = dataclasses.replace(mb, compiled=False)  # only the block is compiled
    for name in ("mtp.hidden_norm", "mtp.embed_norm"):
        _norm(saved, name, mb.local, hidden, act, eager, f"{name}.input")
    _linear_input(saved, module.combine_proj, "mtp.combine", "mtp.combined", mb.local, 2 * hidden, act, eager)
    return saved


def block_backward_bytes(block: Block, mb: MicroBatch) -> float:
    """The gradients one block's backward holds at once beyond what it keeps, estimated as the larger of SwiGLU's
    (gu's gradient with silu's and the product's: 3 x FFN wide, on the dense, shared or routed rows) and attention's
    (dq, dk, dv and their concatenation: twice the QKV width)."""
    act, n = _act_bytes(block.attn_norm), mb.tokens
    attn = block.attn
    if isinstance(attn, MultiHeadLatentAttention):
        qkv_width = attn.n_heads * (2 * (attn.nope + attn.rope_dim) + attn.v_dim)
    else:
        qkv_width = (attn.n_heads + 2 * attn.n_kv_heads) * attn.head_dim
    sizes = [2 * n * qkv_width * act]
    mlps: list[tuple[nn.Module, int]] = []
    if isinstance(block.mlp, MoE):
        mlps.append((block.mlp.experts.down_proj, mb.local * block.mlp.router.top_k))
        if block.mlp.shared is not None:
            mlps.append((block.mlp.shared.down_proj, n))
    else:
        mlps.append((block.mlp.down_proj, n))
    sizes += [rows * 3 * down.weight.shape[-1] * act for down, rows in mlps]
    return float(max(sizes))


@dataclass(frozen=True)
class HeadBytes:
    """The final norm, LM head and loss of every loss on this rank (the main one and each MTP depth)."""

    saved: float  # kept for backward until the head's backward
    transient: float  # the logits' and loss's largest temporaries, on top of `saved`, counted once


def head_bytes(model: Transformer, mb: MicroBatch) -> HeadBytes:
    """What the head and its losses keep and the largest transient of computing them (zero without a head)."""
    if not model.has_head:
        return HeadBytes(0.0, 0.0)
    mb = dataclasses.replace(mb, compiled=False)  # the head runs eagerly (only blocks are compiled)
    norms = [model.final_norm] + [module.out_norm for module in model.mtp]
    act, hidden = _act_bytes(model.final_norm), model.final_norm.weight.shape[0]
    vocab = model.lm_head.weight.shape[0]  # this rank's vocabulary
    saved = Saved()
    for i, _ in enumerate(norms):
        _norm(saved, f"head{i}.norm", mb.local, hidden, act, mb, f"head{i}.input")
        _linear_input(saved, model.lm_head, f"head{i}.lm_head", f"head{i}.normed", mb.local, hidden, act, mb)
        # `parallel.cross_entropy`: the logits, read again by the loss's backward; per token the targets on this
        # rank's columns (int64), the log-sum-exp (FP32) and the mask of counted targets (bool)
        saved.keep(f"head{i}.logits", mb.tokens * vocab * act)
        saved.keep(f"head{i}.targets", mb.tokens * (INDEX_BYTES + FP32_BYTES + 1))
    # Forward makes three FP32 numbers a token beside the kept logits; backward writes the logits' gradient in their
    # dtype (under TP too: the all-reduces move per-token numbers only).
    return HeadBytes(saved.total, float(mb.tokens * vocab * act))


def rank_activations(model: Transformer, mb: MicroBatch, recompute: int, in_flight: float) -> dict[str, float]:
    """Activation bytes of one pipeline rank's `model` (its layers, and the MTP modules and head where it holds the
    last stage) with `in_flight` micro-batches held at once: the blocks' kept tensors, the head's, and the largest
    transient on top, counted once. The first `recompute` blocks in forward order (layers, then MTP blocks:
    `apply_recompute`'s) keep only their inputs; such a block's working set exists while it is recomputed in
    backward, after the head's backward has freed what the head kept, so it counts where it is larger than the head's
    peak."""
    mtp = list(model.mtp) if model.has_head else []
    blocks = list(model.layers.values()) + [module.block for module in mtp]
    kept = [block_saved(block, mb).total for block in model.layers.values()] + [mtp_saved(m, mb).total for m in mtp]
    gradients = max((block_backward_bytes(block, mb) for block in blocks), default=0.0)
    head = head_bytes(model, mb)
    recomputed, keeping = kept[:recompute], kept[recompute:]
    inputs = sum(mb.local * b.attn_norm.weight.shape[0] * _act_bytes(b.attn_norm) for b in blocks[:recompute])
    stored = (inputs + sum(keeping)) * in_flight
    transient = head.transient
    if recomputed:
        transient = max(transient, max(recomputed) + gradients - head.saved)
    if keeping:
        transient = max(transient, gradients)
    return {"activations": stored, "logits_and_loss": head.saved, "transient_peak": transient}
