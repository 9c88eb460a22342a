"""The decoder: embedding -> pre-norm blocks (attention; SwiGLU or mixture of experts) -> final norm -> untied LM head.

Each block is built from its `megafp8.config.LayerSpec` (`layer_spec(cfg, i)`): its attention kind's module
(`ATTENTION_MODULES`) and a dense or MoE MLP."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megafp8.config import ConfigError, LayerSpec, ModelConfig, layer_spec, mtp_layer_spec
from megafp8.model.attention import Attention
from megafp8.model.compile_cache import keyed_to_this_code
from megafp8.model.mla import MultiHeadLatentAttention
from megafp8.model.mlp import SwiGLU
from megafp8.model.moe import MoE
from megafp8.model.mtp import LossTerms, MtpModule, shifted_inputs
from megafp8.model.norm import RMSNorm
from megafp8.model.rope import RotaryEmbedding
from megafp8.parallel import (
    IGNORE_INDEX,
    ColumnParallelLinear,
    ContextParallel,
    ExpertParallel,
    TensorParallel,
    VocabParallelEmbedding,
    gather_from_tp_last,
    gather_sequence,
    share_of_group,
    vocab_parallel_cross_entropy,
)
from megafp8.precision import GemmLayer, PrecisionRecipe

if TYPE_CHECKING:  # megafp8.parallel.pipeline imports torch's pipelining (a second at start-up): not at run time
    from megafp8.parallel.pipeline import StageSpec

# The module of each attention kind, built from the model config (`model.attention` holds the kind's settings; the
# kind's checks and counts are in megafp8/config/attention.py).
ATTENTION_MODULES: dict[str, type[nn.Module]] = {"gqa": Attention, "mla": MultiHeadLatentAttention}


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); the MLP is a SwiGLU or, in MoE layers, a mixture of experts."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, recipe: PrecisionRecipe, tp: TensorParallel,
                 ep: ExpertParallel, fp8_dispatch: bool, device=None, cp: Optional[ContextParallel] = None,
                 uncounted_tail: int = 0) -> None:
        """`uncounted_tail`: an MoE block's router leaves the last positions of each sequence out of its expert
        load (an MTP depth's positions without a target)."""
        super().__init__()
        dtype = recipe.param_dtype
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.attn = ATTENTION_MODULES[spec.attention.kind](cfg, recipe, tp, device, cp=cp)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.mlp = (MoE(spec.mlp, cfg.hidden_size, recipe, tp, ep, fp8_dispatch, device, cp, uncounted_tail)
                    if spec.is_moe
                    else SwiGLU(cfg.hidden_size, spec.mlp.ffn_hidden_size, recipe, tp, device))
        self.recompute = False  # set by `apply_recompute`
        self.prepared_linears: list[GemmLayer] = []  # set by `apply_compile`: the GEMM layers to prepare eagerly
        self.uncompiled_forward = None  # set by `apply_compile`: `_forward` as written, for observed steps
        # Set by `apply_compile`: `_forward` under activation checkpointing, compiled as one function, so that the
        # recomputation is part of the compiled backward (see `apply_compile`).
        self.compiled_recomputation = None
        # Set by `apply_compile` in modes with CUDA graphs (`reduce-overhead`, `max-autotune`): see
        # `_outside_the_graph_pool`.
        self.under_cuda_graphs = False
        # Set while hooks observe the block's layers (FP8 health): the block then runs uncompiled. Traced, the hooks
        # would break its graph, and torch.compile would keep the broken graph for every later step. A compiled block
        # observed also runs recomputed: uncompiled it would keep more for backward than its compiled code does (eager
        # element-wise ops keep their intermediates), and that one sampled step would set the run's peak memory.
        # (An eager block is not recomputed for it: that changes no peak, and recomputation may round the input
        # gradient's sum differently. A sampled step still differs from an unsampled one in FP8 wherever a layer
        # runs unfused to be observed, within one E4M3 step of the gradients' quantization: the QKV projection
        # without RoPE's backward quantizer, the MoE experts as two grouped linears.)
        self.observed = False

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: int,
                seq_len: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns the new residual stream and the MoE balance loss (None for a dense MLP). With `recompute` (and
        while a compiled block is `observed`), only the block's input is kept for backward, which runs the block's
        forward again first."""
        for layer in self.prepared_linears:  # eagerly, before compiled code reads their caches and main_grad aliases
            layer.prepare_for_compiled()
        observed_uncompiled = self.observed and self.uncompiled_forward is not None
        run = self.uncompiled_forward if observed_uncompiled else self._forward
        if self.recompute and torch.is_grad_enabled() and self.compiled_recomputation is not None \
                and not observed_uncompiled:
            try:
                return self.compiled_recomputation(x, rope, batch, seq_len)
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.FailOnRecompileLimitHit) as untraceable:
                self._recompute_around_the_compiled_code(untraceable)  # raised while tracing: nothing ran
        if (self.recompute or observed_uncompiled) and torch.is_grad_enabled():
            return checkpoint(run, x, rope, batch, seq_len, use_reentrant=False, context_fn=self._recompute_contexts)
        out, aux = run(x, rope, batch, seq_len)
        return self._outside_the_graph_pool(out), aux

    def checkpointed_forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: int,
                             seq_len: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`_forward` as written (the class's, not the compiled one `apply_compile` puts on the block) under
        non-reentrant activation checkpointing: what `apply_compile` compiles for a recomputed block. Traced,
        checkpointing becomes torch's checkpoint operator, and AOTAutograd keeps the input and recomputes the rest
        inside the compiled backward."""
        return checkpoint(type(self)._forward, self, x, rope, batch, seq_len, use_reentrant=False)

    def _recompute_around_the_compiled_code(self, untraceable: Exception) -> None:
        """A block whose compiled code breaks its graph (layers that run eagerly inside it: expert parallelism's
        experts, weight gradients deferred by a zero-bubble schedule), or whose function ran out of Dynamo's
        recompilations, cannot be traced under checkpointing: it recomputes by checkpointing around its compiled
        code from now on, as eager code does. Under CUDA graphs that replays its graphs inside backward, which
        overwrites the other blocks' outputs: refused in one line."""
        self.compiled_recomputation = None
        if self.under_cuda_graphs:
            reason = str(untraceable).strip().splitlines()[0]
            raise ConfigError(
                f"training.recompute under CUDA graphs (training.compile_mode with graphs) needs blocks that compile "
                f"into one graph, and this block cannot be traced whole ({reason}): set "
                f"training.compile_mode=default, or training.recompute=none") from untraceable

    def _outside_the_graph_pool(self, out: torch.Tensor) -> torch.Tensor:
        """The block's output, copied out of the CUDA graphs' memory pool where no backward will follow (evaluation,
        or nothing requiring grad). Each compiled block is its own `torch.compile` invocation, and Inductor's
        CUDA-graph trees start a new generation at every invocation that has no backward pending, freeing the last
        one's outputs for reuse: the next block's input would be a tensor whose memory is already being overwritten
        (torch raises "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run").
        Training forwards keep a backward pending, so they pass their outputs on as they are."""
        if self.under_cuda_graphs and not out.requires_grad and out.is_cuda:
            return out.clone()
        return out

    def _recompute_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(first forward, recomputation): the recomputation must not count its tokens into the router's load."""
        return contextlib.nullcontext(), self._router_not_counting()

    @contextlib.contextmanager
    def _router_not_counting(self):
        router = self.mlp.router if isinstance(self.mlp, MoE) else None
        if router is not None:
            router.counting = False
        try:
            yield
        finally:
            if router is not None:
                router.counting = True

    def _forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: int,
                 seq_len: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        # The norms go in with their inputs: under FP8 each is fused into the next GEMM's quantizer.
        x = x + self.attn(x, rope, batch, seq_len, norm=self.attn_norm)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.mlp_norm(x), batch, seq_len)
            return x + y, aux
        return x + self.mlp(x, norm=self.mlp_norm), None


