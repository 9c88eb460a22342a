"""The FP8 converter: which GEMM layers run FP8, built once per run from the precision config, and the switch.

Like torchao's `convert_to_float8_training` and torchtitan's `ModelConverter` it is applied to a built model, but it
swaps no modules: every GEMM layer is a `GemmLayer` (`megafp8.precision`) that takes a recipe, and the converter sets
each one's. Layer names are module paths such as `layers.3.attn.qkv_proj` or `layers.0.mlp.down_proj`. The embedding,
the LM head and the norms are precision islands: they never run FP8, and a pattern that names only islands is an
error. A layer whose weight dims are not multiples of the 128-wide FP8 tile (MLA's kv_a: kv_lora_rank +
qk_rope_head_dim; an FFN such as DeepSeek-V2-Lite's 10944 wide) stays BF16, and the plan's summary (the start-up
line) names it.

    converter = Fp8Converter(cfg.precision, recipe, num_layers)
    converter.check(whole_model)      # once per run: every glob against every layer (a meta copy under pipelining)
    converter.convert(model)          # step 0: the plan, or BF16 everywhere until precision.fp8_start_step
    converter.plan(model)             # what it makes of a model, changing nothing (the memory plan)
    if converter.switches_at(step):   # the start step: switch in place
        converter.convert(model, step)

Resuming a run is `convert(model, step)` at the checkpoint's step: the layers are then what that step runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch.nn as nn

from megafp8.config import ConfigError, PrecisionConfig
from megafp8.model.norm import RMSNorm
from megafp8.parallel import VocabParallelEmbedding
from megafp8.precision import GemmLayer, PrecisionRecipe

LM_HEAD = "lm_head"


@dataclass
class Fp8Plan:
    fp8_layers: list[str]
    bf16_layers: list[str]  # GEMM layers in BF16, islands included
    untiled: list[str] = field(default_factory=list)  # of those, the ones FP8 was asked for but whose weights are
    #                                                    not whole 128x128 tiles

    def summary(self) -> str:
        """One line for the start-up log: how many layers run FP8, which stay BF16, and which could not tile."""
        total = len(self.fp8_layers) + len(self.bf16_layers)
        chosen = [n for n in self.bf16_layers if n not in self.untiled]
        kept = ", ".join(chosen[:6]) + (" ..." if len(chosen) > 6 else "")
        line = f"{len(self.fp8_layers)} of {total} GEMM layers in FP8; BF16: {kept or 'none'}"
        if self.untiled:
            line += f"; BF16 as not whole 128x128 FP8 tiles: {_compact(self.untiled)}"
        return line


def _compact(names: list[str]) -> str:
    """Layer names with the block index folded: `layers.*.attn.kv_a_proj (x27)`, a lone one as it is."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(re.sub(r"\b(layers|mtp)\.\d+", r"\1.*", name), []).append(name)
    return ", ".join(members[0] if len(members) == 1 else f"{template} (x{len(members)})"
                     for template, members in groups.items())


