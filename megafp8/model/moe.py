"""DeepSeek-V3-style mixture of experts: an FP32 router, routed SwiGLU experts, shared experts.

The settings are `model.moe` (`megafp8.config.moe.MoeConfig`). Router (a precision island: FP32 weight, FP32
math). Scores are sigmoid (V3) or softmax of the token's logits. Selection adds a per-expert bias that only
steers the choice (auxiliary-loss-free balancing: after every optimizer step the trainer moves it by
`bias_update_rate` against each expert's load); with `n_group > 1` a token first keeps its best `topk_group`
expert groups (a group scores the sum of its two best experts) and picks its top-k among their experts.
The combine weights are the chosen experts' *unbiased* scores, normalized to sum to 1 if `norm_topk_prob`,
times `routed_scaling_factor`. An optional sequence-wise balance loss (V3's, weight `aux_loss_coeff`) is
returned with the output.

Routed experts are SwiGLUs in the recipe's precision (FP8 per-tile under `fp8`), stored stacked
per projection (`experts.gate_up_proj.weight`: local experts x [gate; up] x hidden) on the rank
that owns them (`megafp8.parallel.experts`), and computed as grouped linears over rows sorted by
expert. Shared experts are one tensor-parallel SwiGLU of width
`num_shared_experts x ffn_hidden_size`, applied to every token.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megafp8.config import MoeConfig
from megafp8.model.mlp import SwiGLU
from megafp8.parallel import ContextParallel, ExpertParallel, TensorParallel, reduce_from_tp, sum_over_context
from megafp8.parallel.experts import ExpertLinear, combine, count_per_expert, dispatch
from megafp8.parallel.permute import (
    RowSource, combine_rows, combine_weights_grad, eager_gather_rows, gather_rows, gather_sum,
)
from megafp8.parallel.routing import group_limited_topk
from megafp8.precision import PrecisionRecipe
from megafp8.precision.eager import run_eagerly
from megafp8.precision.grouped import (
    CombinedOutput, ExpertProjection, GatheredInput, expert_rows, grouped_fp8_swiglu_mlp, padded_source_index,
)


class Router(nn.Module):
    """Top-k expert choice per token. `expert_bias` steers selection only; `load` counts this rank's
    assignments per expert since the trainer last read it, except those of the last `uncounted_tail` positions of each
    sequence (an MTP depth's: their targets lie past the sample, so they reach no loss)."""

    def __init__(self, moe: MoeConfig, hidden_size: int, device=None, uncounted_tail: int = 0) -> None:
        super().__init__()
        self.uncounted_tail = uncounted_tail
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.score_func, self.norm_topk = moe.score_func, moe.norm_topk_prob
        self.scaling = moe.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=torch.float32, device=device))
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts, device=device))
        # FP64: counts stay exact past 2^24 (an expert's tokens a step at scale, and their sum over experts and
        # layers, from which the log's moe_dropped_tokens is taken: FP32 rounding showed tokens dropped where none was)
        self.register_buffer("load", torch.zeros(moe.num_experts, dtype=torch.float64, device=device),
                             persistent=False)
        self.counting = True  # off while activation recomputation re-runs the forward

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.weight)  # (N, E), FP32
        return logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """(N, E) scores -> (N, k) chosen experts (bias-steered, group-limited: `routing.group_limited_topk`)."""
        return group_limited_topk(scores.detach() + self.expert_bias, self.n_group, self.topk_group, self.top_k)

    def forward(self, x: torch.Tensor, counted: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, hidden) -> (weights (N, k) FP32, chosen experts (N, k), scores (N, E) FP32); `counted` (N,) bool:
        the tokens whose choice counts into `load` (None: all)."""
        scores = self.scores(x)
        chosen = self.select(scores)
        weights = scores.gather(1, chosen)
        if self.norm_topk:  # + 1e-20 as DeepSeek-V3's reference: chosen sigmoid scores that all underflow to 0
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # (logits below ~-88) give 0, not NaN
        if self.training and self.counting:
            self.load += count_per_expert(chosen, self.num_experts, counted).double()
        return weights * self.scaling, chosen, scores

    @torch.no_grad()
    def update_bias(self, global_load: torch.Tensor, rate: float, apply: Optional[torch.Tensor] = None) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded ones.
        `apply` (a 0-d bool device tensor): leave the bias as it is where False (a skipped step)."""
        change = rate * torch.sign(global_load.mean() - global_load).to(self.expert_bias.dtype)  # (FP64 loads)
        self.expert_bias += change if apply is None else change * apply