class LayerDict(nn.ModuleDict):
    """The blocks a rank holds, keyed by global layer index (names like `layers.7.*` at any pipeline split);
    `layers[7]` and `layers["7"]` both work."""

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key))


class _AttachBalanceLoss(torch.autograd.Function):
    """Identity on the residual stream whose backward also gives the MoE balance loss the gradient `scale`.

    The balance loss joins backward where it is computed instead of being added to the returned loss,
    so it flows through pipeline stages (only the last stage has the loss) and the reported loss is the
    language-modelling loss alone."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=dx.device), None


class Transformer(nn.Module):
    """Decoder-only language model. `cfg.vocab_size` must be resolved (not None) before building.

    The residual stream is token-major, (B*T, hidden); under sequence parallelism each rank holds
    a contiguous 1/tp of those tokens between the tensor-parallel regions.

    Under pipeline parallelism a rank builds only the parts of its `stages`: their layers (parameter names stay
    those of the whole model, e.g. `layers.7.attn.qkv_proj.weight`), the embedding if it holds the first stage,
    the final norm, LM head and MTP modules if it holds the last.

    Under context parallelism (`cp`) a rank holds 1/cp of each sequence's tokens (`megafp8.parallel.context`):
    its micro-batches are (B, max_seq_len / cp), RoPE gives them their positions in the sequence, and attention
    gathers the group's keys and values."""

    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, max_seq_len: int,
                 tp: Optional[TensorParallel] = None, device=None, ep: Optional[ExpertParallel] = None,
                 fp8_dispatch: bool = False, stages: Optional[Sequence[StageSpec]] = None,
                 cp: Optional[ContextParallel] = None) -> None:
        super().__init__()
        layer_ids = range(cfg.num_layers) if stages is None else [i for s in stages for i in s.layers]
        embedding = stages is None or any(s.first for s in stages)
        head = stages is None or any(s.last for s in stages)
        if cfg.vocab_size is None:
            raise ValueError("resolve model.vocab_size (e.g. from the tokenizer) before building the model")
        if head and cfg.mtp_depth > 0 and not embedding:
            raise ValueError("the MTP modules use the embedding: the rank holding the head must hold it too")
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel.single()
        self.cp = cp = cp or ContextParallel.single()
        self.max_seq_len = max_seq_len // cp.size  # the tokens of a sequence this rank holds
        # Gradient that backward gives each MoE balance loss: the factor applied to the returned loss before
        # backward (1 / micro-batches x loss scale). The trainer sets it every step.
        self.balance_grad_scale = 1.0
        dtype = recipe.param_dtype
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp, device) if embedding else None
        rope_dim = cfg.attention.rope_dim(cfg.hidden_size, cfg.num_heads)
        positions = cp.positions(max_seq_len) if cp.enabled else None
        self.rope = RotaryEmbedding(rope_dim, max_seq_len, cfg.rope_theta, device, cfg.rope_scaling, positions)
        if positions is not None:  # this rank's tokens in the sequence, for the MTP depths' shifted targets
            self.register_buffer("cp_positions", positions.to(device), persistent=False)
        ep = ep or ExpertParallel.single()
        self.layers = LayerDict({str(i): Block(cfg, layer_spec(cfg, i), recipe, tp, ep, fp8_dispatch, device, cp)
                                 for i in layer_ids})
        self.has_head = head
        if head:
            # Depth k's last k positions have no target in the sample (`shifted_inputs`): their routing is left out
            # of the expert loads that steer the balancing bias and the log (DeepSeek-V3 runs depth k on T - k tokens).
            self.mtp = nn.ModuleList(
                MtpModule(cfg, recipe, Block(cfg, mtp_layer_spec(cfg), recipe, tp, ep, fp8_dispatch, device, cp,
                                             uncounted_tail=k), device)
                for k in range(1, cfg.mtp_depth + 1))
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
            # The LM head is a precision island: never FP8, whatever the recipe.
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, recipe.high_precision(), tp,
                                                device=device, whole_tiles=False)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                with_mtp: bool = True) -> torch.Tensor:
        """tokens: (B, T) int64. Returns the mean loss if `targets` (B, T) is given (cross-entropy plus, unless not
        `with_mtp`, the weighted MTP loss; the MoE balance losses reach backward on their own), else logits
        (B, T, V)."""
        batch, seq_len = tokens.shape
        hidden = self.run_layers(self.embed(tokens), self.layers.keys(), batch, seq_len)
        if targets is None:
            logits = self.lm_head(self.final_norm(hidden))  # (B*T, vocab / tp)
            return gather_from_tp_last(logits, self.tp).view(batch, seq_len, -1)
        return self.head_loss(hidden, targets, with_mtp)

    def loss_terms(self, tokens: torch.Tensor, targets: torch.Tensor) -> LossTerms:
        """The training forward of tokens, targets (B, T): the loss backward starts from and its parts, for the log."""
        batch, seq_len = tokens.shape
        return self.head_terms(self.run_layers(self.embed(tokens), self.layers.keys(), batch, seq_len), targets)

    def run_layers(self, x: torch.Tensor, layer_ids: Iterable[str], batch: int, seq_len: int) -> torch.Tensor:
        """The residual stream after the blocks `layer_ids` (keys of `self.layers`), in order."""
        for i in layer_ids:
            x, aux = self.layers[i](x, self.rope, batch, seq_len)
            x = self._attach_balance_loss(x, aux)
        return x

    def _attach_balance_loss(self, x: torch.Tensor, aux: Optional[torch.Tensor]) -> torch.Tensor:
        if aux is None or not torch.is_grad_enabled():
            return x
        return _AttachBalanceLoss.apply(x, aux, self.balance_grad_scale)

    def tokens_per_row_block(self, rows: int) -> int:
        """Batch size of a micro-batch whose residual stream has `rows` rows on this rank (max_seq_len tokens
        per sample; under sequence parallelism this rank holds 1/tp of them)."""
        return rows * (self.tp.size if self.tp.sp else 1) // self.max_seq_len

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor, with_mtp: bool = True) -> torch.Tensor:
        """Final norm, LM head and mean cross-entropy of the last block's output, plus (`with_mtp`: the training
        loss) the weighted MTP loss. Without it, the language-modelling loss alone: the validation loss, comparable
        with a model's without MTP (the MTP modules, dropped at inference, do not run)."""
        if not with_mtp:
            return self._lm_loss(hidden, targets)
        return self.head_terms(hidden, targets).total

    def head_terms(self, hidden: torch.Tensor, targets: torch.Tensor) -> LossTerms:
        """`head_loss` with MTP (the training loss), and its parts: the LM and the (unweighted) MTP cross-entropy."""
        lm = self._lm_loss(hidden, targets)
        if not self.mtp:
            return LossTerms(lm, lm, lm.new_zeros(()))
        mtp = self._mtp_loss(hidden, targets)
        return LossTerms(lm + self.cfg.mtp_loss_weight * mtp, lm, mtp)

    def _lm_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.final_norm(hidden))  # (B*T, vocab / tp)
        return vocab_parallel_cross_entropy(logits, targets, self.tp)

    def _mtp_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the MTP depths (each predicting one more token ahead)."""
        batch, seq_len = targets.shape
        # Under context parallelism a depth's tokens ahead may lie in another rank's chunk: the shifts are taken on
        # the whole sequences' targets (gathered: B x T integers), then this rank's positions picked.
        whole = gather_sequence(targets, self.cp)
        total = torch.zeros((), device=hidden.device)
        for k, module in enumerate(self.mtp, start=1):
            inputs, ahead = shifted_inputs(whole, k)
            if self.cp.enabled:
                inputs, ahead = inputs[:, self.cp_positions], ahead[:, self.cp_positions]
            hidden, aux = module(hidden, self.embed(inputs), self.rope, batch, seq_len)
            hidden = self._attach_balance_loss(hidden, aux if aux.requires_grad else None)
            total = total + self._shared_sequence_loss(self.lm_head(module.out_norm(hidden)), ahead)
        return total / len(self.mtp)

    def _shared_sequence_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the valid targets. Under context parallelism the ranks' shares of a sequence may
        hold different numbers of them (the last chunk's ignored tail): each rank's mean is weighted by its share of
        the group's valid targets, times the group's size, so that the ranks' losses average to the whole
        sequences' mean."""
        loss = vocab_parallel_cross_entropy(logits, targets, self.tp)
        if not self.cp.enabled:
            return loss
        return loss * share_of_group((targets != IGNORE_INDEX).sum().float(), self.cp)  # a collective: every rank


