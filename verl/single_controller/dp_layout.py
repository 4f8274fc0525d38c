"""Which data-parallel replica each rank of a worker group belongs to.

The controller splits a batch into one chunk per data-parallel (DP) replica and must send chunk ``d`` to every
rank of replica ``d``, then keep one output per replica. Where those ranks sit depends on the engine: FSDP with
Ulysses puts a replica's ranks next to each other (blocks), Megatron lays the pipeline dimension outermost
(``verl.workers.engine.megatron.layout``), so one replica's ranks are spread over the pipeline stages. Each
engine registers its layout with its ``EngineSections`` (``verl.workers.engine.sections.role_dp_layout``).
A :class:`DataParallelLayout` states the answer once, as a table, for the dispatch and for the workers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["DataParallelLayout"]


@dataclass(frozen=True)
class DataParallelLayout:
    """``replica_of[r]``: the DP index of rank ``r``; ``collect_from[d]``: the rank whose output is kept for
    replica ``d`` (every rank of a replica returns the same rows, so one suffices)."""

    replica_of: tuple[int, ...]
    collect_from: tuple[int, ...]

    def __post_init__(self):
        world, dp = len(self.replica_of), len(self.collect_from)
        if world == 0 or dp == 0:
            raise ValueError("a data-parallel layout needs at least one rank and one replica")
        counts = Counter(self.replica_of)
        if sorted(counts) != list(range(dp)) or len(set(counts.values())) != 1:
            raise ValueError(f"data-parallel layout {self.replica_of}: every replica 0..{dp - 1} must own the same "
                             "number of ranks")
        for d, r in enumerate(self.collect_from):
            if not 0 <= r < world or self.replica_of[r] != d:
                raise ValueError(f"data-parallel layout: rank {r} collected for replica {d} is not one of its ranks")

    @property
    def world_size(self) -> int:
        return len(self.replica_of)

    @property
    def dp_size(self) -> int:
        return len(self.collect_from)

    @property
    def ranks_per_replica(self) -> int:
        return self.world_size // self.dp_size

    @classmethod
    def blocks(cls, world_size: int, dp_size: int | None = None) -> "DataParallelLayout":
        """Replica ``d`` is ranks ``d*k .. d*k+k-1`` (k = world / dp): FSDP with Ulysses groups, and one rank per
        replica when ``dp_size`` is the world size (the default). The first rank of each block is collected."""
        dp_size = dp_size or world_size
        if dp_size < 1 or world_size % dp_size:
            raise ValueError(f"data-parallel size {dp_size} must divide the world size {world_size}")
        k = world_size // dp_size
        return cls(tuple(r // k for r in range(world_size)), tuple(d * k for d in range(dp_size)))
