"""Data: tokenizers, the on-disk token format, packed datasets and the data-parallel loader."""
from megafp8.data.dataset import DistributedLoader, PackedDataset, lockstep_validation_batches, validation_batches
from megafp8.data.indexed import ShardWriter, TokenStream, read_meta, token_dtype, write_meta
from megafp8.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer", "DistributedLoader", "HFTokenizer", "PackedDataset", "ShardWriter", "TokenStream",
    "load_tokenizer", "lockstep_validation_batches", "read_meta", "token_dtype", "validation_batches", "write_meta",
]
