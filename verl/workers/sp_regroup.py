"""Run a role whose Ulysses group differs from the layout the data was dispatched in (the reference policy with
its own ``ulysses_sequence_parallel_size``, colocated with an actor that has another).

The worker group dispatches one chunk per actor replica: consecutive blocks of ``replica_size`` ranks hold the
same chunk. A Ulysses group must feed one batch to all its ranks. When the group sits inside one replica
(``replica_size`` a multiple of the group size) that holds already; otherwise the group's ranks exchange their
chunks, each computes the union of the distinct ones (in rank order), and keeps the rows of its own chunk, so
what goes back to the controller is laid out exactly as it was dispatched.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from verl.protocol import DataProto

__all__ = ["compute_in_group"]


def compute_in_group(data: DataProto, group: Optional[dist.ProcessGroup], replica_size: int,
                     fn: Callable[[DataProto], DataProto]) -> DataProto:
    """``fn`` over the batch of this rank's Ulysses ``group`` (None: no sequence parallelism); this rank's rows of
    its result."""
    if group is None:
        return fn(data)
    ranks = dist.get_process_group_ranks(group)
    if replica_size % len(ranks) == 0 and ranks[0] // replica_size == ranks[-1] // replica_size:
        return fn(data)  # the whole group holds one dispatched chunk
    me = dist.get_rank()
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, (me // replica_size, data), group=group)
    chunks: dict[int, DataProto] = {}
    for replica, chunk in gathered:
        chunks.setdefault(replica, chunk)
    order = list(chunks)  # rank order, each dispatched chunk once
    out = fn(DataProto.concat([chunks[r] for r in order]))
    start = sum(len(chunks[r]) for r in order[: order.index(me // replica_size)])
    return out.slice(start, start + len(data))
