"""Which parallel layouts a run could take on N GPUs, and which one to start with (`tools/plan.py --layouts`).

Every factorization of the world into tensor (TP, with sequence parallelism), pipeline (PP) and data-parallel
ranks, and for a mixture-of-experts model every expert-parallel size (EP, inside the data-parallel ranks), is
checked as the launch would check it (`validate_for_world`: shapes on tile edges, heads, experts and layers
divisible, the global batch a whole number of micro-batches per rank) and planned (`make_plan`: the busiest rank's
memory). A layout fits when its plan leaves `headroom` of the GPU free: the planner is tested to within 10% of
measured peaks (`benchmarks/train_step.py`), and the allocator needs some slack.

With `max_cp` above 1 (`tools/plan.py --layouts --max-cp N`, for long sequences) each layout is also tried with
context parallelism up to that size (`parallel.cp`, out of the data-parallel ranks); it counts toward the
model-parallel degree, preferred after expert and before tensor parallelism at the same degree (not measured
against each other: its per-layer all-gather of keys and values moves less than tensor parallelism's
collectives).

The recommendation is the fitting layout with the least model parallelism, preferring, at the same degree, expert
over tensor over pipeline parallelism: data parallelism with a sharded optimizer kept 96-97% of one GPU's
throughput per GPU on two H200s every time, TP=2 anywhere from 43% (FP8, before its layers were traced) to 117%
(BF16), PP=2 89-96% with its bubble (`docs/benchmarks.md`, issue 26's tables); the MoE model at DP=2 ran 1.21x
(FP8) and 1.23x (BF16) its EP=2 throughput, EP adding two all-to-alls a MoE layer (job R), so EP is recommended only
where the experts do not fit replicated; and a smaller model-parallel degree leaves every GEMM larger. It is a
starting point to measure (`benchmarks/train_step.py` at that layout), not a performance model: communication cost
across nodes is not modelled (keep TP inside a node: `max_tp`).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from megafp8.config import Config, ConfigError, ParallelConfig
from megafp8.config.layout import V_SHAPED, stages_per_rank
from megafp8.config.validate import validate_for_world
from megafp8.train.plan import GIB, make_plan, with_vocab


@dataclass
class LayoutOption:
    """One candidate layout: its sizes, the overrides that select it, and its planned memory or why it cannot run."""

    tp: int
    pp: int
    ep: int
    dp: int
    overrides: list[str]
    planned_gib: Optional[float] = None  # the busiest rank's plan; None where the layout is refused
    problem: Optional[str] = None  # why it cannot run here (the launch's error, or the memory it lacks)
    cp: int = 1  # context-parallel ranks (out of the dp ones)

    @property
    def fits(self) -> bool:
        return self.problem is None

    @property
    def short_of_memory(self) -> bool:
        """Refused for its memory alone: the launch accepts it and it was planned, over the GPU's budget."""
        return self.problem is not None and self.planned_gib is not None

    def cost(self) -> tuple[int, int, int, int, int]:
        """Order of preference (smaller first): model-parallel degree, then expert, context, tensor, pipeline
        parallelism."""
        return (self.tp * self.pp * self.ep * self.cp, self.pp, self.tp, self.cp, self.ep)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout_config(cfg: Config, tp: int, pp: int, ep: int, cp: int = 1) -> tuple[Config, list[str]]:
    """`cfg` at tp x pp x ep x cp (sequence parallelism with TP; the configured pipeline schedule, else 1F1B, or
    DualPipeV where MTP needs a V-shaped one), and the overrides that say so on a command line."""
    par = cfg.parallel
    schedule = par.pp_schedule if par.pp > 1 else ("dualpipev" if cfg.model.mtp_depth > 0 else "1f1b")
    if pp > 1 and cfg.model.mtp_depth > 0 and schedule not in V_SHAPED:
        schedule = "dualpipev"
    same_pp = pp == par.pp
    parallel = dataclasses.replace(
        par, tp=tp, pp=pp, ep=ep, dp=None, sequence_parallel=tp > 1, pp_schedule=schedule,
        pp_virtual_stages=par.pp_virtual_stages if same_pp else 1, pp_layout=par.pp_layout if same_pp else None,
        cp=cp)
    overrides = [f"parallel.tp={tp}", f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",
                 f"parallel.pp={pp}", f"parallel.ep={ep}"]
    if cp > 1 or par.cp > 1:
        overrides.append(f"parallel.cp={cp}")
    if pp > 1:
        overrides.append(f"parallel.pp_schedule={schedule}")
    overrides += _settings_reset(par, pp, schedule)
    return dataclasses.replace(cfg, parallel=parallel), overrides


def _settings_reset(par: ParallelConfig, pp: int, schedule: str) -> list[str]:
    """Overrides that undo the config's own settings a layout at `pp` x `schedule` is checked without: the launch,
    given the config and the printed overrides, kept them and refused the layout (parallel.dp=2 at any other
    data-parallel size, a pp_layout of another pp)."""
    resets = ["parallel.dp=null"] if par.dp is not None else []
    if pp != par.pp and par.pp_layout is not None:
        resets.append("parallel.pp_layout=null")
    if pp != par.pp and pp > 1 and stages_per_rank(schedule, par.pp_virtual_stages) != stages_per_rank(schedule, 1):
        resets.append("parallel.pp_virtual_stages=1")  # only where the schedule reads it (interleaved)
    return resets


