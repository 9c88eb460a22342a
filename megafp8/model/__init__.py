"""The network: norms, RoPE, attention, MLP, blocks, the decoder, init, FLOP counts and the FP8 converter."""
from megafp8.model.flops import training_flops_per_token
from megafp8.model.fp8_converter import Fp8Converter, Fp8Plan
from megafp8.model.init import init_weights
from megafp8.model.mtp import LossTerms
from megafp8.model.rope import describe_rope
from megafp8.model.transformer import (Block, PipelineChunk, Transformer, apply_compile, apply_recompute,
                                       recomputed_blocks, resolve_vocab_size, unused_vocab_warning)

__all__ = ["Block", "Fp8Converter", "Fp8Plan", "LossTerms", "PipelineChunk", "Transformer", "apply_compile",
           "apply_recompute", "describe_rope", "init_weights", "recomputed_blocks", "resolve_vocab_size", "training_flops_per_token", "unused_vocab_warning"]
