"""Pipeline parallelism: the split of the model into stages, their placement on ranks, and the schedule.

The model is cut into `pp x stages_per_rank` consecutive stages (pipeline order). Stage 0 holds the
embedding, the last stage the final norm, LM head and loss (and the MTP modules). Placement:

- looped (`1f1b`, `interleaved_1f1b`, `interleaved_zb`): stage s runs on pipeline rank s % pp;
- V-shaped (`zbv`, `dualpipev`): rank r holds stages r and 2pp-1-r, so rank 0 holds the first and
  the last stage (the embedding and the head share a rank, as MTP needs).

The schedules are `torch.distributed.pipelining`'s. Zero-bubble schedules split each backward into
an input-gradient pass (I) and a weight-gradient pass (W) run later, in what would be bubbles. Torch's
own split re-runs autograd nodes to get weight gradients, which would run our FP8 linears' backward
twice; instead the layers push their weight-gradient GEMMs onto a `WeightGradQueue` during I, and the
stage's `dw_builder` runs them at W (see `megafp8.precision.WeightGradQueue`).

Evaluation uses `forward_only`: micro-batches go through the stages in order, one at a time, with
point-to-point sends (no schedule; torch's V schedules cannot run forward-only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from megafp8.config import ConfigError
from megafp8.config.layout import V_SHAPED, layer_counts
from megafp8.precision import GemmLayer, WeightGradQueue


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its place in pipeline order and the global indices of its transformer layers."""

    index: int
    layers: tuple[int, ...]
    first: bool  # holds the embedding
    last: bool  # holds the final norm, LM head, loss and MTP


@dataclass(frozen=True)
class PipelineLayout:
    """Every stage of the pipeline and which rank runs it."""

    stages: tuple[StageSpec, ...]
    pp: int
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def rank_of(self, stage: int) -> int:
        """Pipeline rank running `stage`."""
        if self.schedule in V_SHAPED:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def local_stages(self, pp_rank: int) -> list[StageSpec]:
        """The stages `pp_rank` runs, in pipeline order."""
        return [s for s in self.stages if self.rank_of(s.index) == pp_rank]

    def describe(self) -> str:
        parts = []
        for s in self.stages:
            span = f"layers {s.layers[0]}-{s.layers[-1]}" if s.layers else "no layers"
            extras = (["embedding"] if s.first else []) + (["head"] if s.last else [])
            parts.append(f"stage {s.index} (rank {self.rank_of(s.index)}): {span}"
                         + (f" + {' + '.join(extras)}" if extras else ""))
        return "; ".join(parts)


def build_layout(num_layers: int, pp: int, schedule: str, virtual_stages: int,
                 layout: Optional[str] = None) -> PipelineLayout:
    """The stages of the pipeline (pure: no process group needed)."""
    counts = layer_counts(num_layers, pp, schedule, virtual_stages, layout)
    num_stages = len(counts)
    stages, start = [], 0
    for index, count in enumerate(counts):
        stages.append(StageSpec(index, tuple(range(start, start + count)), index == 0, index == num_stages - 1))
        start += count
    return PipelineLayout(tuple(stages), pp, schedule)


# ------------------------------------------------------------------------------------------ bubble
_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # forward 1, full backward 2 (input 1 + weight 1)


def _compute_actions(actions: Sequence) -> list[tuple[int, str, int]]:
    """(stage, kind, micro-batch) of a rank's compute actions; overlapped F+B pairs count as both."""
    out = []
    for action in actions:
        if action is None:
            continue
        kind = action.computation_type.value
        if action.sub_actions:
            out += _compute_actions(action.sub_actions)
        elif kind in _COST:
            out.append((action.stage_index, kind, action.microbatch_index))
    return out


def simulated_bubble(pipeline_order: dict[int, Sequence], num_stages: int) -> Optional[float]:
    """Idle fraction of the ranks' time when a schedule's actions run with forward = 1, input-gradient = 1,
    weight-gradient = 1 (full backward = 2) and free communication; None if the order cannot complete."""
    queues = {rank: _compute_actions(actions) for rank, actions in pipeline_order.items()}
    finished: dict[tuple[int, str, int], float] = {}
    clock = {rank: 0.0 for rank in queues}
    position = {rank: 0 for rank in queues}

    def ready(stage: int, kind: str, mb: int) -> Optional[float]:
        if kind == "F":
            deps = [(stage - 1, "F", mb)] if stage > 0 else []
        elif kind in ("B", "I"):
            deps = [(stage, "F", mb)]
            if stage < num_stages - 1:
                deps.append((stage + 1, "B", mb) if (stage + 1, "B", mb) in finished else (stage + 1, "I", mb))
        else:  # W after this stage's input gradient
            deps = [(stage, "I", mb)]
        times = [finished.get(d) for d in deps]
        return None if any(t is None for t in times) else max(times, default=0.0)

    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while position[rank] < len(queue):
                stage, kind, mb = queue[position[rank]]
                start = ready(stage, kind, mb)
                if start is None:
                    break
                finished[(stage, kind, mb)] = max(start, clock[rank]) + _COST[kind]
                clock[rank] = finished[(stage, kind, mb)]
                position[rank] += 1
                progress = True
    if any(position[r] < len(q) for r, q in queues.items()) or not finished:
        return None
    makespan = max(clock.values())
    busy = [sum(_COST[k] for _, k, _ in q) for q in queues.values()]
    return 1.0 - sum(busy) / (len(busy) * makespan)