class PipelineChunk(nn.Module):
    """One pipeline stage of a rank's `Transformer`: its input is the token ids (first stage) or the residual
    stream from the previous stage, its output the residual stream after its blocks (the last stage's goes to
    `Transformer.head_loss`). Holds the stage's own modules, so `parameters()` are that stage's."""

    def __init__(self, model: Transformer, layer_ids: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.layer_ids = [str(i) for i in layer_ids]
        self.first = first
        self.blocks = nn.ModuleList(model.layers[i] for i in self.layer_ids)
        self.embed = model.embed if first else None
        self.head = nn.ModuleList([model.final_norm, model.lm_head, model.mtp]) if last else None
        self._run_layers = model.run_layers  # a bound method: the model is not registered as a submodule
        self._batch_of = model.tokens_per_row_block
        self._seq_len = model.max_seq_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            batch, seq_len = x.shape
            x = self.embed(x)
        else:  # (rows, hidden) from the previous stage: full-length samples
            batch, seq_len = self._batch_of(x.shape[0]), self._seq_len
        return self._run_layers(x, self.layer_ids, batch, seq_len)


def apply_recompute(model: nn.Module, mode: str, layers: Optional[int] = None) -> int:
    """Activation recomputation: `full` makes the transformer blocks (MTP blocks included) keep only their input for
    backward and run their forward again there, every block or, with `layers`, the first `layers` of `model`'s in
    forward order (its layers by index, then its MTP blocks); `none` leaves them. Returns how many blocks recompute."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    count = recomputed_blocks(mode, layers, len(blocks))
    for i, block in enumerate(blocks):
        block.recompute = i < count
    return count


def recomputed_blocks(mode: str, layers: Optional[int], blocks: int) -> int:
    """How many of a rank's `blocks` recompute under `training.recompute` = `mode` and `training.recompute_layers` =
    `layers` (the first ones, in forward order)."""
    if mode != "full":
        return 0
    return blocks if layers is None else min(layers, blocks)


def apply_compile(model: nn.Module, mode: str = "default", backend: str = "inductor",
                  comm_overlap: bool = False, recompute_in_graph: Optional[bool] = None) -> int:
    """`torch.compile` each transformer block's computation in `mode` with `backend` (MTP blocks included; parameter
    names unchanged). An FP8 linear enters the graph as custom ops (see `megafp8.precision.fp8_linear`), with its
    tensor-parallel collectives, reading the weight the block quantized eagerly before running (one that defers
    its weight gradient runs eagerly inside the graph).
    `comm_overlap`: Inductor moves the graph's collectives and their waits to overlap computation (its
    `reorder_for_compute_comm_overlap` passes; traced, every collective is otherwise waited for at once).
    `recompute_in_graph` (`training.recompute_compiled`): a block that recomputes compiles its forward under
    checkpointing as one function, recomputed inside the compiled backward, instead of checkpointing around its
    compiled code (False), which a block that cannot be traced whole falls back to anyway; None: inside, with every
    backend but Dynamo's `eager`, which has no AOTAutograd to partition the graph (it would keep more, not less).
    Returns how many blocks were compiled."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    settings = _compile_settings(mode, comm_overlap)
    in_graph = backend != "eager" if recompute_in_graph is None else recompute_in_graph
    for block in blocks:
        block.uncompiled_forward = block._forward
        block._forward = keyed_to_this_code(torch.compile(block._forward, backend=backend, **settings))
        # A recomputed block compiles its forward under activation checkpointing as one function (compiled at its
        # first call, so only by blocks that recompute): AOTAutograd keeps the block's input and puts the
        # recomputed forward into the compiled backward. Checkpointing around the compiled code instead runs the
        # compiled forward a second time from Python inside backward: under CUDA graphs that replay overwrote the
        # other blocks' outputs still waiting for their backward (every run with `recompute: full` and
        # `reduce-overhead` stopped at its first step, job HQ), and without them its launches are host time (the
        # ~1B FP8 step recomputed: GPU 56% busy, job HQ; compiled, FP8 ran 15% faster in the graph, job HV).
        block.compiled_recomputation = (_compiled_recomputation(block.checkpointed_forward, backend, settings)
                                        if in_graph else None)
        block.under_cuda_graphs = uses_cuda_graphs(mode)
        # Each forward first quantizes the block's changed FP8 weights, eagerly: once per weight version, not once
        # per micro-batch inside the graph; every linear gets a fresh alias of its FP32 main_grad to add its weight
        # gradient into. Every GEMM layer (the linears and the MoE experts' grouped linears) is listed, whatever its
        # recipe now: one may switch to FP8 later (`precision.fp8_start_step`).
        block.prepared_linears = [m for m in block.modules() if isinstance(m, GemmLayer)]
    return len(blocks)