def counted_tokens(tokens: int, first_token: int, seq_len: int, uncounted_tail: int, cp: ContextParallel,
                   device: torch.device) -> torch.Tensor:
    """(tokens,) bool: which of this rank's tokens, [first_token, first_token + tokens) of the flattened micro-batch of
    `seq_len` a sequence on this rank (a slice under sequence parallelism; its share of each sequence under context
    parallelism), lie before the last `uncounted_tail` positions of their whole sequence."""
    local = (torch.arange(tokens, device=device) + first_token) % seq_len
    position = cp.positions(seq_len * cp.size, device)[local] if cp.enabled else local
    return position < seq_len * cp.size - uncounted_tail


def sequence_balance_loss(scores: torch.Tensor, chosen: torch.Tensor, batch: int, seq_len: int, first_token: int,
                          tp: TensorParallel, cp: Optional[ContextParallel] = None,
                          counted: Optional[torch.Tensor] = None, uncounted_tail: int = 0) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, sum_i f_i P_i averaged over sequences (before its weight).

    f_i = E / (k T) x (tokens of the sequence routed to i), P_i = mean over the sequence of the
    normalized scores. This rank holds tokens [first_token, first_token + N) of the flattened
    micro-batch of `seq_len` tokens a sequence (a slice of it under sequence parallelism, whose per-sequence sums
    are then added over TP). Under context parallelism those are the rank's share of each sequence: the sums are
    added over the group too (every rank's loss holds the whole term), and T is the whole sequence's length.

    An MTP depth's router (`counted`, (N,) bool from `counted_tokens`, and its `uncounted_tail`) sums over the
    positions that have a target alone, T less the tail: DeepSeek-V3 runs depth k on T - k tokens, so the positions
    past them neither steer this loss nor count in T."""
    cp = cp or ContextParallel.single()
    n, num_experts = scores.shape
    k = chosen.shape[1]
    seq = (torch.arange(n, device=scores.device) + first_token) // seq_len  # (N,)
    probs = scores / scores.sum(dim=-1, keepdim=True)
    hits = F.one_hot(chosen, num_experts).sum(dim=1).float()  # (N, E): 1 where the token chose the expert
    if counted is not None:
        probs, hits = probs * counted.unsqueeze(1), hits * counted.unsqueeze(1)
    prob_sum = torch.zeros(batch, num_experts, device=scores.device).index_add(0, seq, probs)
    counts = torch.zeros(batch, num_experts, device=scores.device).index_add(0, seq, hits)
    if tp.sp:
        prob_sum = reduce_from_tp(prob_sum, tp)
        counts = reduce_from_tp(counts, tp)
    prob_sum, counts = sum_over_context(prob_sum, cp), sum_over_context(counts, cp)
    whole = seq_len * cp.size - (uncounted_tail if counted is not None else 0)
    f = counts * num_experts / (k * whole)
    return (f * prob_sum / whole).sum(dim=-1).mean()


class RoutedExperts(nn.Module):
    """This rank's routed experts: down(silu(gate(x)) * up(x)) per expert, as two grouped linears."""

    def __init__(self, moe: MoeConfig, hidden_size: int, recipe: PrecisionRecipe, ep: ExpertParallel,
                 device=None) -> None:
        super().__init__()
        e, hidden, ffn = moe.num_experts, hidden_size, moe.ffn_hidden_size
        # rows [gate; up] per expert; a weight that is not whole 128x128 tiles runs BF16
        self.gate_up_proj = ExpertLinear(e, hidden, 2 * ffn, recipe.for_weight(2 * ffn, hidden), ep, device)
        self.down_proj = ExpertLinear(e, ffn, hidden, recipe.for_weight(hidden, ffn), ep, device)
        # Across EP ranks the rows received change in number every step: traced, each step would compile anew.
        self.traceable = not ep.enabled  # (each ExpertLinear decides the same for its grouped GEMMs)
        # Set while FP8 health is sampled: the two grouped linears then run one by one (SwiGLU's output quantized
        # from BF16, within one E4M3 ULP of the fused path), so the health hooks on each see its input.
        self.observed = False

    @property
    def num_local(self) -> int:
        return self.down_proj.weight.shape[0]

    def forward(self, rows: RowSource, counts: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Rows sorted by expert (`counts[e]` for local expert e, a device tensor) -> (out, out_rows): expert row
        i's output is out[out_rows[i]] (the padded layout of the fused FP8 MLP), or out[i] where out_rows is
        None. Traced into a compiled block with one EP rank (every shape is fixed, nothing syncs with the host).
        Across EP ranks the gathers and the grouped GEMMs run eagerly inside compiled code and SwiGLU between them
        is compiled, as before the experts were traced."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if self._runs_fused(rows):
            return (self._fused_fp8 if self.traceable else self._eager_fused_fp8)(rows, counts)
        x = (gather_rows if self.traceable else eager_gather_rows)(rows)
        gate, up = gate_up(x, counts).chunk(2, dim=-1)  # each (rows, ffn)
        return down(F.silu(gate) * up, counts), None

    def combined(self, rows: RowSource, counts: torch.Tensor, assignment_rows: torch.Tensor,
                 weights: torch.Tensor) -> Optional[torch.Tensor]:
        """With one EP rank, where the fused FP8 path runs: the experts' output already combined per token (N,
        hidden), `weights` (N, k) of the (token, slot) assignments at `assignment_rows` (N, k) among the rows
        sorted by expert. The combine's backward then hands the experts the quantized gradient of their padded
        output without a BF16 copy (`CombinedOutput`). None where the experts run otherwise (call `forward`, then
        combine)."""
        if not (self.traceable and self._runs_fused(rows)):
            return None
        if weights.dtype not in (torch.float32, torch.float64):
            weights = weights.float()
        return self._fused_fp8(rows, counts, (assignment_rows, weights.contiguous()))

    def _runs_fused(self, rows: RowSource) -> bool:
        gate_up, down = self.gate_up_proj, self.down_proj
        fp8 = gate_up.recipe.fp8
        fused = fp8 is not None and down.recipe.fp8 == fp8 and fp8.all_gemms and not self.observed
        return fused and rows.row_to_source.shape[0] > 0

    @run_eagerly
    def _eager_fused_fp8(self, rows: RowSource, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fused_fp8(rows, counts)

    def _fused_fp8(self, rows: RowSource, counts: torch.Tensor, combine_with: Optional[tuple] = None):
        """One FP8 autograd function in the padded expert layout, the tokens gathered into it by the quantizer.
        The layout is built on the device, sized by its upper bound: no host sync. Returns (padded output, the
        padded row of each sorted row), or with `combine_with` (assignment rows, weights) the combined output."""
        gate_up, down = self.gate_up_proj, self.down_proj
        layout = expert_rows(counts, rows.source.device, rows.row_to_source.shape[0])
        x = GatheredInput(rows.source, padded_source_index(layout, rows.row_to_source), gather_sum,
                          layout.index[rows.source_to_rows])
        combined = None
        if combine_with is not None:
            assignment_rows, weights = combine_with
            combined = CombinedOutput(layout.index[assignment_rows], weights, combine_rows, combine_weights_grad)
        y = grouped_fp8_swiglu_mlp(x, layout,
                                   ExpertProjection(gate_up.weight, gate_up.fp8_cache, gate_up.wgrad_queue),
                                   ExpertProjection(down.weight, down.fp8_cache, down.wgrad_queue),
                                   gate_up.recipe.fp8, gate_up.fp8_backend_for(rows.source.device), combined)
        return y if combined is not None else (y, layout.index)


class MoE(nn.Module):
    """Routed experts (split over the expert-parallel group) plus shared experts."""

    def __init__(self, moe: MoeConfig, hidden_size: int, recipe: PrecisionRecipe, tp: TensorParallel,
                 ep: ExpertParallel, fp8_dispatch: bool = False, device=None,
                 cp: Optional[ContextParallel] = None, uncounted_tail: int = 0) -> None:
        """`uncounted_tail`: the last positions of each sequence left out of the router's load (`Router`)."""
        super().__init__()
        self.num_experts, self.tp, self.ep = moe.num_experts, tp, ep
        self.cp = cp or ContextParallel.single()  # the balance loss's sequences are shared over it
        self.aux_coeff = moe.aux_loss_coeff
        self.fp8_dispatch = fp8_dispatch
        self.router = Router(moe, hidden_size, device, uncounted_tail)
        self.experts = RoutedExperts(moe, hidden_size, recipe, ep, device)
        self.shared = None
        if moe.num_shared_experts > 0:
            self.shared = SwiGLU(hidden_size, moe.num_shared_experts * moe.ffn_hidden_size, recipe, tp, device)

    def _dispatch_quantizer(self, x: torch.Tensor):
        """(backend, format) to send rows in FP8 with, or None: the experts' own backend and activation format."""
        experts = self.experts.gate_up_proj
        if not (self.fp8_dispatch and experts.runs_fp8):
            return None
        return experts.fp8_backend_for(x.device), experts.recipe.fp8.fmt

    def forward(self, x: torch.Tensor, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x (tokens, hidden) -> (output, weighted balance loss)."""
        first = self.tp.rank * x.shape[0] if self.tp.sp else 0  # this rank's first token of the micro-batch
        counted = None
        if self.router.uncounted_tail and self.training:
            counted = counted_tokens(x.shape[0], first, seq_len, self.router.uncounted_tail, self.cp, x.device)
        weights, chosen, scores = self.router(x, counted)
        plan = dispatch(x, chosen, self.num_experts, self.ep, self._dispatch_quantizer(x))
        y = None
        if plan.regroup is None:  # one EP rank: the fused FP8 experts combine their own output
            y = self.experts.combined(plan.rows, plan.tokens_per_expert, plan.assignment_rows, weights)
        if y is None:
            expert_out, out_rows = self.experts(plan.rows, plan.tokens_per_expert)
            y = combine(expert_out, out_rows, weights, plan, self.ep)
        if self.shared is not None:
            y = y + self.shared(x)
        aux = x.new_zeros((), dtype=torch.float32)
        if self.aux_coeff > 0 and self.training:
            aux = self.aux_coeff * sequence_balance_loss(scores, chosen, batch, seq_len, first, self.tp, self.cp,
                                                         counted, self.router.uncounted_tail)
        return y, aux


def routers(model: nn.Module) -> list[tuple[str, Router]]:
    """Every router of `model`, by module name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Router)]


def expert_load_stats(loads: torch.Tensor) -> dict[str, float]:
    """(layers, experts) global assignment counts -> balance figures for the log (`moe_idle_experts`: the share of
    (layer, expert) pairs that got no token)."""
    mean = loads.mean(dim=1)
    cv = loads.std(dim=1, unbiased=False) / mean.clamp(min=1e-9)
    return {"moe_load_cv": cv.mean().item(), "moe_load_max_over_mean": (loads.max(dim=1).values / mean).max().item(),
            "moe_load_min_over_mean": (loads.min(dim=1).values / mean).min().item(),
            "moe_idle_experts": (loads == 0).float().mean().item()}