def gemm_layers(model: nn.Module) -> dict[str, GemmLayer]:
    """The GEMM layers of `model` by module name, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, GemmLayer)}


def _islands(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (RMSNorm, VocabParallelEmbedding)) or n == LM_HEAD]


class Fp8Converter:
    """The precision config's FP8 layer plan under `recipe` (FP8 or not), for a model of `num_layers` blocks."""

    def __init__(self, cfg: PrecisionConfig, recipe: PrecisionRecipe, num_layers: int) -> None:
        self.recipe = recipe
        self.fp8_patterns = list(cfg.fp8_layers)
        self.bf16_patterns = list(cfg.bf16_layers)
        edge = cfg.bf16_first_last_blocks
        # The MTP modules (`mtp.*`: each a combining projection and a block) follow the last block and, like it, feed
        # the shared output head: they are among the last blocks whatever N is, and the main blocks kept are those of
        # the same model without MTP.
        self.kept_patterns = self.bf16_patterns + [f"layers.{i}.*" for i in range(num_layers)
                                                   if i < edge or i >= num_layers - edge] + (["mtp.*"] if edge else [])
        self.start_step = cfg.fp8_start_step  # optimizer steps in BF16 before the planned layers switch to FP8

    def check(self, whole_model: nn.Module) -> Fp8Plan:
        """Check the plan against every layer of the model, once per run, and return the whole model's plan: each
        glob must match a GEMM layer (under pipelining pass a meta copy of the whole model: a stage holds only some
        layers), and every layer FP8 is asked for must support the recipe, even if FP8 starts later."""
        layers = gemm_layers(whole_model)
        eligible = [n for n in layers if n != LM_HEAD]
        islands = _islands(whole_model)
        for pattern in self.fp8_patterns:
            hits = [n for n in eligible if fnmatch(n, pattern)]
            island_hits = [n for n in islands if fnmatch(n, pattern)]
            if island_hits and not hits:
                raise ConfigError(
                    f"precision.fp8_layers entry '{pattern}' names '{island_hits[0]}', a precision island: the "
                    "embedding, LM head and norms stay BF16/FP32 under every recipe (DESIGN.md numerics contract); "
                    "remove the entry"
                )
            if not hits:
                raise ConfigError(f"precision.fp8_layers entry '{pattern}' matches no GEMM layer "
                                  f"(names look like {eligible[0]})")
        for pattern in self.bf16_patterns:
            if not any(fnmatch(n, pattern) for n in layers):
                raise ConfigError(f"precision.bf16_layers entry '{pattern}' matches no GEMM layer "
                                  f"(names look like {eligible[0]})")
        return self.plan(whole_model)

    def plan(self, model: nn.Module) -> Fp8Plan:
        """Which of `model`'s GEMM layers run FP8 from the start step on, leaving the layers as they are. A layer
        FP8 is asked for that cannot run the recipe (partial FP8 for experts) is a ConfigError."""
        fp8, bf16, untiled = [], [], []
        for name, layer in gemm_layers(model).items():
            wanted = self._wants(name)
            if wanted and not layer.fp8_capable:  # a weight that is not whole 128-wide tiles stays BF16
                untiled.append(name)
                wanted = False
            why = layer.why_unsupported(self.recipe.fp8) if wanted else None
            if why is not None:
                raise ConfigError(why)
            (fp8 if wanted else bf16).append(name)
        return Fp8Plan(fp8, bf16, untiled)

    def _wants(self, name: str) -> bool:
        return (self.recipe.fp8 is not None and name != LM_HEAD and any(fnmatch(name, p) for p in self.fp8_patterns)
                and not any(fnmatch(name, p) for p in self.kept_patterns))

    def runs_fp8_at(self, step: int) -> bool:
        """Whether the planned layers run FP8 at optimizer step `step` (0-based: the steps taken before it)."""
        return self.recipe.fp8 is not None and step >= self.start_step

    def switches_at(self, step: int) -> bool:
        """Whether step `step` is the BF16-to-FP8 switch of `precision.fp8_start_step` (never where FP8 runs from
        the start)."""
        return self.recipe.fp8 is not None and step == self.start_step > 0

    def convert(self, model: nn.Module, step: int = 0) -> Fp8Plan:
        """Set every GEMM layer of `model` to what optimizer step `step` runs: the plan's recipe from the start step
        on, BF16 before it (at build, and on resume at the checkpoint's step). A layer already so is left as it is
        (its FP8 weight cache kept). Returns the plan."""
        plan = self.plan(model)
        fp8 = set(plan.fp8_layers) if self.runs_fp8_at(step) else set()
        for name, layer in gemm_layers(model).items():
            recipe = self.recipe if name in fp8 else self.recipe.high_precision()
            if layer.recipe != recipe:
                layer.set_recipe(recipe)
        return plan
