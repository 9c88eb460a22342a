"""Expert parallelism: dropless token dispatch to the ranks that hold each expert, and the combine back.

The routed experts of a MoE layer are split evenly across the `ep` ranks of an expert-parallel
group (rank r holds experts [r * E/ep, (r + 1) * E/ep)). Every (token, slot) assignment is
sent to its expert's rank; nothing is dropped, so the exchange is an uneven all-to-all:

    dispatch  sort the N*k assignments by expert -> exchange per-expert counts (a small all-to-all)
              -> all-to-all the token rows -> regroup the received rows expert-major
    experts   this rank's experts as grouped linears over their contiguous runs of rows (`ExpertLinear`)
    combine   the exact reverse (all-to-all back, un-sort), then each token's k outputs are summed
              with its routing weights in FP32 and cast to the activation dtype

With one EP rank the sorted rows are never copied: the experts read the tokens through a row map
(`megafp8.parallel.permute.RowSource`; the FP8 experts gather and quantize in one pass), and the combine
reads the experts' output through an index, in one kernel with the weighted sum (`weighted_combine`).

The row exchange is an autograd function whose backward is the reverse all-to-all. With
`fp8_dispatch`, rows are quantized to FP8 in 1x128 tiles before the forward all-to-all and
dequantized after (1 + 4/128 bytes per element instead of 2); gradients go back in BF16. The
expert GEMM re-quantizes the dequantized rows to the same FP8 values (each tile's max maps back
to the format's max), so the forward GEMM loses nothing more; the weight gradient's x^T, tiled
along the tokens, is quantized from those FP8-rounded rows, a second rounding (as in DeepSeek-V3).

With one EP rank nothing in a MoE layer waits for the GPU: the per-expert counts stay on the device, the FP8
experts' padded layout is sized by its upper bound (`megafp8.precision.grouped.expert_rows`), and BF16's grouped
GEMM takes device offsets. Across EP ranks the counts exchange needs the host to know the split sizes: one device
sync per MoE layer (as in Megatron's dropless dispatcher).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megafp8.precision import Fp8Backend, Fp8Format, Fp8Recipe, GemmLayer, PrecisionRecipe
from megafp8.precision.grouped import eager_grouped_linear, grouped_linear
from megafp8.parallel.dims import ExpertParallel
from megafp8.parallel.permute import RowSource, eager_gather_rows, eager_weighted_combine, weighted_combine
from megafp8.parallel.sharding import mark_expert
from megafp8.precision.quantize import dequantize_1x128


PARTIAL_FP8_EXPERTS = (
    "grouped expert linears run all three GEMMs in FP8; precision.fp8_fprop/fp8_dgrad/fp8_wgrad=false is not "
    "supported for MoE experts: keep the experts in BF16 with precision.bf16_layers=['*.experts.*'], "
    "or enable all three")


class ExpertLinear(GemmLayer):
    """One projection of this rank's routed experts, stacked: weight (local experts, out, in). Its input is
    rows sorted by expert with per-expert counts; GEMMs follow the precision recipe (FP8 per tile)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, recipe: PrecisionRecipe,
                 ep: ExpertParallel, device=None) -> None:
        super().__init__()
        local = ep.local_experts(num_experts)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(len(local), out_features, in_features, dtype=recipe.param_dtype,
                                               device=device))
        mark_expert(self.weight, local.start, num_experts)
        # Traced into compiled code with one EP rank; across EP ranks the rows change in number every step (traced,
        # each step would compile anew), so the grouped GEMMs run eagerly inside the compiled code.
        self.traceable = not ep.enabled
        # Whether the weight starts on a 16-byte boundary, as `torch._grouped_mm` needs (a weight is a view into a
        # flat buffer); read eagerly by `prepare_for_compiled`, where traced code cannot ask for an address.
        self.weight_aligned = False
        self.set_recipe(recipe)

    # The transposed FP8 copy (dgrad's operand) is made per backward, not kept: the experts hold most weights of a
    # MoE model, and keeping both copies held FP8's peak memory above BF16's (docs/moe.md).
    keeps_fp8_transpose = False
    # Each expert is quantized when a micro-batch first gives it rows (once per weight version still): a young
    # router leaves most experts idle (the MoE benchmark's: 33-52 of 64, job FS).
    quantizes_experts_lazily = True

    def why_unsupported(self, fp8: Fp8Recipe) -> Optional[str]:
        """Grouped expert linears run all three GEMMs in FP8 or none."""
        return None if fp8.all_gemms else PARTIAL_FP8_EXPERTS

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, in) sorted by expert, counts (local experts,) rows per expert (on the device: never read on
        the host by the grouped GEMMs) -> (M, out)."""
        fp8 = self.recipe.fp8
        if fp8 is None:
            if not (self.traceable and self.weight_aligned):
                return eager_grouped_linear(rows, self.weight, counts, None, None, None, self.wgrad_queue)
            return grouped_linear(rows, self.weight, counts, None, None, None, self.wgrad_queue,
                                  self.main_grad_slot)
        why = self.why_unsupported(fp8)
        if why is not None:
            raise ValueError(why)
        return grouped_linear(rows, self.weight, counts, self.fp8_cache, fp8, self.fp8_backend_for(rows.device),
                              self.wgrad_queue)

    def prepare_for_compiled(self) -> None:
        super().prepare_for_compiled()
        self.weight_aligned = self.weight.data_ptr() % 16 == 0

    def extra_repr(self) -> str:
        first, total = self.weight.expert_slice
        return (f"experts {first}..{first + self.weight.shape[0] - 1} of {total}, in_features={self.in_features}, "
                f"out_features={self.out_features}, fp8={self.runs_fp8}")


def _exchange(x: torch.Tensor, out_rows: list[int], in_rows: list[int], ep: ExpertParallel) -> torch.Tensor:
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    if x.element_size() == 1:  # FP8 bytes: not every backend knows the dtype
        dist.all_to_all_single(out.view(torch.uint8), x.contiguous().view(torch.uint8), out_rows, in_rows,
                               group=ep.group)
    else:
        dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=ep.group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_rows, in_rows, ep, quantize):
        ctx.out_rows, ctx.in_rows, ctx.ep = out_rows, in_rows, ep
        if quantize is None:
            return _exchange(x, out_rows, in_rows, ep)
        backend, fmt = quantize
        x_fp8, x_scale = backend.quantize_rows(x, fmt, False)
        rows_fp8 = _exchange(x_fp8, out_rows, in_rows, ep)
        rows_scale = _exchange(x_scale.contiguous(), out_rows, in_rows, ep)
        return dequantize_1x128(rows_fp8, rows_scale).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        return _exchange(dy, ctx.in_rows, ctx.out_rows, ctx.ep), None, None, None, None


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def count_per_expert(expert_idx: torch.Tensor, num_experts: int,
                     counted: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(num_experts,) int64: how many entries of `expert_idx` (tokens, k) name each expert, of the tokens `counted`
    (a (tokens,) bool mask; None: all). `torch.bincount` would give the same, but on CUDA it reads the input's max on
    the host first (a sync); an integer scatter-add is exact (and a masked row adds 0: no sync to select rows)."""
    flat = expert_idx.reshape(-1)
    ones = torch.ones_like(flat, dtype=torch.int64) if counted is None else \
        counted.unsqueeze(1).expand_as(expert_idx).reshape(-1).long()
    return flat.new_zeros(num_experts, dtype=torch.int64).scatter_add_(0, flat.long(), ones)


