"""Pipeline layouts as plain numbers: how many transformer layers each pipeline stage holds.

Pure Python (no torch), so config validation can check a layout before any process starts;
`megafp8.parallel.pipeline` turns the counts into stages and places them on ranks.
"""
from __future__ import annotations

import re

from megafp8.config.errors import ConfigError

V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, placed in a V
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")  # schedules with a separate weight-gradient pass
_LAYERS = re.compile(r"t(?:\*(\d+))?")


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Model chunks each pipeline rank holds under `schedule`."""
    if schedule == "1f1b":
        return 1
    if schedule in V_SHAPED:
        return 2
    return virtual_stages


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible; earlier stages take the remainder."""
    if num_layers < num_stages:
        raise ConfigError(f"model.num_layers={num_layers} cannot fill {num_stages} pipeline stages (parallel.pp x "
                          "stages per rank): lower parallel.pp or parallel.pp_virtual_stages")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def parse_layout(text: str, num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage from a layout string like `E,t*3|t*5|t*5|t*3,L` (see `parallel.pp_layout`). A layout that
    does not cover every layer exactly once, or misplaces the embedding (E) or the head (L), is a ConfigError."""
    stages = text.split("|")
    where = f"parallel.pp_layout '{text}'"
    if len(stages) != num_stages:
        raise ConfigError(f"{where} has {len(stages)} stage(s), but parallel.pp x stages per rank = {num_stages}: "
                          "give one '|'-separated entry per stage")
    counts = []
    for i, stage in enumerate(stages):
        items = [item.strip() for item in stage.split(",")]
        layers = 0
        for pos, item in enumerate(items):
            match = _LAYERS.fullmatch(item)
            if match:
                layers += int(match.group(1) or 1)
            elif item == "E" and i == 0 and pos == 0 or item == "L" and i == num_stages - 1 and pos == len(items) - 1:
                continue
            elif item in ("E", "L"):
                place = "first item of the first stage" if item == "E" else "last item of the last stage"
                raise ConfigError(f"{where}: '{item}' must be the {place}")
            else:
                raise ConfigError(f"{where}: unknown item '{item}' in stage {i}; use E, t, t*N or L")
        if layers == 0 and items not in (["E"], ["L"]):
            raise ConfigError(f"{where}: stage {i} holds nothing")
        counts.append(layers)
    if stages[0].split(",")[0].strip() != "E" or stages[-1].split(",")[-1].strip() != "L":
        raise ConfigError(f"{where} must start with 'E' (the embedding) and end with 'L' (the head and loss)")
    if sum(counts) != num_layers:
        raise ConfigError(f"{where} places {sum(counts)} transformer layer(s), but model.num_layers={num_layers}: "
                          "every layer must be in exactly one stage")
    return counts


def layer_counts(num_layers: int, pp: int, schedule: str, virtual_stages: int, layout: str | None) -> list[int]:
    """Transformer layers of each pipeline stage, in pipeline order."""
    num_stages = pp * stages_per_rank(schedule, virtual_stages)
    return parse_layout(layout, num_layers, num_stages) if layout else even_split(num_layers, num_stages)


def micro_batch_problem(schedule: str, pp: int, n_micro: int) -> str | None:
    """Why `schedule` cannot run `n_micro` micro-batches on `pp` ranks (torch's constraints), or None."""
    if schedule == "dualpipev" and n_micro < 2 * pp:
        return f"dualpipev needs at least 2 x parallel.pp = {2 * pp} micro-batches per step"
    if n_micro < pp:
        return f"{schedule} needs at least parallel.pp = {pp} micro-batches per step"
    rounds = max(1, n_micro // pp)
    if schedule in ("interleaved_1f1b", "interleaved_zb") and n_micro % rounds != 0:
        return f"{schedule} needs the micro-batch count to be a multiple of {rounds} (its rounds of {pp})"
    return None
