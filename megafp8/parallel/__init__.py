"""Parallelism: process-group layout, tensor-parallel layers and collectives, gradient buffers and their reductions."""
from megafp8.parallel.collectives import gather_from_tp_last, reduce_from_tp, to_tp_region
from megafp8.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from megafp8.parallel.context import context_attention, gather_sequence, share_of_group, sum_over_context
from megafp8.parallel.dims import ContextParallel, ExpertParallel, ParallelDims, TensorParallel, rank_groups
from megafp8.parallel.experts import ExpertLinear
from megafp8.parallel.grad_buckets import GradBuckets
from megafp8.parallel.layers import (
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    swiglu_mlp,
)
from megafp8.parallel.sharding import (
    TpShard,
    full_shape,
    gather_experts,
    gather_full,
    gather_param,
    is_expert,
    is_tp_partial,
    local_experts_of,
    local_piece,
    mark_tp_partial,
    shard_of,
    tp_shard_of,
)

__all__ = [
    "IGNORE_INDEX", "ColumnParallelLinear", "ContextParallel", "ExpertLinear", "context_attention",
    "gather_sequence", "share_of_group", "sum_over_context", "ExpertParallel", "gather_experts", "local_experts_of", "GradBuckets", "ParallelDims", "ParallelLinear", "RowParallelLinear", "TensorParallel",
    "TpShard", "VocabParallelEmbedding", "full_shape", "gather_from_tp_last", "gather_full", "gather_param", "is_expert", "is_tp_partial", "local_piece", "mark_tp_partial",
    "rank_groups", "reduce_from_tp", "shard_of", "swiglu_mlp", "to_tp_region", "tp_shard_of", "vocab_parallel_cross_entropy",
]