def _compiled_recomputation(checkpointed_forward, backend: str, settings: dict):
    """A block's `checkpointed_forward`, compiled as one function: one code object for every block, as `_forward`
    (a function of each block's own, say a `functools.partial` of its `_forward`, would recompile for each block).
    Dynamo traces the forward's side effects (the MoE routers' token counts and statistics) once, in the forward
    graph; by default it refuses to trace them under checkpointing (a graph break), since eager checkpointing
    replays them when it recomputes. Here replaying them would be wrong (eager code switches the routers' counting
    off while recomputing: `Block._recompute_contexts`), so the compiled function is traced and run with that
    refusal off (`skip_fwd_side_effects_in_bwd_under_checkpoint`, which torchtitan sets for all its compiled code).
    `fullgraph`: a graph break inside (which would run the checkpoint eagerly, replaying those side effects) raises
    while tracing instead, before anything ran; `Block.forward` then recomputes around the compiled code.
    Inductor partitions the joint graph within the first call, after `RecomputeTheWholeForward` has marked what
    torch 2.11 leaves unmarked (the linears' forwards), so the block keeps its input only on every torch release."""
    from megafp8.model.recompute_pass import RecomputeTheWholeForward  # imports Inductor: only where compiling

    compiled = keyed_to_this_code(torch.compile(checkpointed_forward, backend=backend, fullgraph=True, **settings))
    compiled = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)(compiled)
    return torch._inductor.config.patch(joint_custom_pre_pass=RecomputeTheWholeForward())(compiled)


