"""Parallelism: process-group layout, parallel layers, gradient buffers and their reductions."""
from megafp8.parallel.dims import ParallelDims
from megafp8.parallel.grad_buffer import GradBuffer
from megafp8.parallel.layers import (
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear", "GradBuffer", "ParallelDims", "ParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]
