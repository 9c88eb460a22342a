"""Parallelism: process-group layout, parallel layers, gradient buffers and their reductions."""
from megafp8.parallel.dims import ParallelDims
from megafp8.parallel.grad_buckets import GradBuckets
from megafp8.parallel.layers import (
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear", "GradBuckets", "ParallelDims", "ParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]