@dataclass
class Dispatched:
    """This rank's expert rows (expert-major, as a map into where they come from) and what `combine` needs."""

    rows: RowSource  # (sum of tokens_per_expert) rows: the tokens (EP=1) or the rows received from the EP group
    tokens_per_expert: torch.Tensor  # (local experts,) int64 on the device
    assignment_rows: torch.Tensor  # (N, k): row of each (token, slot) among the N*k rows sorted by expert
    regroup: Optional[torch.Tensor]  # received rows -> expert-major (EP only)
    send_rows: list[int]  # rows sent to each EP rank
    recv_rows: list[int]  # rows received from each EP rank


def dispatch(x: torch.Tensor, expert_idx: torch.Tensor, num_experts: int, ep: ExpertParallel,
             quantize: Optional[tuple[Fp8Backend, Fp8Format]] = None) -> Dispatched:
    """x (N, hidden) tokens, expert_idx (N, k) chosen experts -> this rank's experts' rows. With one EP rank
    nothing is copied here: the experts read the tokens through the row map (`RowSource`)."""
    n, k = expert_idx.shape
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # sorted row j is assignment order[j] = (token, slot) as t * k + s
    assignment_rows = _inverse(order).view(n, k)
    sorted_rows = RowSource(x, order // k, assignment_rows)
    counts = count_per_expert(flat, num_experts)  # (E,)
    if not ep.enabled:  # the counts stay on the device: nothing here waits for the GPU
        return Dispatched(sorted_rows, counts, assignment_rows, None, [n * k], [n * k])
    local = num_experts // ep.size
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=ep.group)  # (ep * local,): source-major
    recv_matrix = recv_counts.view(ep.size, local)
    send_rows = counts.view(ep.size, local).sum(1).tolist()
    recv_rows = recv_matrix.sum(1).tolist()
    received = _AllToAll.apply(eager_gather_rows(sorted_rows), recv_rows, send_rows, ep, quantize)
    # Received rows are ordered (source rank, local expert); regroup them expert-major, sources in order.
    segment = torch.repeat_interleave(torch.arange(ep.size * local, device=x.device), recv_counts)  # s * local + e
    regroup = torch.argsort((segment % local) * ep.size + segment // local, stable=True)
    rows = RowSource(received, regroup, _inverse(regroup).unsqueeze(1))
    return Dispatched(rows, recv_matrix.sum(0), assignment_rows, regroup, send_rows, recv_rows)


def combine(expert_out: torch.Tensor, out_rows: Optional[torch.Tensor], weights: torch.Tensor, plan: Dispatched,
            ep: ExpertParallel) -> torch.Tensor:
    """The experts' output -> (N, hidden): each token's outputs weighted by `weights` (N, k), summed in FP32.
    Expert row i's output is `expert_out[out_rows[i]]` (the padded FP8 layout), or `expert_out[i]` if `out_rows`
    is None."""
    pos = plan.assignment_rows
    if plan.regroup is not None:
        back = _inverse(plan.regroup)
        if out_rows is not None:
            back = out_rows[back]
        rows = _AllToAll.apply(expert_out.index_select(0, back), plan.send_rows, plan.recv_rows, ep, None)
        return eager_weighted_combine(rows, pos, weights)
    if out_rows is not None:
        pos = out_rows[pos]
    return weighted_combine(expert_out, pos, weights)
