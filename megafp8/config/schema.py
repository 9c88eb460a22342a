"""Typed configuration dataclasses: one section per concern, a doc string for every field.

Each field is declared with `setting(default, doc)` (`megafp8/config/fields.py`), which keeps the field's
documentation; the loader uses it for error messages and `tools/config_reference.py` turns it into
`docs/configs.md`. The model's attention and mixture-of-experts sections live beside their checks and counts, in
`megafp8/config/attention.py` and `megafp8/config/moe.py`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

from megafp8.config.attention import AttentionConfig, GqaConfig
from megafp8.config.fields import field_doc, section, setting
from megafp8.config.moe import MoeConfig

PrecisionName = Literal["auto", "bf16", "fp8", "fp16", "fp32"]
ConcreteRecipe = Literal["bf16", "fp8", "fp16", "fp32"]
Fp8FormatName = Literal["e4m3", "e5m2"]
DecayStyle = Literal["cosine", "linear", "wsd", "constant"]
MomentDtype = Literal["fp32", "bf16"]
LoggerName = Literal["jsonl", "tensorboard", "wandb"]
DeviceName = Literal["auto", "cpu", "cuda"]
BackendName = Literal["auto", "gloo", "nccl"]
CheckpointFormat = Literal["sharded", "full"]
RecomputeMode = Literal["none", "full"]
RecomputeCompiled = Literal["auto", "in_graph", "around"]
AttentionBackend = Literal["auto", "torch", "cudnn", "flash", "efficient", "math"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
PipelineScheduleName = Literal["1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]
RopeScalingType = Literal["none", "yarn", "llama3"]


@dataclass
class RopeScalingConfig:
    """Rotary-frequency scaling for long-context extension: none, YaRN (as DeepSeek-V2/V3 ship it) or Llama-3.1's
    `llama3` scaling. The formulas are those of Hugging Face `transformers` (`modeling_rope_utils`), so converted
    checkpoints compute the same function."""

    type: RopeScalingType = setting(
        "none",
        "`none`: plain RoPE. `yarn`: frequencies blended between interpolated (divided by `factor`) and original "
        "by a ramp over `beta_slow`..`beta_fast` rotations per original context; cos/sin scaled by YaRN's attention "
        "factor (from `mscale`, `mscale_all_dim`). `llama3`: wavelengths above original / `low_freq_factor` divided "
        "by `factor`, below original / `high_freq_factor` kept, smoothly blended between.",
    )
    factor: float = setting(1.0, "Context-extension factor (DeepSeek-V3's YaRN: 40; Llama-3.1: 8).")
    original_max_position_embeddings: int = setting(
        4096, "The context length the model was trained at before scaling (DeepSeek-V3: 4096; Llama-3.1: 8192)."
    )
    beta_fast: float = setting(32.0, "yarn: rotations per original context above which a dim keeps its frequency.")
    beta_slow: float = setting(1.0, "yarn: rotations per original context below which a dim is fully interpolated.")
    mscale: float = setting(
        0.0,
        "yarn: with `mscale_all_dim`, cos/sin are scaled by m(mscale) / m(mscale_all_dim), m(s) = 0.1 s ln(factor) "
        "+ 1 (DeepSeek-V3: 1.0 and 1.0). If either is 0: by m(1).",
    )
    mscale_all_dim: float = setting(
        0.0, "yarn, MLA: the softmax scale is multiplied by m(mscale_all_dim)^2 (DeepSeek-V3: 1.0); 0: not."
    )
    low_freq_factor: float = setting(1.0, "llama3: original / this is the wavelength above which `factor` applies.")
    high_freq_factor: float = setting(4.0, "llama3: original / this is the wavelength below which frequencies stay.")


@dataclass
class ModelConfig:
    """Architecture of the decoder (Llama-style: pre-norm RMSNorm, RoPE, SwiGLU) with its attention
    (`attention.kind`: grouped-query or DeepSeek's latent attention) and, optionally, DeepSeek-V3-style
    mixture-of-experts MLPs (`moe.num_experts > 0`)."""

    # Keys of the flat layout before `attention` and `moe` became sections: a config that sets one is told where it
    # went, and a saved config that has them is read through `upgrade_saved_model`.
    moved: ClassVar[dict[str, str]] = {
        **{key: f"attention.{key}" for key in ("num_kv_heads", "head_dim", "q_lora_rank", "kv_lora_rank",
                                                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
        **{f"moe_{key}": f"moe.{key}" for key in ("num_experts", "top_k", "ffn_hidden_size", "num_shared_experts",
                                                   "first_dense_layers", "score_func", "n_group", "topk_group",
                                                   "routed_scaling_factor", "norm_topk_prob", "bias_update_rate",
                                                   "aux_loss_coeff")},
    }

    size: Optional[str] = setting(
        None,
        "Named size from `megafp8.config.sizes.MODEL_SIZES` (e.g. `tiny`, `125m`, `1b`). Its values fill "
        "every model field not given explicitly in the YAML file or on the command line.",
    )
    vocab_size: Optional[int] = setting(
        None,
        "Rows of the embedding and LM head. `null`: the tokenizer's vocabulary, padded up to "
        "`pad_vocab_to_multiple_of`. If set, it must be at least the tokenizer's vocabulary size.",
    )
    pad_vocab_to_multiple_of: int = setting(
        128, "When `vocab_size` is derived from the tokenizer, pad it to this multiple (GEMM-friendly). The padding "
        "does not depend on parallel.tp, so a checkpoint loads at any layout; only a tp that does not divide the "
        "padded size (not a power of two up to this multiple) pads further, to a multiple of lcm(this, tp)."
    )
    hidden_size: int = setting(256, "Width of the residual stream.")
    num_layers: int = setting(4, "Number of transformer blocks.")
    num_heads: int = setting(4, "Attention (query) heads, of every attention kind.")
    attention: AttentionConfig = section(
        GqaConfig, "The attention of every block: its `kind` and that kind's settings (a table each, below)."
    )
    attention_backend: AttentionBackend = setting(
        "auto",
        "The kernel of the attention core (an SDPA backend). `auto`: cuDNN's fused attention first on Hopper GPUs "
        "(called alone 1.7x FlashAttention-2 there and 9.5x the memory-efficient kernel on MLA's heads, at the same "
        "numerics; whole steps on torch 2.11 did not change, torch already chose cuDNN inside the model), torch's "
        "own choice elsewhere; `torch`: torch's own choice everywhere (its heuristics differ between versions and "
        "calls); `cudnn` (NVIDIA GPUs), `flash`, `efficient` (GPUs) or `math`: that backend only (SDPA raises where "
        "one cannot take the shapes). Changes speed, not the model: any value resumes any checkpoint.",
    )
    ffn_hidden_size: int = setting(768, "Inner width of the SwiGLU MLP (of every block without experts).")
    norm_eps: float = setting(1e-5, "Epsilon of RMSNorm.")
    rope_theta: float = setting(10000.0, "Base of the rotary position embedding frequencies.")
    rope_scaling: RopeScalingConfig = section(
        RopeScalingConfig, "Rotary-frequency scaling (YaRN, Llama-3.1) for long-context extension."
    )
    init_std: float = setting(
        0.02,
        "Standard deviation of the normal init of embeddings and linears; output projections of each block "
        "are further scaled by 1/sqrt(2 * num_layers).",
    )
    mtp_depth: int = setting(
        0,
        "Multi-token prediction (DeepSeek-V3): this many extra sequential modules, module k predicting the token "
        "k + 1 positions ahead from the previous module's states and the embedding of token i + k; they share the "
        "embedding and output head. 0 disables it.",
    )
    mtp_loss_weight: float = setting(
        0.3, "Weight of the mean MTP cross-entropy in the training loss (V3: 0.3, later 0.1); the validation loss "
        "is the main head's cross-entropy alone."
    )
    moe: MoeConfig = section(MoeConfig, "Mixture-of-experts MLPs; `num_experts: 0` (the default): a dense model.")


def upgrade_saved_model(saved: dict[str, Any]) -> dict[str, Any]:
    """A model section saved in the flat layout (a checkpoint's or a run directory's config, from before `attention`
    and `moe` were sections) in today's layout; one already in it is returned as it is. The saved attention kind's
    settings are kept, the other kind's (saved with their defaults) dropped."""
    attention = saved.get("attention")
    if not isinstance(attention, str) and not any(key in ModelConfig.moved for key in saved):
        return saved
    kind = attention if isinstance(attention, str) else GqaConfig().kind
    kind_fields = {f.name for f in dataclasses.fields(AttentionConfig.kinds().get(kind, GqaConfig))}
    out: dict[str, Any] = {k: v for k, v in saved.items() if k not in ModelConfig.moved and k != "attention"}
    out["attention"] = {"kind": kind}
    for old, new in ModelConfig.moved.items():
        section_name, key = new.split(".")
        if old in saved and (section_name != "attention" or key in kind_fields):
            out.setdefault(section_name, {})[key] = saved[old]
    return out


@dataclass
class ParallelConfig:
    """How ranks are laid out: tensor parallelism innermost (consecutive ranks), data parallelism over the rest."""

    tp: int = setting(
        1,
        "Tensor-parallel ranks: attention heads, MLP width and vocabulary are split across them. Must divide "
        "the launched ranks, model.num_heads, model.attention.num_kv_heads and vocab_size; above 1, every GEMM shard "
        "(heads x head widths / tp, ffn_hidden_size / tp) must be a multiple of 128 (the vocabulary's need not: the "
        "embedding and LM head stay BF16). Keep it within a node (NVLink).",
    )
    sequence_parallel: bool = setting(
        False,
        "With tp > 1: outside the tensor-parallel regions (norms, residual stream) each rank keeps 1/tp of the "
        "tokens, and the TP all-reduces become all-gather + reduce-scatter (FP8 bytes for FP8 layers). Saves "
        "activation memory at the same communication volume. Needs micro_batch_size x seq_len divisible by tp.",
    )
    dp: Optional[int] = setting(
        None, "Data-parallel ranks. `null`: launched ranks / (tp x pp). If set, it must equal that."
    )
    cp: int = setting(
        1,
        "Context-parallel ranks: each sequence's tokens are split over them (2 x cp chunks, rank r holding chunks r "
        "and 2cp-1-r, so causal attention's work is even), and attention gathers the keys and values of the whole "
        "sequence from the group. Carved out of the data-parallel ranks (it must divide them): the group shares its "
        "sequences, so a step's global_batch_size sequences are split over dp / cp groups. For sequences whose "
        "activations do not fit one rank (long-context stages). Needs data.seq_len divisible by 2 x cp.",
    )
    pp: int = setting(
        1,
        "Pipeline-parallel stages (ranks). The layers are split into `pp x virtual stages` pipeline stages: the "
        "embedding on the first, the final norm, LM head, loss (and MTP) on the last. Outermost in the rank "
        "placement (stages may span nodes).",
    )
    pp_schedule: PipelineScheduleName = setting(
        "1f1b",
        "Pipeline schedule (`torch.distributed.pipelining`): `1f1b` (one stage per rank), `interleaved_1f1b` and "
        "`interleaved_zb` (zero-bubble: weight gradients deferred into the bubbles) with `pp_virtual_stages` "
        "looped stages per rank, `zbv` (zero-bubble V) and `dualpipev` (DeepSeek's DualPipe, V-shaped), both "
        "with two stages per rank placed in a V (rank 0 holds the first and the last stage). The bubble fraction "
        "is logged at start-up.",
    )
    pp_virtual_stages: int = setting(
        2, "Stages per rank for `interleaved_1f1b` / `interleaved_zb` (`1f1b` uses 1; `zbv`, `dualpipev` use 2)."
    )
    pp_layout: Optional[str] = setting(
        None,
        "Explicit split of the model into pipeline stages, in pipeline order: stages separated by `|`, each a "
        "comma list of `E` (embedding, first stage only), `t` or `t*N` (N transformer layers), `L` (final norm, "
        "LM head and loss; last stage only; MTP modules go with it). E.g. `E,t*3|t*5|t*5|t*3,L` for 16 layers "
        "on 4 stages. `null`: layers split evenly (earlier stages take the remainder).",
    )
    ep: int = setting(
        1,
        "Expert-parallel ranks (MoE): the routed experts are split across `ep` data-parallel ranks, tokens reach "
        "them by all-to-all. Must divide the data-parallel size and model.moe.num_experts.",
    )
    ep_dispatch_fp8: bool = setting(
        False,
        "MoE under precision.recipe=fp8: quantize tokens to FP8 (1x128 tiles) before the dispatch all-to-all "
        "(about half the bytes; the expert GEMM re-quantizes them to the same values, but the experts' weight "
        "gradients then see FP8-rounded rows). Gradients travel in BF16. Under another recipe it is warned of at "
        "start-up.",
    )
    backend: BackendName = setting(
        "auto", "`torch.distributed` backend: `auto` picks NCCL when training on CUDA and gloo on CPU."
    )
    timeout_minutes: float = setting(
        30.0, "Timeout of collectives, on every process group (tensor-, data-, pipeline- and expert-parallel), "
        "before a rank gives up with an error.")


@dataclass
class PrecisionConfig:
    """Numerics of weights, activations and GEMMs. A setting only FP8 (`fp8_*`, `bf16_*`) or FP16 (`loss_scale_*`)
    reads, given under another recipe, is warned of at start-up: it changes nothing there (under `auto`, once the
    device has chosen the recipe)."""

    recipe: PrecisionName = setting(
        "bf16",
        "`bf16`: BF16 weights, activations and GEMMs, FP32 master weights, optimizer states and gradient "
        "accumulation. `fp8`: as bf16, but the attention projections and MLP linears run their three GEMMs "
        "(fprop, dgrad, wgrad) in per-tile scaled FP8 (DeepSeek-V3 recipe). `fp16`: FP16 weights and GEMMs "
        "with dynamic loss scaling (GPUs without BF16). `fp32`: everything in FP32. `auto`: from the GPU "
        "(below SM80 fp16, SM80/SM89 bf16, SM90+ fp8; on CPU `auto_cpu_recipe`), logged at start-up.",
    )
    auto_cpu_recipe: ConcreteRecipe = setting("bf16", "The recipe `auto` picks when training on CPU.")
    fp8_start_step: int = setting(
        0, "Under fp8: train in BF16 until this optimizer step, then switch the FP8 layers on (no restart)."
    )
    loss_scale_initial: float = setting(65536.0, "fp16: initial loss scale.")
    loss_scale_growth_interval: int = setting(1000, "fp16: grow the scale after this many steps without inf/nan.")
    loss_scale_growth_factor: float = setting(2.0, "fp16: factor of each growth.")
    loss_scale_backoff_factor: float = setting(0.5, "fp16: factor applied when inf/nan gradients persist.")
    loss_scale_hysteresis: int = setting(2, "fp16: inf/nan steps tolerated (skipped) before the scale backs off.")
    loss_scale_min: float = setting(1.0, "fp16: the scale never goes below this.")
    fp8_backend: str = setting(
        "auto",
        "FP8 GEMM backend: `auto` (the fastest that runs here, logged), or one by name: `reference` (any device; "
        "FP8 casts, FP32 matmul), `triton` (CUDA), `cublas` (SM90, `F.scaled_mm` blockwise), `hopper` (SM90 with "
        "Triton's Gluon: `cublas` with warp-specialized grouped expert GEMMs and dense fprop/dgrad), `deepgemm` "
        "(`hopper` with the dense fprop/dgrad on DeepSeek's DeepGEMM where it is installed: what `auto` picks "
        "there, else `hopper`); `megafp8.precision.backends` lists them.",
    )
    fp8_grad_format: Fp8FormatName = setting(
        "e4m3", "Format of activation gradients in dgrad/wgrad: `e4m3` (DeepSeek-V3) or `e5m2` (more range)."
    )
    fp8_power_of_two_scales: bool = setting(
        False, "Round every tile scale up to a power of two (re-tiling for wgrad then loses no bits)."
    )
    fp8_fprop: bool = setting(True, "Run the forward GEMM (y = x w^T) of FP8 layers in FP8.")
    fp8_dgrad: bool = setting(True, "Run the input-gradient GEMM (dx = dy w) of FP8 layers in FP8.")
    fp8_wgrad: bool = setting(True, "Run the weight-gradient GEMM (dw = dy^T x) of FP8 layers in FP8.")
    fp8_keep_weight_transpose: bool = setting(
        False,
        "Keep each dense FP8 weight's transposed copy (what the input-gradient GEMM reads) for as long as the weight "
        "is unchanged: one byte per FP8 parameter more held. `false` (the default) makes it in each backward from "
        "the kept FP8 weight instead (the same bits); on one H200 that cost no measurable step time on the ~1B and "
        "8B-layer shapes and held 0.75 and 1.81 GiB less (`docs/benchmarks.md`). Expert weights always work this way.",
    )
    fp8_wgrad_input_blocks: bool = setting(
        False,
        "Opt-in, a departure from DeepSeek-V3's recipe: quantize the weight gradient's input x in 128x128 blocks "
        "(features x tokens) instead of 1x128 tiles along the tokens, where a row + column quantizer makes it "
        "(RMSNorm's output, an FP8 linear's own input, the MoE dispatch, the dense MLP's SwiGLU output; the experts' "
        "SwiGLU output keeps its tiles). The wgrad GEMM then runs 1.19-1.46x faster on one H200; dW's error grows "
        "0-2% on activations with channel structure, 34% with token outliers; a 3,000-step ~1B run ended within "
        "0.12% of BF16's validation loss (`docs/precision.md`). Needs the hopper backend (or reference).",
    )
    fp8_layers: list[str] = setting(
        ["*"],
        "Globs of GEMM layer names (e.g. `layers.*.mlp.*`) that run FP8 under `recipe: fp8`. Naming a "
        "precision island (embedding, LM head, norms) is an error.",
    )
    bf16_layers: list[str] = setting(
        [], "Globs of GEMM layer names kept in BF16 even if `fp8_layers` matches them (e.g. `layers.0.*`)."
    )
    bf16_first_last_blocks: int = setting(
        0, "Keep the first and the last N transformer blocks entirely in BF16, and (N > 0) every multi-token "
        "prediction module: each one's block follows the last and feeds the shared output head like it."
    )


@dataclass
class OptimizerConfig:
    """AdamW on FP32 master weights, global grad-norm clipping and the learning-rate schedule."""

    lr: float = setting(3e-4, "Peak learning rate, reached at the end of warmup.")
    min_lr: float = setting(3e-5, "Learning rate at the end of decay.")
    warmup_steps: int = setting(100, "Linear warmup from 0 to `lr` over this many steps.")
    decay_style: DecayStyle = setting(
        "cosine",
        "After warmup: `cosine` or `linear` decay to `min_lr` at the last step; `wsd` (warmup-stable-decay) "
        "holds `lr` then decays linearly over the last `wsd_decay_fraction` of steps; `constant` holds `lr`.",
    )
    wsd_decay_fraction: float = setting(
        0.2, "Fraction of all steps spent decaying when `decay_style: wsd` (at least two steps: the first at `lr`, the "
        "last at `min_lr`); given with another decay_style, it is warned of at start-up."
    )
    weight_decay: float = setting(0.1, "Decoupled weight decay; applied to matrices only (not norms or biases).")
    beta1: float = setting(0.9, "AdamW beta1.")
    beta2: float = setting(0.95, "AdamW beta2.")
    eps: float = setting(1e-8, "AdamW epsilon.")
    grad_clip: float = setting(1.0, "Clip the global gradient L2 norm to this value; 0 disables clipping.")
    sharded: bool = setting(
        True,
        "Shard FP32 master weights, AdamW moments and reduced gradients across data-parallel ranks (ZeRO-style, "
        "reduce-scatter + all-gather). `false`: every rank all-reduces and keeps the full state.",
    )
    moment_dtype: MomentDtype = setting("fp32", "Dtype of the AdamW moments: `fp32`, or `bf16` (as DeepSeek-V3).")
    fused_update: bool = setting(
        True, "On NVIDIA GPUs of compute capability 8.0 and up, apply the clipping scale, AdamW and the cast into the "
        "model's weights in one kernel per shard (FP32 moments: torch's fused AdamW's arithmetic, 30 bytes moved per "
        "parameter against 42; BF16 moments: the same FP32 arithmetic, rounded when stored, 22 bytes against ~180). "
        "Elsewhere, or `false`: separate passes (`_foreach_mul_`, torch's fused AdamW or FP32 element-wise ops for "
        "BF16 moments, a copy)."
    )
    bucket_size_mb: float = setting(64.0, "Size of a gradient bucket (FP32 MB).")
    overlap_grad_reduce: bool = setting(
        True, "Start each bucket's reduction as soon as its last gradient is ready (overlapping backward); "
        "`false`: reduce all buckets after backward."
    )


@dataclass
class DataConfig:
    """Tokenized data written by `tools/preprocess_data.py`."""

    path: str = setting(
        "data/pystdlib", "Directory written by `tools/preprocess_data.py` (holds `meta.json` and the splits)."
    )
    paths: list[str] = setting(
        [],
        "Several directories written by `tools/preprocess_data.py`, trained on as one mixture; given, it replaces "
        "`data.path`. Their tokenizers must agree. Validation reads every held-out sample of each, interleaved by "
        "weight (`docs/data.md`).",
    )
    weights: list[float] = setting(
        [],
        "With `data.paths`: each one's share of the training samples, in their order (any positive numbers; "
        "normalized). A dataset weighted above its share of the tokens is read several times an epoch. Empty: "
        "shares by size, as one corpus of them all.",
    )
    seq_len: int = setting(256, "Tokens per training sample (the model's context length).")
    train_split: str = setting("train", "Name of the split trained on.")
    valid_split: str = setting("valid", "Name of the held-out split used for validation loss.")
    seed: Optional[int] = setting(
        None,
        "Seed of the sample order (the loader's shuffle). `null`: `training.seed`. Set it to give runs that differ "
        "only in `training.seed` (their weight init) the same data in the same order. 0 to 2^32 - 1.",
    )

    @property
    def directories(self) -> list[str]:
        """The tokenized directories a run reads: `paths`, else `path`."""
        return list(self.paths) or [self.path]


@dataclass
class TrainingConfig:
    """The training loop: batch sizes, length, evaluation, seed and device."""

    steps: int = setting(200, "Optimizer steps to train for.")
    global_batch_size: int = setting(
        16,
        "Samples per optimizer step over all data-parallel ranks; must be a multiple of "
        "`micro_batch_size * data-parallel ranks (launched ranks / (parallel.tp x parallel.pp))` (the quotient is the "
        "number of gradient-accumulation micro-batches, which is also the pipeline's micro-batch count).",
    )
    micro_batch_size: int = setting(4, "Samples per forward/backward pass on one rank.")
    eval_interval: int = setting(50, "Evaluate validation loss every this many steps (and at the end); 0 disables.")
    eval_iters: int = setting(
        4, "Micro-batches in one validation pass, split across data-parallel ranks (the same set for any layout); "
        "-1: every whole micro-batch of the validation split (its last samples short of one left out)."
    )
    seed: int = setting(
        1234, "Seed of weight init and (unless `data.seed` is set) data shuffling; the same seed gives the same run. "
        "0 to 2^32 - 1."
    )
    deterministic: bool = setting(
        False,
        "Make a run repeatable bit for bit on the same GPUs, software and layout: torch's deterministic algorithms "
        "(an op without one stops the run naming it), cuBLAS's fixed workspace (`CUBLAS_WORKSPACE_CONFIG=:4096:8` "
        "unless set), cuDNN deterministic and not benchmarking, Inductor without on-device timing. Without it GPU runs "
        "of one seed drift apart (kernels whose sums or atomic adds take another order each run): seven BF16 runs of "
        "the MoE parity model ended 2.0% apart (`docs/precision.md`). For debugging, bisecting and exact resumes. "
        "Shown on the CPU, on a small model on one GPU (eager and compiled), and on the 3.2B MoE step under CUDA "
        "graphs (H100: the same first gradients and losses twice in BF16 and FP8, where plain runs differed; no "
        "measurable cost, `docs/benchmarks.md` jobs IT-IU) and on the ~1B dense step (job JB: plain BF16 runs "
        "differed in 91 of 99 first gradients) and the 8B-layer step (job JH: 43 of 51); no measurable cost on the "
        "~1B and 8B-layer steps (job IY); several GPUs not yet checked. Its parts alone (`benchmarks/determinism.py "
        "--only`, job JM, one draw each, the 8B-layer FP8 step): the cuBLAS workspace, cuDNN's or Inductor's setting "
        "left 43, 26 and 3 of 51 gradients differing; torch's deterministic algorithms alone repeated every gradient "
        "and loss.",
    )
    max_consecutive_skips: int = setting(
        3,
        "A step whose global gradient norm is inf or nan (on any rank) is skipped on every rank: weights and optimizer "
        "state stay as they were. This many skipped steps in a row stop the run with an error naming the first of "
        "them and the layers at fault (checked at logging steps and before checkpoints). Under precision.recipe=fp16 "
        "a skip counts only once the loss scale is at loss_scale_min.",
    )
    compile: bool = setting(
        False,
        "`torch.compile` every transformer block (the first steps pay the compilation). An FP8 linear enters "
        "the compiled graph as custom ops running our kernels, its tensor-parallel collectives included; "
        "MoE blocks with one EP rank compile whole, the experts' grouped GEMMs included; deferred-wgrad layers "
        "(zero-bubble schedules) and, across EP ranks, the experts' gathers and GEMMs run eagerly inside the "
        "graph. The norms, activations and residual adds around them fuse.",
    )
    compile_mode: CompileMode = setting(
        "default",
        "`torch.compile`'s mode for the blocks (with `compile: true`). `reduce-overhead` adds CUDA graphs, which cut "
        "the host's launch work; `max-autotune` also tunes Inductor's kernels (longer compilation).",
    )
    compile_comm_overlap: bool = setting(
        False,
        "With `compile: true`: Inductor reorders each compiled block's collectives (tensor parallelism's all-gathers "
        "and reduce-scatters) and their waits to overlap computation (`reorder_for_compute_comm_overlap`). Traced "
        "collectives are otherwise waited for as soon as they start. Off by default: its speed is not yet measured.",
    )
    backward_on_worker_thread: bool = setting(
        False,
        "Run backward on autograd's CUDA worker thread (torch's default) instead of the thread that called it. Off: "
        "the training loop runs it on its own thread, which cost an eager FP8 linear's forward + backward ~440 us "
        "less host time per micro-batch on one H200 (1,031 against 587 us; BF16 170 against 125; "
        "`docs/benchmarks.md`). Device work is the same either way, so it only matters where the host bounds the step "
        "(whole steps of our benchmark shapes did not change).",
    )
    recompute: RecomputeMode = setting(
        "none",
        "Activation recomputation. `full`: every transformer block keeps only its input for backward and runs its "
        "forward again there (about a third more compute; activation memory falls to one block's working set plus "
        "the blocks' inputs). `none`: keep every activation. `training.recompute_layers` recomputes only some blocks; "
        "`training.recompute_compiled` says how compiled blocks recompute.",
    )
    recompute_compiled: RecomputeCompiled = setting(
        "auto",
        "With `compile: true` and `recompute: full`, where a compiled block's recomputation runs. `in_graph`: the "
        "block's forward is compiled under checkpointing as one function and recomputed inside its compiled backward, "
        "keeping the block's input only (on one H100 the ~1B FP8 step ran 15% faster than `around` at the same "
        "memory, BF16 3%, `docs/performance.md`). `around`: checkpointing wraps the compiled code and backward runs "
        "it again from Python (what eager code does; not under CUDA graphs). `auto`: `in_graph` where the blocks "
        "compile into one graph, `around` where layers run eagerly inside them (`parallel.ep` > 1, zero-bubble "
        "schedules; refused under CUDA graphs). A block that cannot be traced whole recomputes `around`.",
    )
    recompute_layers: Optional[int] = setting(
        None,
        "With `recompute: full`, how many transformer blocks on each pipeline rank recompute: the rank's first ones "
        "in forward order (MTP blocks last); the others keep their activations. `null`: every block. A dial between "
        "`none` and `full`: each recomputed block trades its kept activations for its forward run again (Megatron-LM's "
        "`--recompute-method block --recompute-num-layers`). `--dry-run` and `tools/plan.py` count it.",
    )
    device: DeviceName = setting(
        "auto",
        "`auto`: CUDA when available (one GPU per local rank), else CPU, except in a job that was given GPUs "
        "(`CUDA_VISIBLE_DEVICES` naming devices, SLURM's `SLURM_GPUS_ON_NODE`, `SLURM_JOB_GPUS` or "
        "`SLURM_STEP_GPUS`, or `launch/slurm/pretrain.sbatch`'s assumed 8 per node): where torch finds no CUDA device "
        "there (a CPU build of torch, a driver that does not load), the run stops in one line instead of training on "
        "the CPU. `cpu` trains on the CPU in any case.",
    )
    cuda_alloc_conf: str = setting(
        "auto",
        "Settings of torch's CUDA caching allocator, in `PYTORCH_CUDA_ALLOC_CONF`'s syntax (comma-separated "
        "`key:value`), set before the first CUDA allocation; `\"\"`: the allocator as torch comes. `auto`: "
        "`expandable_segments:True` (each stream's pool one growing mapping instead of many fixed blocks: on one H200 "
        "the 8B-layer FP8 step under CUDA graphs held 63.7 GiB instead of 65.8, `docs/benchmarks.md`), except where "
        "CUDA graphs (`compile_mode: reduce-overhead` or `max-autotune`) capture tensor- or expert-parallel "
        "collectives: NCCL's registration of captured buffers can hang on expandable segments "
        "(pytorch/pytorch#158029), so there `auto` leaves the allocator as torch comes (and asking for them there "
        "logs a warning). A `PYTORCH_CUDA_ALLOC_CONF` or `PYTORCH_ALLOC_CONF` in the "
        "environment, even empty, wins over this key.",
    )


@dataclass
class CheckpointConfig:
    """Saving and resuming training state (model, master weights, optimizer, schedule, data position, RNG)."""

    dir: Optional[str] = setting(None, "Checkpoint directory. `null`: `<logging.output_dir>/<run_name>/checkpoints`.")
    interval: int = setting(0, "Save every this many steps (and at the end of training); 0 disables saving.")
    keep_last: int = setting(2, "Keep only this many most recent checkpoints; 0 keeps all.")
    format: CheckpointFormat = setting(
        "sharded",
        "`sharded`: every rank writes its own pieces with torch.distributed.checkpoint (full tensor names and "
        "offsets, so it loads at any TP/PP/EP/DP layout; no rank gathers the model). `full`: every tensor is "
        "gathered and rank 0 writes one `state.pt` (small models, simple tooling). Either form resumes, and the "
        "conversion tools read both.",
    )
    async_save: bool = setting(
        False,
        "Write checkpoint files in a background thread: once the state is copied to host memory (sharded: each "
        "rank its pieces; full: gathered on every rank), training continues while the files are written. The next "
        "save and the end of training wait for the write; a failed write stops the run there with its error. The "
        "checkpoint still appears only when complete.",
    )
    resume: str = setting(
        "auto",
        "`auto`: resume from the latest checkpoint in `dir` if one exists; `none`: start fresh; "
        "otherwise a path to a checkpoint directory to resume from (where the run starts: once it has saved "
        "checkpoints of its own since, a relaunch of it continues from those).",
    )
    save_on_signal: bool = setting(
        True,
        "With `interval` > 0: on SIGTERM or SIGUSR1 (what schedulers send before stopping a job: SLURM at its "
        "time limit or with `--signal`, `timeout`, Kubernetes), finish the step, stop at the next logging step "
        "(every rank at the same one), checkpoint it and exit with 128 + the signal's number; a relaunch resumes "
        "there. A second signal acts at once. Under `torchrun` use SIGTERM (`docs/checkpoints.md`). Off, or without "
        "checkpoints: the signals keep their default action (the process dies mid-step and the work since the last "
        "checkpoint is lost).",
    )
    overwrite: bool = setting(
        False,
        "Replace the earlier run in this run's directory (its checkpoints, metrics and run files) where a launch "
        "would otherwise be refused: another config, or `resume: none` over its checkpoints. A relaunch of the same "
        "config never needs it: it resumes (or, with no checkpoint, starts over from step 0).",
    )


@dataclass
class LoggingConfig:
    """Console and metrics-file output (rank 0 only)."""

    log_interval: int = setting(10, "Print a console line and write a metrics record every this many steps.")
    output_dir: str = setting("runs", "Parent directory of run directories (`<output_dir>/<run_name>`).")
    metrics_file: str = setting(
        "metrics.jsonl", "JSON-lines metrics file, relative to the run directory (absolute paths are kept)."
    )
    backends: list[LoggerName] = setting(
        ["jsonl"],
        "Where metrics go: `jsonl` (the metrics file), `tensorboard` (`<run dir>/tensorboard`), `wandb` (offline "
        "under `<run dir>/wandb` unless WANDB_API_KEY or WANDB_MODE say otherwise). Rank 0 only.",
    )
    wandb_project: str = setting("megafp8", "Weights & Biases project name.")
    fp8_health_interval: int = setting(
        100, "Every this many steps, record FP8 health (max-abs, underflow, at-max fraction, SNR) of each FP8 "
        "layer's input, weight and output gradient in the metrics file; 0 disables. A sampled step runs its "
        "compiled blocks uncompiled: on an H200 it takes ~0.2-0.4 s more than a plain step (~1.5% at 100)."
    )
    fp8_underflow_warn: float = setting(0.05, "Warn when more than this fraction of a tensor's nonzeros flush to 0.")
    fp8_at_max_warn: float = setting(
        0.05, "Warn when more than this fraction of a tensor sits at the FP8 maximum (~1/128 is normal)."
    )
    peak_tflops: Optional[float] = setting(
        None,
        "Peak dense BF16 TFLOP/s of one device, for the MFU estimate. `null`: looked up for known GPUs; "
        "MFU is shown as n/a when unknown (e.g. on CPU).",
    )
    profile_steps: list[int] = setting(
        [],
        "`[first, last]`: trace training steps first to last (as the step lines number them) with `torch.profiler` "
        "(host and device activity), one trace per rank in `<run dir>/profiles/steps_<first>-<last>/` "
        "(`rank<r>.trace.json.gz`, for ui.perfetto.dev or chrome://tracing; `rank<r>.top.txt`, the operators and "
        "kernels by their own time). Those steps run slower while traced. `[]`: none.",
    )
    memory_snapshot_steps: int = setting(
        0,
        "Record the CUDA allocator's history (every allocation and free, with its Python stack) over this launch's "
        "first N training steps and write it to `<run dir>/profiles/memory_rank<r>.pickle` after them, or as soon "
        "as the device runs out of memory within them (view at pytorch.org/memory_viz). Costs host time per "
        "allocation while recording. 0: off. CUDA only (a CPU run logs that it records nothing).",
    )


@dataclass
class Config:
    """A whole training run."""

    run_name: str = setting("", "Name of the run and its directory. Left out: the config file's name (an empty name "
                                "is refused).")
    model: ModelConfig = section(ModelConfig, "Model architecture.")
    parallel: ParallelConfig = section(ParallelConfig, "Parallel layout.")
    precision: PrecisionConfig = section(PrecisionConfig, "Numerics.")
    optimizer: OptimizerConfig = section(OptimizerConfig, "Optimizer and learning-rate schedule.")
    data: DataConfig = section(DataConfig, "Training and validation data.")
    training: TrainingConfig = section(TrainingConfig, "Training loop.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpointing.")
    logging: LoggingConfig = section(LoggingConfig, "Logging.")

