"""Tensor-parallel GEMM-bearing layers (Megatron style) and the vocab-parallel embedding (the loss: `cross_entropy`).

Column-parallel linears split their output features across tensor-parallel ranks (QKV, MLP
gate/up, LM head); row-parallel linears split their input features and sum their outputs (attention
out, MLP down). Each is one autograd function in which quantize, collective and GEMM sit
together: under an FP8 recipe the column-parallel input is quantized on this rank's tokens
and the FP8 bytes are all-gathered (sequence parallelism), and the input-gradient reduction
overlaps the wgrad GEMM. BF16 layers compose the same collectives as autograd pairs.

Activations entering and leaving these layers are token-major `(tokens, features)`; under
sequence parallelism the tokens outside the TP regions are this rank's 1/tp share. At TP=1
every layer is a plain GEMM. Shard edges fall on 128-element tile edges, so an FP8 layer's
per-tile quantization at any TP is bit-identical to TP=1's.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from megafp8.parallel.collectives import (
    all_gather_quantized,
    all_gather_rows,
    all_reduce,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_rows,
    reduce_scatter_to_sp,
)
from megafp8.parallel.dims import TensorParallel
from megafp8.parallel.sharding import TpShard, mark_sharded
from megafp8.precision import (
    TILE,
    Fp8Backend,
    Fp8Projection,
    GemmLayer,
    InputNorm,
    LinearComm,
    MlpObserver,
    PrecisionRecipe,
    Rotary,
    fp8_linear,
    fp8_qkv_rope,
    fp8_swiglu_mlp,
    fuses_norm,
    linear,
)
from megafp8.precision.producers import rope_backward_fusable


def _check_split(what: str, size: int, tp: TensorParallel, whole_tiles: bool = True) -> None:
    """`size` splits evenly over the tensor-parallel ranks (into whole FP8 tiles unless `whole_tiles` is False:
    the vocabulary dimension of the BF16 embedding and LM head)."""
    if size % tp.size != 0:
        raise ValueError(f"{what} = {size} does not divide over {tp.size} tensor-parallel ranks")
    if whole_tiles and tp.enabled and (size // tp.size) % TILE != 0:
        raise ValueError(f"{what} = {size} gives {size // tp.size} per tensor-parallel rank, not a multiple of {TILE} "
                         "(shard edges must fall on FP8 tile edges)")


class _ColumnComm(LinearComm):
    """Input replicated (or all-gathered from SP token shards); input gradient all-reduced (or reduce-scattered)."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def gather_input(self, x2d):
        return all_gather_rows(x2d, self.tp) if self.tp.sp else x2d

    def gathers_quantized(self, rows):
        # Under SP each rank's rows must be whole 1x128 tiles along the tokens for x^T's tiles to be TP=1's.
        return not self.tp.sp or rows % TILE == 0

    def gather_quantized(self, x_fp8, x_scale, xt_fp8, xt_scale):
        if not self.tp.sp:
            return x_fp8, x_scale, xt_fp8, xt_scale
        return all_gather_quantized(x_fp8, x_scale, xt_fp8, xt_scale, self.tp)

    def start_reduce_grad_input(self, dx2d) -> Callable[[], torch.Tensor]:
        # Traced, a collective cannot be asynchronous (Dynamo refuses `async_op`): the graph waits for it right away,
        # so the reduction no longer overlaps the wgrad GEMM unless Inductor reorders the wait
        # (`reorder_for_compute_comm_overlap`, off by default). Eagerly it is awaited after the wgrad GEMM.
        async_op = not torch.compiler.is_compiling()
        if self.tp.sp:
            out, work = reduce_scatter_rows(dx2d, self.tp, async_op=async_op)
        else:
            out, work = dx2d, all_reduce(dx2d, self.tp, async_op=async_op)

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            return out
        return finish


