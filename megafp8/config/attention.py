"""`model.attention`: the attention of every block, one dataclass per kind (`model.attention.kind`).

Each kind holds its settings and answers for them: it validates itself, counts its parameters and FLOPs, and
lists the widths that FP8 tiles and tensor parallelism constrain. Its module is in `megafp8/model/`
(`megafp8.model.transformer.ATTENTION_MODULES`), which builds it from the model config. A new kind is one
subclass of `AttentionConfig` here, with its own `kind`, plus its module there.

The methods take the model's `hidden_size` and `num_heads`, which every kind shares (they stay `model.*`).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal, Optional

from megafp8.config.errors import ConfigError, divisors_near
from megafp8.config.fields import KindedSection, setting

Widths = dict[str, tuple[int, str]]  # what is constrained -> (its size, the settings that change it)
_QUERY_SETTINGS = "model.num_heads or model.attention.head_dim"
_KV_SETTINGS = "model.attention.num_kv_heads or model.attention.head_dim"


class AttentionConfig(KindedSection, abc.ABC):
    """The attention of every block; `kind` selects which settings apply."""

    kind: str

    @abc.abstractmethod
    def validate(self, hidden_size: int, num_heads: int) -> None:
        """A ConfigError naming the setting to change, where this attention cannot be built."""

    @abc.abstractmethod
    def params(self, hidden_size: int, num_heads: int) -> int:
        """GEMM parameters of one block's attention (its projections)."""

    @abc.abstractmethod
    def score_dims(self, hidden_size: int, num_heads: int) -> int:
        """Per head: the width QK^T contracts over plus the width of AV's output."""

    @abc.abstractmethod
    def rope_dim(self, hidden_size: int, num_heads: int) -> int:
        """Width of each head's rotary part."""

    @abc.abstractmethod
    def split_heads(self, num_heads: int) -> list[tuple[str, int]]:
        """(setting, count) of the heads that tensor parallelism splits over its ranks."""

    @abc.abstractmethod
    def tp_widths(self, hidden_size: int, num_heads: int) -> Widths:
        """Widths tensor parallelism splits (each rank's share must be whole 128-wide FP8 tiles)."""

    @abc.abstractmethod
    def fp8_widths(self, hidden_size: int, num_heads: int) -> Widths:
        """GEMM widths that must be whole 128-wide FP8 tiles under the FP8 recipe (at any tp)."""

    @abc.abstractmethod
    def describe(self, num_heads: int) -> str:
        """A few words for the start-up line and the dry run."""

    def core_flops(self, hidden_size: int, num_heads: int, seq_len: int) -> float:
        """Training FLOPs per token of the attention core (QK^T and AV) of one block: over the causal half of the
        T x T scores (T/2 keys on average), 2 FLOPs per multiply-add, forward + backward (x3)."""
        return 3 * 2 * (seq_len / 2) * num_heads * self.score_dims(hidden_size, num_heads)


@dataclass
class GqaConfig(AttentionConfig):
    """Grouped-query attention (Llama-style): `model.num_heads` query heads share `num_kv_heads` key/value heads,
    projected by one fused QKV linear."""

    kind: Literal["gqa"] = setting("gqa", "`gqa` selects grouped-query attention, with the settings of this table.")
    num_kv_heads: Optional[int] = setting(
        None, "Key/value heads; must divide `model.num_heads`. `null`: equal to `model.num_heads`."
    )
    head_dim: Optional[int] = setting(
        None, "Per-head width. `null`: `model.hidden_size / model.num_heads` (which must then divide evenly)."
    )
    qk_norm: bool = setting(
        False, "RMSNorm over each query head and each key head (one weight of `head_dim` shared by the query heads, "
        "one by the key heads), before RoPE: Qwen3's attention (OLMo 2 and Gemma 3 normalize queries and keys too). "
        "It bounds the attention logits' scale, a known cure for their growth in long runs. The norms are BF16/FP32 "
        "islands; under FP8 the QKV projection's quantizer then does not fuse RoPE's backward (the norms' backward "
        "lies between them). On one H200 the ~1B step ran 2.8% slower in BF16 and 4.7% in FP8 with them "
        "(`docs/benchmarks.md`, job HJ).",
    )

    qkv_bias: bool = setting(
        False, "A bias on the query, key and value projections (not the output projection's): Qwen2's and Qwen2.5's "
        "attention. Added to the QKV projection's output in the activations' dtype; under FP8 the QKV projection's "
        "quantizer then does not fuse RoPE's backward (the bias lies between them). On one H200 the ~1B step ran "
        "0.6% slower in BF16 and 2.9% in FP8 with it (job HJ).",
    )

    def head_dim_for(self, hidden_size: int, num_heads: int) -> int:
        return self.head_dim if self.head_dim is not None else hidden_size // num_heads

    def kv_heads_for(self, num_heads: int) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else num_heads

    def validate(self, hidden_size: int, num_heads: int) -> None:
        if self.head_dim is None and hidden_size % num_heads != 0:
            raise ConfigError(
                f"model.num_heads={num_heads} does not divide model.hidden_size={hidden_size}: set num_heads to a "
                f"divisor of hidden_size (e.g. {divisors_near(hidden_size, num_heads)}) or set model.attention.head_dim"
            )
        kv = self.kv_heads_for(num_heads)
        if kv <= 0 or num_heads % kv != 0:
            raise ConfigError(f"model.attention.num_kv_heads={kv} must divide model.num_heads={num_heads} "
                              f"(grouped-query attention): use one of {divisors_near(num_heads, kv)}")
        head_dim = self.head_dim_for(hidden_size, num_heads)
        if head_dim <= 0 or head_dim % 2 != 0:
            raise ConfigError(f"the head dimension ({head_dim}) must be positive and even for RoPE: change "
                              "model.attention.head_dim")

    def params(self, hidden_size: int, num_heads: int) -> int:
        head_dim, kv = self.head_dim_for(hidden_size, num_heads), self.kv_heads_for(num_heads)
        return hidden_size * (num_heads + 2 * kv) * head_dim + num_heads * head_dim * hidden_size

    def score_dims(self, hidden_size: int, num_heads: int) -> int:
        return 2 * self.head_dim_for(hidden_size, num_heads)

    def rope_dim(self, hidden_size: int, num_heads: int) -> int:
        return self.head_dim_for(hidden_size, num_heads)

    def split_heads(self, num_heads: int) -> list[tuple[str, int]]:
        return [("model.num_heads", num_heads), ("model.attention.num_kv_heads", self.kv_heads_for(num_heads))]

    def tp_widths(self, hidden_size: int, num_heads: int) -> Widths:
        head_dim, kv = self.head_dim_for(hidden_size, num_heads), self.kv_heads_for(num_heads)
        return {"model.num_heads x head_dim (query features)": (num_heads * head_dim, _QUERY_SETTINGS),
                "model.attention.num_kv_heads x head_dim (key/value features)": (kv * head_dim, _KV_SETTINGS)}

    def fp8_widths(self, hidden_size: int, num_heads: int) -> Widths:
        # Unsplit, the key/value features need not be whole tiles on their own: the fused QKV projection's rows must.
        head_dim, kv = self.head_dim_for(hidden_size, num_heads), self.kv_heads_for(num_heads)
        qkv = (num_heads + 2 * kv) * head_dim
        return {"num_heads x head_dim (attention width)": (num_heads * head_dim, _QUERY_SETTINGS),
                "(num_heads + 2 x num_kv_heads) x head_dim (QKV width)": (qkv, _KV_SETTINGS)}

    def describe(self, num_heads: int) -> str:
        extras = [name for name, on in (("qk-norm", self.qk_norm), ("qkv bias", self.qkv_bias)) if on]
        return f"{num_heads} heads / {self.kv_heads_for(num_heads)} kv" + "".join(f", {e}" for e in extras)


