"""The network: norms, RoPE, attention, MLP, blocks, the decoder, init and FLOP counts."""
from megafp8.model.flops import training_flops_per_token
from megafp8.model.init import init_weights
from megafp8.model.transformer import Block, Transformer

__all__ = ["Block", "Transformer", "init_weights", "training_flops_per_token"]