class _RowComm(LinearComm):
    """Output partial sums all-reduced (or reduce-scattered to SP token shards); output gradient gathered under SP."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def reduce_output(self, y2d):
        if self.tp.sp:
            return reduce_scatter_rows(y2d, self.tp)[0]
        all_reduce(y2d, self.tp)
        return y2d

    def gather_grad_output(self, dy2d):
        return all_gather_rows(dy2d, self.tp) if self.tp.sp else dy2d


class ParallelLinear(GemmLayer):
    """A bias-free linear whose GEMMs follow the precision recipe; `weight` is this rank's shard. `fp8_backend`: as
    in `set_recipe`."""

    def __init__(self, in_features: int, out_features: int, recipe: PrecisionRecipe, weight_shape: tuple[int, int],
                 tp: TensorParallel, device=None, fp8_backend: Optional[Fp8Backend] = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.weight = nn.Parameter(torch.empty(weight_shape, dtype=recipe.param_dtype, device=device))
        self._comm: Optional[LinearComm] = None
        self.set_recipe(recipe, fp8_backend)

    def _fp8_forward(self, x: torch.Tensor, norm: Optional[InputNorm] = None) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.fp8_cache, self.recipe.fp8, self.fp8_backend_for(x.device), self._comm,
                          self.wgrad_queue, norm)

    def fp8_projection(self) -> Fp8Projection:
        """This layer as one projection of a fused FP8 MLP (`megafp8.precision.fp8_mlp`)."""
        return Fp8Projection(self.weight, self.fp8_cache, self._comm or LinearComm(), self.wgrad_queue)

    @staticmethod
    def gemm_input(inputs: tuple) -> torch.Tensor:
        """The tensor this layer's GEMM multiplies, from the positional inputs of a call (`x`, or `(x, norm)`:
        norm(x)); for hooks that observe it."""
        x, norm = inputs[0], (inputs[1] if len(inputs) > 1 else None)
        return norm(x) if norm is not None else x

    def fuses_norm(self, rows: int) -> bool:
        """Whether this layer takes an RMSNorm of its `rows`-row input into its FP8 quantizer (see `forward`)."""
        return self.runs_fp8 and fuses_norm(self.recipe.fp8, self._comm, rows)

    def extra_repr(self) -> str:
        shard = f", tp={self.tp.size}" if self.tp.enabled else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8={self.runs_fp8}{shard}"


class ColumnParallelLinear(ParallelLinear):
    """Output features split across tensor-parallel ranks. `parts`: sizes of fused outputs (e.g. q, k, v), each
    split on its own so every rank holds whole heads. `whole_tiles=False`: shards need not be whole FP8 tiles (a
    layer that never runs FP8: the LM head). `fp8_backend`: as in `set_recipe`."""

    def __init__(self, in_features: int, out_features: int, recipe: PrecisionRecipe,
                 tp: Optional[TensorParallel] = None, parts: Optional[Sequence[int]] = None, device=None,
                 whole_tiles: bool = True, fp8_backend: Optional[Fp8Backend] = None) -> None:
        tp = tp or TensorParallel.single()
        parts = tuple(parts) if parts is not None else (out_features,)
        if sum(parts) != out_features:
            raise ValueError(f"parts {parts} do not add up to out_features={out_features}")
        for part in parts:
            _check_split("out_features" if len(parts) == 1 else f"fused part of out_features {parts}", part, tp,
                         whole_tiles)
        super().__init__(in_features, out_features, recipe, (out_features // tp.size, in_features), tp, device,
                         fp8_backend)
        if tp.enabled:
            mark_sharded(self.weight, TpShard(0, parts))
            self._comm = _ColumnComm(tp)

    def forward(self, x: torch.Tensor, norm: Optional[InputNorm] = None) -> torch.Tensor:
        """x: (tokens, in) -> (all tokens, out / tp); under SP the input holds this rank's tokens only. `norm`: an
        RMSNorm to apply to x first; under FP8 its kernel quantizes its FP32 output for the GEMMs."""
        if self.tp.sp:
            x = x.reshape(-1, x.shape[-1])
        if norm is not None and self.fuses_norm(x.reshape(-1, x.shape[-1]).shape[0]):
            return self._fp8_forward(x, norm)
        if norm is not None:
            x = norm(x)
        if self.runs_fp8:
            return self._fp8_forward(x)
        return linear(gather_from_sp(x, self.tp) if self.tp.sp else copy_to_tp(x, self.tp), self.weight,
                      self.wgrad_queue, self.main_grad_slot)

    def fuses_rope(self, rows: int, rotary: Rotary) -> bool:
        """Whether this QKV projection runs as one FP8 function with its input's RMSNorm and RoPE on its queries and
        keys (`rotated`): its quantizer takes the norm of its `rows`-row input, and RoPE's backward can quantize
        its output gradient in one kernel (`producers.rope_backward_fusable`)."""
        return self.fuses_norm(rows) and rope_backward_fusable(rotary.widths, rotary.head_dim)

    def rotated(self, x: torch.Tensor, norm: InputNorm, rotary: Rotary, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """norm(x) projected (FP8), its queries and keys rotated by RoPE's `cos` and `sin` (seq_len, head_dim):
        (q, k, v), each (batch, seq_len, heads of this rank, head_dim). Where `fuses_rope`; under SP the input holds
        this rank's tokens, the outputs all of them (`megafp8.precision.fp8_qkv`)."""
        if self.tp.sp:
            x = x.reshape(-1, x.shape[-1])
        return fp8_qkv_rope(x, self.weight, self.fp8_cache, self.recipe.fp8, self.fp8_backend_for(x.device), rotary,
                            cos, sin, self._comm, self.wgrad_queue, norm)


