"""Data: tokenizers, the on-disk token format, packed datasets and the data-parallel loader.

The datasets and the loader (torch) are imported on first use, so that preprocessing and the tools that read a
corpus's metadata load without torch."""
from __future__ import annotations

from typing import Any

from megafp8.data.indexed import ShardWriter, TokenStream, read_meta, token_dtype, write_meta
from megafp8.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

_DATASET_NAMES = ("DistributedLoader", "PackedDataset", "lockstep_validation_batches", "validation_batches",
                  "validation_micro_batches")

__all__ = [
    "ByteTokenizer", "DistributedLoader", "HFTokenizer", "PackedDataset", "ShardWriter", "TokenStream",
    "load_tokenizer", "lockstep_validation_batches", "read_meta", "token_dtype", "validation_batches",
    "validation_micro_batches", "write_meta",
]


def __getattr__(name: str) -> Any:
    if name in _DATASET_NAMES:
        from megafp8.data import dataset
        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