def uses_cuda_graphs(mode: str) -> bool:
    """Whether Inductor wraps code compiled in `mode` in CUDA graphs (`reduce-overhead` and `max-autotune` do)."""
    if mode == "default":
        return False
    from torch._inductor import list_mode_options
    return bool(list_mode_options(mode).get("triton.cudagraphs", False))


# Inductor's recommended comm/compute reordering passes (torch/_inductor/config.py), in order; those this torch has.
_COMM_OVERLAP_PASSES = ("reorder_communication_preserving_peak_memory", "sink_waits_iterative",
                        "reorder_communication_preserving_peak_memory")


def _compile_settings(mode: str, comm_overlap: bool) -> dict:
    """`torch.compile`'s keyword arguments for `mode`, plus Inductor's comm/compute reordering if asked (`mode`
    and `options` cannot both be given: the mode's own options are spelled out then)."""
    if not comm_overlap:
        return {"mode": None if mode == "default" else mode}
    from torch._inductor import comms, list_mode_options

    options = dict(list_mode_options(mode))
    options["reorder_for_compute_comm_overlap"] = True
    options["reorder_for_compute_comm_overlap_passes"] = [p for p in _COMM_OVERLAP_PASSES if hasattr(comms, p)]
    return {"options": options}


def unused_vocab_warning(cfg: ModelConfig, tokenizer_vocab: int, tokenizer: str, tp_size: int = 1) -> Optional[str]:
    """What to say where a configured `vocab_size` is at least twice the tokenizer's vocabulary padded as `null`
    would pad it: rows that are never a target, and, where the weights come from elsewhere (an import prints its
    `vocab_size`), most likely another tokenizer's, whose ids mean other text. None where it is not: a model's
    vocabulary a little above its tokenizer's is common (DeepSeek-V3: 129,280 rows for 128,815 ids)."""
    if cfg.vocab_size is None:
        return None
    multiple = math.lcm(cfg.pad_vocab_to_multiple_of, tp_size)
    padded = math.ceil(tokenizer_vocab / multiple) * multiple
    if cfg.vocab_size < 2 * padded:
        return None
    return (f"model.vocab_size={cfg.vocab_size} is far above the {padded} rows the data's tokenizer ({tokenizer}, "
            f"{tokenizer_vocab} ids) needs: {cfg.vocab_size - tokenizer_vocab} rows are never a target. If the "
            "weights come from a checkpoint or an import, its tokenizer must be the one the data was made with "
            "(tokenize the data with the model's tokenizer.json); otherwise set model.vocab_size=null")


def resolve_vocab_size(cfg: ModelConfig, tokenizer_vocab: int, tp_size: int = 1) -> ModelConfig:
    """The model config with `vocab_size` set: the tokenizer's, padded, unless configured (and large enough).

    The padding does not depend on the layout (a checkpoint then loads at any TP): the smallest multiple of
    `pad_vocab_to_multiple_of` that holds the tokenizer's vocabulary. Only a tensor-parallel size that does
    not divide it (not a power of two up to that multiple) pads further, to the next size it divides. The
    embedding and LM head stay BF16, so their vocabulary shards need not be whole FP8 tiles."""
    if cfg.vocab_size is None:
        multiple = cfg.pad_vocab_to_multiple_of
        padded = math.ceil(tokenizer_vocab / multiple) * multiple
        if padded % tp_size != 0:
            multiple = math.lcm(multiple, tp_size)
            padded = math.ceil(tokenizer_vocab / multiple) * multiple
        return dataclasses.replace(cfg, vocab_size=padded)
    if cfg.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the data's tokenizer vocabulary ({tokenizer_vocab}): "
            f"set model.vocab_size >= {tokenizer_vocab} or null"
        )
    return cfg
