"""megafp8: Megatron-style distributed LLM pretraining with DeepSeek-V3-style per-tile FP8."""

__version__ = "0.1.0"
