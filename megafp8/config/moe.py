"""`model.moe`: DeepSeek-V3-style mixture-of-experts MLPs, their checks and their parameter counts.

Its module is `megafp8.model.moe.MoE`; which blocks hold one is `megafp8.config.architecture.layer_spec`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megafp8.config.errors import ConfigError, divisors_near
from megafp8.config.fields import setting

ScoreFunc = Literal["softmax", "sigmoid"]


@dataclass
class MoeConfig:
    """Mixture-of-experts MLPs (DeepSeek-V3): an FP32 router, routed SwiGLU experts and shared experts in every block
    after the first `first_dense_layers`. `num_experts: 0` (the default): a dense model, every MLP a SwiGLU of
    `model.ffn_hidden_size`."""

    num_experts: int = setting(0, "Routed experts per MoE layer; 0: a dense model (every MLP is SwiGLU).")
    top_k: int = setting(2, "Experts each token is routed to.")
    ffn_hidden_size: int = setting(256, "Inner width of each expert's SwiGLU (and of each shared expert).")
    num_shared_experts: int = setting(1, "Shared experts applied to every token (0: none).")
    first_dense_layers: int = setting(
        1, "The first N blocks keep a dense SwiGLU MLP (`model.ffn_hidden_size`); the rest are MoE (DeepSeek-V3: 3)."
    )
    score_func: ScoreFunc = setting("sigmoid", "Router scores: `sigmoid` (DeepSeek-V3) or `softmax`, computed in FP32.")
    n_group: int = setting(
        1, "Group-limited routing: experts form this many groups and a token picks `topk_group` groups first."
    )
    topk_group: int = setting(1, "Groups a token may route into (with `n_group > 1`).")
    routed_scaling_factor: float = setting(1.0, "Multiplier of the routed experts' combined output (V3: 2.5).")
    norm_topk_prob: bool = setting(True, "Normalize each token's top-k weights to sum to 1 (before scaling).")
    bias_update_rate: float = setting(
        1e-3,
        "Auxiliary-loss-free load balancing: after each step every expert's selection bias moves by this much "
        "toward balance (down if overloaded, up if underloaded). 0 disables it.",
    )
    aux_loss_coeff: float = setting(
        0.0, "Weight of the sequence-wise auxiliary balance loss (DeepSeek-V3: 1e-4); 0 disables it."
    )

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def holds_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) is an MoE block."""
        return self.enabled and layer >= self.first_dense_layers

    def validate(self, num_layers: int) -> None:
        if self.num_experts == 0:
            return
        if self.num_experts < 0 or self.top_k < 1 or self.ffn_hidden_size < 1 or self.num_shared_experts < 0:
            raise ConfigError("model.moe.num_experts, top_k and ffn_hidden_size must be positive, "
                              "num_shared_experts >= 0")
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts={self.num_experts}: "
                              "lower top_k")
        if self.n_group < 1 or self.num_experts % self.n_group != 0:
            raise ConfigError(f"model.moe.n_group={self.n_group} must divide model.moe.num_experts="
                              f"{self.num_experts}: use one of {divisors_near(self.num_experts, self.n_group)}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"model.moe.topk_group={self.topk_group} must be between 1 and model.moe.n_group="
                              f"{self.n_group}")
        if self.top_k == 1 and self.norm_topk_prob:  # s / s = 1 whatever the score: no gradient reaches the router
            raise ConfigError("model.moe.top_k=1 with model.moe.norm_topk_prob=true weighs every token's expert 1, so "
                              "the router's weight gets no gradient from the loss and never learns: set "
                              "model.moe.norm_topk_prob=false (the expert's output scaled by its score) or raise top_k")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.top_k > reachable:
            raise ConfigError(f"model.moe.top_k={self.top_k} exceeds the {reachable} experts of the "
                              f"topk_group={self.topk_group} groups a token may use: raise model.moe.topk_group")
        if not 0 <= self.first_dense_layers < num_layers:  # (all dense: the expert statistics had no layer)
            raise ConfigError(f"model.moe.first_dense_layers={self.first_dense_layers} must be between 0 and "
                              f"model.num_layers - 1 = {num_layers - 1}, leaving at least one MoE block; for a dense "
                              "model set model.moe.num_experts=0")
        if self.routed_scaling_factor <= 0:  # 0 trained the routed experts to contribute nothing, without a word
            raise ConfigError(f"model.moe.routed_scaling_factor={self.routed_scaling_factor:g} must be positive (1: "
                              "the routed experts' output as combined; DeepSeek-V3: 2.5)")
        if self.bias_update_rate < 0 or self.aux_loss_coeff < 0:
            raise ConfigError("model.moe.bias_update_rate and model.moe.aux_loss_coeff must be >= 0")

    def params(self, hidden_size: int) -> int:
        """GEMM parameters of one MoE MLP: its router, every routed expert and the shared experts."""
        return hidden_size * self.num_experts + 3 * hidden_size * self.ffn_hidden_size * (
            self.num_experts + self.num_shared_experts)

    def active_params(self, hidden_size: int) -> int:
        """The GEMM parameters one token passes through: the router, its top-k experts and the shared ones."""
        return hidden_size * self.num_experts + 3 * hidden_size * self.ffn_hidden_size * (
            self.top_k + self.num_shared_experts)

    def tp_widths(self) -> dict[str, tuple[int, str]]:
        """Widths tensor parallelism splits: the shared experts (one SwiGLU); routed experts are not split."""
        if not self.enabled or self.num_shared_experts == 0:
            return {}
        return {"model.moe.num_shared_experts x ffn_hidden_size (shared-expert width)": (
            self.num_shared_experts * self.ffn_hidden_size, "model.moe.ffn_hidden_size")}

    def describe(self) -> str:
        return f"{self.num_experts} experts top-{self.top_k} (ffn {self.ffn_hidden_size})"
