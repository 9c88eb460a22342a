"""The compiled recomputation's whole forward marked for recomputation, whatever torch release traced it.

A recomputed compiled block is one function under activation checkpointing (`Block.checkpointed_forward`): Dynamo
marks each operation of the checkpointed region for recomputation (node meta `recompute`, `ac_graph_id`), and
AOTAutograd's min-cut partitioner then keeps only the block's input for backward. torch 2.11 leaves the operations
inside an `autograd.Function`'s forward unmarked (every linear's, BF16 and FP8: they route weight gradients into
`main_grad`), and the partitioner, free to choose for those, saves the GEMMs' outputs: on the GPU a ~1B block kept
~0.6 GiB more than its input (the QKV, output and gate/up projections' outputs; `docs/benchmarks.md`, jobs HR and
HU). torch 2.13 marks them. This pass, run on the joint graph before Inductor partitions it, marks every forward
operation that has no mark with the region's, so the partitioner recomputes the whole forward on either release.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy


def mark_the_forward_for_recomputation(graph: torch.fx.Graph) -> int:
    """Mark each unmarked operation of `graph`'s forward (the nodes that do not depend on a `tangents_*` input) as
    recomputed in the checkpointed region's name, where the graph holds exactly one region, and each write into a
    tensor (`_runs_once`) with its results as saved, whatever Dynamo marked it: it runs once, in the forward.
    Returns how many were marked for recomputation (0 where the graph has no region or several, which this pass
    leaves to the partitioner)."""
    regions = {node.meta["ac_graph_id"] for node in graph.nodes if "ac_graph_id" in node.meta}
    if len(regions) != 1:
        return 0
    (region,) = regions
    backward: set[torch.fx.Node] = set()
    for node in graph.nodes:  # in topological order: a node depending on a gradient is backward
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    marked = 0
    for node in graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        if _runs_once(node):  # a write into the expert weights' cache: its result is kept, not recomputed
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            node.meta["ac_graph_id"] = region
        elif "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            node.meta["ac_graph_id"] = region
            marked += 1
    return marked


RUNS_ONCE = ("megafp8::quantize_stale_experts",)  # ops writing a cache in place, undeclared (their docstrings)


def _runs_once(node) -> bool:
    """Whether `node` is an op of `RUNS_ONCE`, which runs once, in the forward, not again (the expert weights' cache:
    `megafp8.precision.fp8_ops.quantize_stale_experts`, whose small result is kept)."""
    target = getattr(node, "target", None)
    return isinstance(target, torch._ops.OpOverload) and target._schema.name in RUNS_ONCE


class RecomputeTheWholeForward(CustomGraphPass):
    """`mark_the_forward_for_recomputation` as Inductor's `joint_custom_pre_pass` (with a uuid, so Inductor's and
    AOTAutograd's caches key on it)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        mark_the_forward_for_recomputation(graph)

    def uuid(self) -> Optional[Any]:
        return "megafp8.recompute_the_whole_forward.v2"