@dataclass
class MlaConfig(AttentionConfig):
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank compression, keys and
    values from one joint compression, a decoupled rotary part whose key all heads share."""

    kind: Literal["mla"] = setting("mla", "`mla` selects multi-head latent attention, with the settings of this table.")
    q_lora_rank: Optional[int] = setting(
        None, "Rank of the query compression (V3: 1536); `null`: queries projected directly from the input."
    )
    kv_lora_rank: int = setting(512, "Rank of the joint key/value compression (V3: 512).")
    qk_nope_head_dim: int = setting(128, "Per-head query/key width without rotary embedding (V3: 128).")
    qk_rope_head_dim: int = setting(
        64, "Per-head query/key width with rotary embedding; the key's is shared by all heads (V3: 64)."
    )
    v_head_dim: int = setting(128, "Per-head value width (V3: 128).")

    def validate(self, hidden_size: int, num_heads: int) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.attention.{key} must be positive, got {getattr(self, key)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"model.attention.q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2 != 0:
            raise ConfigError(f"model.attention.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")

    def params(self, hidden_size: int, num_heads: int) -> int:
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (hidden_size * self.q_lora_rank + self.q_lora_rank * num_heads * qk if self.q_lora_rank
             else hidden_size * num_heads * qk)
        kv = (hidden_size * (self.kv_lora_rank + self.qk_rope_head_dim)
              + self.kv_lora_rank * num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + num_heads * self.v_head_dim * hidden_size

    def score_dims(self, hidden_size: int, num_heads: int) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim

    def rope_dim(self, hidden_size: int, num_heads: int) -> int:
        return self.qk_rope_head_dim

    def split_heads(self, num_heads: int) -> list[tuple[str, int]]:
        return [("model.num_heads", num_heads)]

    def tp_widths(self, hidden_size: int, num_heads: int) -> Widths:
        return {
            "model.num_heads x (qk_nope_head_dim + qk_rope_head_dim) (MLA query features)": (
                num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim),
                "model.attention.qk_nope_head_dim or qk_rope_head_dim"),
            "model.num_heads x (qk_nope_head_dim + v_head_dim) (MLA key/value features)": (
                num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                "model.attention.qk_nope_head_dim or v_head_dim"),
            "model.num_heads x v_head_dim (MLA output features)": (num_heads * self.v_head_dim,
                                                                   "model.attention.v_head_dim"),
        }

    def fp8_widths(self, hidden_size: int, num_heads: int) -> Widths:
        # The head widths, and the ranks the down projections output. kv_a (kv_lora_rank + qk_rope_head_dim rows) is
        # usually not whole tiles: it stays BF16, named at start-up.
        widths = {**self.tp_widths(hidden_size, num_heads),
                  "model.attention.kv_lora_rank": (self.kv_lora_rank, "model.attention.kv_lora_rank")}
        if self.q_lora_rank:
            widths["model.attention.q_lora_rank"] = (self.q_lora_rank, "model.attention.q_lora_rank")
        return widths

    def describe(self, num_heads: int) -> str:
        return f"{num_heads} heads MLA (q/kv ranks {self.q_lora_rank}/{self.kv_lora_rank})"