def bubble_fraction(schedule: object, num_stages: int, pp: int, n_micro: int) -> float:
    """The bubble a built schedule implies (simulated from its action table; the 1F1B formula
    (pp-1)/(m+pp-1) where torch gives no table)."""
    order = getattr(schedule, "pipeline_order", None)
    if order:
        simulated = simulated_bubble(order, num_stages)
        if simulated is not None:
            return simulated
    return (pp - 1) / (n_micro + pp - 1)


# ---------------------------------------------------------------------------------------- schedule
def build_schedule(chunks: Sequence[nn.Module], specs: Sequence[StageSpec], layout: PipelineLayout,
                   group: dist.ProcessGroup, device: torch.device, example_input: Callable[[StageSpec], torch.Tensor],
                   example_output: torch.Tensor, n_micro: int, loss_fn: Callable,
                   dw_builders: Optional[Sequence[Callable[[], Callable[[], None]]]] = None):
    """The `torch.distributed.pipelining` schedule running this rank's `chunks` (one per spec). Shapes are given
    up front (meta tensors), so no metadata-inference pass runs the model. The loss function's result is
    back-propagated as is (no division by the micro-batch count: `loss_fn` scales)."""
    # Imported here: torch's pipelining imports torch._dynamo (~2.5 s of CPU), which runs without PP never need.
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = []
    for i, (chunk, spec) in enumerate(zip(chunks, specs)):
        stages.append(PipelineStage(
            chunk, spec.index, layout.num_stages, device, input_args=example_input(spec),
            output_args=example_output, group=group,
            dw_builder=dw_builders[i] if dw_builders is not None else None))
    kinds = {"1f1b": schedules.Schedule1F1B, "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
             "interleaved_zb": schedules.ScheduleInterleavedZeroBubble, "zbv": schedules.ScheduleZBVZeroBubble,
             "dualpipev": schedules.ScheduleDualPipeV}
    cls = kinds[layout.schedule]
    try:
        return cls(stages[0] if layout.schedule == "1f1b" else stages, n_micro, loss_fn=loss_fn, scale_grads=False)
    except ValueError as err:  # torch's own constraints on the micro-batch count
        raise ConfigError(f"parallel.pp_schedule={layout.schedule} with {n_micro} micro-batches per step: {err} "
                          "(change training.global_batch_size or training.micro_batch_size)") from None


def forward_only(chunks: Sequence[nn.Module], specs: Sequence[StageSpec], layout: PipelineLayout, pp_rank: int,
                 group: dist.ProcessGroup, first_input: Optional[torch.Tensor], hidden_like: torch.Tensor
                 ) -> Optional[torch.Tensor]:
    """Run one micro-batch through every stage in order (no grad). Returns the last stage's output on the rank
    holding it, else None. `first_input` is needed on the rank holding stage 0; `hidden_like` gives the shape,
    dtype and device of activations passed between ranks."""
    mine = {spec.index: chunk for spec, chunk in zip(specs, chunks)}
    x = first_input
    for stage in range(layout.num_stages):
        owner = layout.rank_of(stage)
        previous = layout.rank_of(stage - 1) if stage > 0 else owner
        if previous != owner:  # hand the activation over
            if pp_rank == previous:
                dist.send(x.contiguous(), dist.get_global_rank(group, owner), group=group)
            elif pp_rank == owner:
                x = torch.empty_like(hidden_like)
                dist.recv(x, dist.get_global_rank(group, previous), group=group)
        if pp_rank == owner:
            x = mine[stage](x)
    return x if layout.rank_of(layout.num_stages - 1) == pp_rank else None


def attach_wgrad_queue(module: nn.Module, queue: WeightGradQueue) -> None:
    """Make every GEMM layer of `module` defer its weight gradients to `queue`."""
    for layer in module.modules():
        if isinstance(layer, GemmLayer):
            layer.wgrad_queue = queue
