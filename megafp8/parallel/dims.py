"""`ParallelDims`: the process groups of a run, built once from the world and passed explicitly.

This release lays out data parallelism only: every rank is a data-parallel replica.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    """World layout and the groups built from it. `dp_group=None` means a single process (no collectives)."""

    world_size: int
    rank: int
    dp_group: Optional[dist.ProcessGroup]

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def is_distributed(self) -> bool:
        return self.dp_group is not None and self.world_size > 1

    @classmethod
    def from_world(cls) -> "ParallelDims":
        """Groups of the initialized default process group (or a single process when there is none)."""
        if not dist.is_available() or not dist.is_initialized():
            return cls(world_size=1, rank=0, dp_group=None)
        return cls(world_size=dist.get_world_size(), rank=dist.get_rank(), dp_group=dist.group.WORLD)
