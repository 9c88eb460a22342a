"""Named model sizes (Llama-style dense decoders with grouped-query attention); `model.size: NAME` in a config starts
from one.

Widths are multiples of 128 so that every GEMM dimension falls on FP8 tile edges.
"""
from __future__ import annotations

from typing import Any

MODEL_SIZES: dict[str, dict[str, Any]] = {
    # For CPU demos and tests: trains in minutes on two cores.
    "tiny": dict(hidden_size=256, num_layers=4, num_heads=4, attention=dict(num_kv_heads=2), ffn_hidden_size=768),
    "small": dict(hidden_size=512, num_layers=8, num_heads=8, attention=dict(num_kv_heads=4), ffn_hidden_size=1536),
    "125m": dict(hidden_size=768, num_layers=12, num_heads=12, attention=dict(num_kv_heads=12), ffn_hidden_size=2048),
    "350m": dict(hidden_size=1024, num_layers=24, num_heads=16, attention=dict(num_kv_heads=8), ffn_hidden_size=2816),
    # The ~1B shape of the performance bar in DESIGN.md.
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=16, attention=dict(num_kv_heads=16), ffn_hidden_size=5632),
    "3b": dict(hidden_size=3072, num_layers=28, num_heads=24, attention=dict(num_kv_heads=8), ffn_hidden_size=8192),
    "llama3-8b": dict(hidden_size=4096, num_layers=32, num_heads=32, attention=dict(num_kv_heads=8),
                      ffn_hidden_size=14336, rope_theta=500000.0),
}