class RowParallelLinear(ParallelLinear):
    """Input features split across tensor-parallel ranks; the outputs are summed (reduce-scattered under SP).
    `fp8_backend`: as in `set_recipe`."""

    def __init__(self, in_features: int, out_features: int, recipe: PrecisionRecipe,
                 tp: Optional[TensorParallel] = None, device=None, fp8_backend: Optional[Fp8Backend] = None) -> None:
        tp = tp or TensorParallel.single()
        _check_split("in_features", in_features, tp)
        super().__init__(in_features, out_features, recipe, (out_features, in_features // tp.size), tp, device,
                         fp8_backend)
        if tp.enabled:
            mark_sharded(self.weight, TpShard(1, (in_features,)))
            self._comm = _RowComm(tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (tokens, in / tp) -> (tokens, out), or this rank's 1/tp of the tokens under SP."""
        if self.tp.sp:
            x = x.reshape(-1, x.shape[-1])
        if self.runs_fp8:
            return self._fp8_forward(x)
        y = linear(x, self.weight, self.wgrad_queue, self.main_grad_slot)
        return reduce_scatter_to_sp(y, self.tp) if self.tp.sp else reduce_from_tp(y, self.tp)


def swiglu_mlp(x: torch.Tensor, gate_up: ColumnParallelLinear, down: RowParallelLinear,
               norm: Optional[InputNorm] = None, observer: Optional[MlpObserver] = None) -> torch.Tensor:
    """down(silu(gate) * up) with [gate | up] = gate_up(x), of `norm(x)` if a norm is given. Where both
    projections run all their GEMMs in FP8 under one recipe, it is one fused FP8 function in which the norm,
    SwiGLU and SwiGLU's backward each quantize their own FP32 output (`megafp8.precision.fp8_mlp`; `observer` sees
    its inner tensors); otherwise the layers run one after the other (their own hooks see theirs)."""
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    if gate_up.fuses_norm(rows) and down.runs_fp8 and down.recipe.fp8 == gate_up.recipe.fp8:
        if gate_up.tp.sp:
            x = x.reshape(-1, x.shape[-1])
        backend = gate_up.fp8_backend_for(x.device)
        down.fp8_backend_for(x.device)  # the same recipe: the same backend (resolved for both, as each layer logs it)
        return fp8_swiglu_mlp(x, gate_up.fp8_projection(), down.fp8_projection(), gate_up.recipe.fp8, backend, norm,
                              observer)
    gate, up = gate_up(x, norm).chunk(2, dim=-1)  # each (tokens, ffn_hidden_size / tp)
    return down(F.silu(gate) * up)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split across tensor-parallel ranks.

    Each rank looks up the tokens in its row range (zeros elsewhere); the partial embeddings are
    summed over TP (reduce-scattered to token shards under SP). Output is token-major (B*T, dim)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 tp: Optional[TensorParallel] = None, device=None) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel.single()
        _check_split("the vocabulary size (model.vocab_size)", num_embeddings, tp, whole_tiles=False)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = num_embeddings // tp.size
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, dtype=dtype, device=device))
        if tp.enabled:
            mark_sharded(self.weight, TpShard(0, (num_embeddings,)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.reshape(-1)
        if not self.tp.enabled:
            return F.embedding(tokens, self.weight)
        local = tokens - self.tp.rank * self.rows_per_rank
        outside = (local < 0) | (local >= self.rows_per_rank)
        partial = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(partial, self.tp) if self.tp.sp else reduce_from_tp(partial, self.tp)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}" + (f", tp={self.tp.size}" if self.tp.enabled else "")

