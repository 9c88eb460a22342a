"""`ParallelDims`: the world's layout and every process group of a run, built once and passed explicitly.

Ranks are placed with tensor parallelism innermost (it needs the fastest links: consecutive
ranks share a node), then data parallelism, then pipeline stages outermost (Megatron's order):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Expert parallelism is carved out of the data-parallel axis, innermost within it:
`dp_rank = ep_rank + ep * edp_rank`. Experts are split across the `ep` ranks of an expert
group; each expert's replicas (same `ep_rank`) form the expert-data-parallel group that reduces
expert gradients, while dense gradients are reduced over the whole data-parallel group.

Context parallelism is carved out of the data-parallel axis too, innermost:
`dp_rank = cp_rank + cp * replica`. The `cp` ranks of a context-parallel group share each sequence
(`megafp8.parallel.context`) and read the same samples; the data-parallel group, which holds them,
still reduces every gradient (they hold the same weights). Expert groups are formed as without it:
their ranks need not read the same samples.

A group of one rank is `None`: every collective on it is skipped, so TP=1 layers are plain GEMMs.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megafp8.config import ParallelConfig
from megafp8.config.validate import data_parallel_size


@dataclass(frozen=True)
class TensorParallel:
    """What a tensor-parallel layer needs: its group, size and rank, and whether sequence parallelism is on."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    sequence_parallel: bool = False

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls(None, 1, 0, False)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect: activations outside the TP regions hold 1/size of the tokens."""
        return self.sequence_parallel and self.size > 1


@dataclass(frozen=True)
class ExpertParallel:
    """An expert-parallel group: its process group (None for one rank), size and this rank's place."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int

    @classmethod
    def single(cls) -> "ExpertParallel":
        return cls(None, 1, 0)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group: its process group (None for one rank), size and this rank's place."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int

    @classmethod
    def single(cls) -> "ContextParallel":
        return cls(None, 1, 0)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def chunks(self) -> tuple[int, int]:
        """The two chunks (of 2 x size) of each sequence this rank holds, in its local order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, seq_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """This rank's token positions within a sequence of `seq_len`, in its local order (int64, on `device`)."""
        chunk = chunk_length(seq_len, self.size)
        return torch.cat([torch.arange(j * chunk, (j + 1) * chunk, device=device) for j in self.chunks()])

    def collective_group(self) -> TensorParallel:
        """The group as the token-dimension collectives of `megafp8.parallel.collectives` take one."""
        return TensorParallel(self.group, self.size, self.rank)


def chunk_length(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {cp} equal chunks")
    return seq_len // (2 * cp)


def rank_groups(world_size: int, tp: int, pp: int, ep: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of each kind ('tp', 'dp', 'pp', 'ep', 'edp', 'cp') as lists of global ranks, in the placement
    above."""
    dp = world_size // (tp * pp)
    edp = dp // ep

    def rank(tp_r: int, dp_r: int, pp_r: int) -> int:
        return tp_r + tp * (dp_r + dp * pp_r)

    groups: dict[str, list[list[int]]] = {"tp": [], "dp": [], "pp": [], "ep": [], "edp": [], "cp": []}
    for pp_r in range(pp):
        for dp_r in range(dp):
            groups["tp"].append([rank(t, dp_r, pp_r) for t in range(tp)])
        for tp_r in range(tp):
            groups["dp"].append([rank(tp_r, d, pp_r) for d in range(dp)])
            for replica in range(dp // cp):
                groups["cp"].append([rank(tp_r, c + cp * replica, pp_r) for c in range(cp)])
            for edp_r in range(edp):
                groups["ep"].append([rank(tp_r, e + ep * edp_r, pp_r) for e in range(ep)])
            for ep_r in range(ep):
                groups["edp"].append([rank(tp_r, ep_r + ep * e, pp_r) for e in range(edp)])
    for dp_r in range(dp):
        for tp_r in range(tp):
            groups["pp"].append([rank(tp_r, dp_r, p) for p in range(pp)])
    return groups


@dataclass(frozen=True)
class ParallelDims:
    """World layout and the groups built from it (a group of one rank is None)."""

    world_size: int
    rank: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None
    edp_group: Optional[dist.ProcessGroup] = None
    sequence_parallel: bool = False
    timeout: Optional[datetime.timedelta] = None  # of a collective on its groups, and on any group made later
    cp: int = 1
    cp_group: Optional[dist.ProcessGroup] = None

    @classmethod
    def single(cls) -> "ParallelDims":
        """One process, no collectives."""
        return cls(world_size=1, rank=0)

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, ep: int = 1, sequence_parallel: bool = False,
              timeout: Optional[datetime.timedelta] = None, cp: int = 1) -> "ParallelDims":
        """The layout of the initialized default process group (one process when there is none).
        Collective: every rank must call it with the same sizes, since each group is created by all ranks.
        `timeout`: how long a collective on one of the groups waits before it fails (None: torch's default for the
        backend, 30 minutes on gloo, 10 on NCCL; a new group does not take the default group's timeout)."""
        if not dist.is_available() or not dist.is_initialized():
            world_size, rank = 1, 0
        else:
            world_size, rank = dist.get_world_size(), dist.get_rank()
        dp = data_parallel_size(world_size, tp, pp, ep)
        mine: dict[str, Optional[dist.ProcessGroup]] = {}
        if dp % cp != 0:
            raise ValueError(f"parallel.cp={cp} does not divide the {dp} data-parallel ranks")
        for kind, groups in rank_groups(world_size, tp, pp, ep, cp).items():
            mine[kind] = None
            for ranks in groups:
                if len(ranks) == 1:
                    continue  # no collective on a group of one
                group = dist.group.WORLD if len(ranks) == world_size else dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[kind] = group
        return cls(world_size, rank, tp, pp, dp, ep, mine["tp"], mine["dp"], mine["pp"], mine["ep"], mine["edp"],
                   sequence_parallel, timeout, cp, mine["cp"])

    @classmethod
    def from_config(cls, parallel: ParallelConfig) -> "ParallelDims":
        """`build` with the sizes and the collectives' timeout of a config's `parallel` section (collective)."""
        return cls.build(tp=parallel.tp, pp=parallel.pp, ep=parallel.ep, sequence_parallel=parallel.sequence_parallel,
                         timeout=datetime.timedelta(minutes=parallel.timeout_minutes), cp=parallel.cp)

    # Coordinates of this rank (the placement in the module docstring).
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def dp_size(self) -> int:
        return self.dp

    @property
    def cp_rank(self) -> int:
        return self.dp_rank % self.cp

    @property
    def replica_rank(self) -> int:
        """Which data-parallel replica's samples this rank reads (its context-parallel group's, shared)."""
        return self.dp_rank // self.cp

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: groups of ranks reading distinct samples (dp / cp)."""
        return self.dp // self.cp

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def tensor_parallel(self) -> TensorParallel:
        return TensorParallel(self.tp_group, self.tp, self.tp_rank, self.sequence_parallel)

    @property
    def expert_parallel(self) -> ExpertParallel:
        return ExpertParallel(self.ep_group, self.ep, self.ep_rank)

    @property
    def context_parallel(self) -> ContextParallel:
        return ContextParallel(self.cp_group, self.cp, self.cp_rank)

    def describe(self) -> str:
        return (f"{self.world_size} rank(s) = tp {self.tp} x dp {self.dp} x pp {self.pp} (ep {self.ep}"
                f"{f', cp {self.cp}' if self.cp > 1 else ''})"
                f"{', sequence parallel' if self.sequence_parallel and self.tp > 1 else ''}")
