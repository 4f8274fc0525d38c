"""Run a role whose group differs from the layout the data was dispatched in: the reference policy with its own
``ulysses_sequence_parallel_size``, colocated with an actor that has another; a rollout engine shared by
consecutive ranks (vLLM's tensor parallelism), whose ranks must all see the same prompts.

The worker group dispatches one chunk per actor replica (``layout.replica_of`` says which rank holds which).
A Ulysses group must feed one batch to all its ranks. When the group's ranks all serve one replica that holds
already; otherwise the group's ranks exchange their
chunks, each computes the union of the distinct ones (in rank order), and keeps the rows of its own chunk, so
what goes back to the controller is laid out exactly as it was dispatched.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from verl.protocol import DataProto
from verl.single_controller.dp_layout import DataParallelLayout

__all__ = ["compute_in_group", "consecutive_group"]


def consecutive_group(size: int) -> Optional[dist.ProcessGroup]:
    """This rank's group among the blocks of ``size`` consecutive ranks (None for 1). Collective: every rank
    creates every block's group, in the same order, as torch.distributed requires."""
    if size <= 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"a group of {size} consecutive ranks must divide the world size {world}")
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine


def compute_in_group(data: DataProto, group: Optional[dist.ProcessGroup], layout: DataParallelLayout,
                     fn: Callable[[DataProto], DataProto]) -> DataProto:
    """``fn`` over the batch of this rank's Ulysses ``group`` (None: no sequence parallelism); this rank's rows of
    its result."""
    if group is None:
        return fn(data)
    ranks = dist.get_process_group_ranks(group)
    if len({layout.replica_of[r] for r in ranks}) == 1:
        return fn(data)  # the whole group holds one dispatched chunk
    mine = layout.replica_of[dist.get_rank()]
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, (mine, data), group=group)
    chunks: dict[int, DataProto] = {}
    for replica, chunk in gathered:
        chunks.setdefault(replica, chunk)
    order = list(chunks)  # rank order, each dispatched chunk once
    out = fn(DataProto.concat([chunks[r] for r in order]))
    start = sum(len(chunks[r]) for r in order[: order.index(mine)])
    return out.slice(start, start + len(data))
