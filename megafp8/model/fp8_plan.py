"""Which GEMM layers run FP8: the recipe's layer globs, the BF16 exceptions, and the precision islands.

Applied after the model is built. Layer names are module paths such as
`layers.3.attn.qkv_proj` or `layers.0.mlp.down_proj`. The embedding, the LM head and the norms
are precision islands: they never run FP8, and a pattern that names only islands is an error.
A linear whose weight dims are not multiples of the 128-wide FP8 tile (MLA's kv_a: kv_lora_rank +
qk_rope_head_dim; an FFN such as DeepSeek-V2-Lite's 10944 wide) stays BF16, and the plan's summary (the
start-up line) names it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch.nn as nn

from megafp8.config import ConfigError, PrecisionConfig
from megafp8.model.norm import RMSNorm
from megafp8.parallel import ExpertLinear, ParallelLinear, VocabParallelEmbedding
from megafp8.parallel.experts import PARTIAL_FP8_EXPERTS
from megafp8.precision import PrecisionRecipe

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


def _islands(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (RMSNorm, VocabParallelEmbedding)) or n == LM_HEAD]


def apply_fp8_plan(model: nn.Module, cfg: PrecisionConfig, recipe: PrecisionRecipe, num_layers: int,
                   dry_run: bool = False, check_patterns: bool = True) -> Fp8Plan:
    """Set each GEMM layer's recipe (FP8 or BF16) and return the plan. `dry_run`: only check the plan (bad
    patterns, unsupported layers raise) and return it, leaving the layers as they are, e.g. at start-up of a
    run that switches to FP8 later. `check_patterns=False` skips the check that every glob matches a layer
    (a pipeline stage holds only some layers; the whole model's plan is checked once, on a meta copy)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (ParallelLinear, ExpertLinear))}
    eligible = [n for n in linears if n != LM_HEAD]
    islands = _islands(model)
    for pattern in cfg.fp8_layers if check_patterns else []:
        hits = [n for n in eligible if fnmatch(n, pattern)]
        island_hits = [n for n in islands if fnmatch(n, pattern)]
        if island_hits and not hits:
            raise ConfigError(
                f"precision.fp8_layers entry '{pattern}' names '{island_hits[0]}', a precision island: the embedding, "
                "LM head and norms stay BF16/FP32 under every recipe (DESIGN.md numerics contract); remove the entry"
            )
        if not hits:
            raise ConfigError(f"precision.fp8_layers entry '{pattern}' matches no GEMM layer "
                              f"(names look like {eligible[0]})")
    keep = list(cfg.bf16_layers)
    for pattern in keep if check_patterns else []:
        if not any(fnmatch(n, pattern) for n in linears):
            raise ConfigError(f"precision.bf16_layers entry '{pattern}' matches no GEMM layer "
                              f"(names look like {eligible[0]})")
    edge = cfg.bf16_first_last_blocks
    keep += [f"layers.{i}.*" for i in range(num_layers) if i < edge or i >= num_layers - edge]
    fp8, bf16, untiled = [], [], []
    for name, layer in linears.items():
        wanted = (recipe.fp8 is not None and name != LM_HEAD and any(fnmatch(name, p) for p in cfg.fp8_layers)
                  and not any(fnmatch(name, p) for p in keep))
        if wanted and not layer.fp8_capable:  # a weight that is not whole 128-wide tiles stays BF16
            untiled.append(name)
            wanted = False
        if wanted and isinstance(layer, ExpertLinear) and not ExpertLinear.supports(recipe.fp8):
            raise ConfigError(PARTIAL_FP8_EXPERTS)
        if not dry_run:
            layer.set_recipe(recipe if wanted else recipe.high_precision())
        (fp8 if wanted else bf16).append(name)
    return Fp8Plan(fp8, bf16, untiled)