def search_layouts(cfg: Config, world_size: int, gpu_bytes: float, max_tp: int = 8,
                   headroom: float = 0.1, max_cp: int = 1) -> list[LayoutOption]:
    """Every layout of `cfg` on `world_size` GPUs of `gpu_bytes` each, TP at most `max_tp` and CP at most `max_cp`,
    fitting ones first in order of preference (`LayoutOption.cost`), then the others by planned memory. A
    model.vocab_size of null is the data's tokenizer's, padded for each layout's TP as the launch pads it (padded for
    the config's TP alone, a TP of 3 was refused: the vocabulary 'does not split evenly', set it or null)."""
    with_vocab(cfg)  # neither a vocabulary nor data to read it from: one error, before any layout
    moe = cfg.model.moe.num_experts > 0
    options = []
    for tp in (d for d in _divisors(world_size) if d <= max_tp):
        for pp in (d for d in _divisors(world_size // tp) if d <= cfg.model.num_layers):
            dp = world_size // (tp * pp)
            for ep, cp in ((e, c) for e in (_divisors(dp) if moe else [1])
                           for c in _divisors(dp) if c <= max_cp):
                layout_cfg, overrides = _layout_config(cfg, tp, pp, ep, cp)
                layout_cfg = with_vocab(layout_cfg)
                option = LayoutOption(tp, pp, ep, dp, overrides, cp=cp)
                try:
                    validate_for_world(layout_cfg, world_size)
                    option.planned_gib = make_plan(layout_cfg, world_size).total_bytes / GIB
                except ConfigError as err:
                    option.problem = str(err)
                else:
                    budget = (1 - headroom) * gpu_bytes / GIB
                    if option.planned_gib > budget:
                        option.problem = (f"needs {option.planned_gib:,.1f} GiB per GPU, more than "
                                          f"{budget:,.1f} ({100 * (1 - headroom):.0f}% of the GPU's "
                                          f"{gpu_bytes / GIB:,.1f})")
                options.append(option)
    refused = [o for o in options if not o.fits]
    return (sorted((o for o in options if o.fits), key=LayoutOption.cost)
            + sorted(refused, key=lambda o: (o.planned_gib is None, o.planned_gib or 0.0, o.cost())))


def lighter_settings(cfg: Config) -> list[str]:
    """The settings that lower every layout's memory and that `cfg` does not use yet, as advice."""
    advice = []
    if cfg.training.micro_batch_size > 1:
        advice.append("lower training.micro_batch_size")
    if not cfg.optimizer.sharded:
        advice.append("set optimizer.sharded=true")
    if cfg.training.recompute != "full":
        advice.append("set training.recompute=full")
    elif cfg.training.recompute_layers is not None:
        advice.append(f"raise training.recompute_layers (now {cfg.training.recompute_layers}; null recomputes every "
                      "block)")
    return advice


def render_layouts(options: list[LayoutOption], world_size: int, gpu_bytes: float,
                   lighter: Sequence[str] = ()) -> str:
    """The search as a table, the recommendation first (or why nothing fits, `why_none_fits`, with the `lighter`
    settings of `lighter_settings`). A cp column where the search tried context parallelism."""
    with_cp = any(o.cp > 1 for o in options)
    cp_head, cp_rule = (" cp |", "---|") if with_cp else ("", "")
    lines = [f"layouts on {world_size} GPU(s) of {gpu_bytes / GIB:,.1f} GiB", "",
             f"| | tp | pp | ep |{cp_head} dp | planned GiB per GPU (busiest rank) | why not |",
             f"|---|---|---|---|{cp_rule}---|---|---|"]
    for i, o in enumerate(options):
        mark = "recommended" if i == 0 and o.fits else ("fits" if o.fits else "")
        planned = f"{o.planned_gib:,.1f}" if o.planned_gib is not None else "-"
        cp = f" {o.cp} |" if with_cp else ""
        lines.append(f"| {mark} | {o.tp} | {o.pp} | {o.ep} |{cp} {o.dp} | {planned} | "
                     f"{(o.problem or '').replace('|', '/')} |")
    if options and options[0].fits:
        lines += ["", "recommended overrides: " + " ".join(options[0].overrides),
                  "(the least model parallelism that fits; measure it: benchmarks/train_step.py at these settings)"]
    else:
        lines += ["", "no layout fits, for these reasons (each layout's in the why not column):",
                  *why_none_fits(options, lighter)]
    return "\n".join(lines)


MAX_REASONS = 8  # reasons listed under "no layout fits", the rest counted: the table has every layout's


def why_none_fits(options: list[LayoutOption], lighter: Sequence[str] = ()) -> list[str]:
    """One line per reason the layouts were refused, commonest first: each error of the launch with the count of
    layouts it refused (a config that no layout can run is not a matter of memory, and advice to save memory
    misled there), and the layouts short of memory as one group, with the leanest one's figures and what lowers
    memory (more GPUs, the `lighter` settings, a smaller model)."""
    short = [o for o in options if o.short_of_memory]
    reasons = Counter(o.problem for o in options if not o.short_of_memory)
    if short:
        leanest = min(short, key=lambda o: o.planned_gib)
        reasons[f"too large for the GPU, the leanest {leanest.problem}; to fit, " + ", ".join(["raise the GPU count",
                *lighter]) + ", or use a smaller model"] = len(short)
    ranked = reasons.most_common()
    lines = [f"- {_layouts(count)}: {reason}" for reason, count in ranked[:MAX_REASONS]]
    if len(ranked) > MAX_REASONS:
        rest = ranked[MAX_REASONS:]
        lines.append(f"- and {len(rest)} more reasons, for {_layouts(sum(count for _, count in rest))}")
    return lines


def _layouts(count: int) -> str:
    return f"{count} layout{'' if count == 1 else 's'}"
