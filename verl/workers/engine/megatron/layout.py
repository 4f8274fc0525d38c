"""Where megatron-core puts each rank, as the engine initialises it; pure Python (no megatron-core import), so
the controller can dispatch data to the right ranks before any worker starts.

Pipeline parallelism is outermost (megatron-core's default order): the dense and the expert layers then always
have the same pipeline groups, whatever expert * expert-tensor parallelism is, which megatron-core requires.
"""

from __future__ import annotations

from verl.single_controller.dp_layout import DataParallelLayout

__all__ = ["RANK_ORDER", "megatron_dp_layout"]

# The order given to megatron-core's initialize_model_parallel (build.init_parallel_state); megatron_dp_layout
# below is the dense-layer decomposition of exactly this order.
RANK_ORDER = "tp-cp-ep-dp-pp"


def megatron_dp_layout(world_size: int, tp: int, cp: int = 1, pp: int = 1) -> DataParallelLayout:
    """megatron-core's dense-layer layout for :data:`RANK_ORDER` (expert parallelism splits the
    data-parallel ranks of the expert layers only, so it does not change which replica a rank serves):

        rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))

    The rank collected for a replica is its first rank on the last pipeline stage, where outputs are computed
    (the engine also broadcasts them to the other stages, so any rank would return the same rows)."""
    for name, v in (("tensor_model_parallel_size", tp), ("context_parallel_size", cp),
                    ("pipeline_model_parallel_size", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer (got {v!r})")
    per_stage = tp * cp
    if world_size % (per_stage * pp):
        raise ValueError(f"tensor * context * pipeline parallel size ({tp} * {cp} * {pp}) must divide the world "
                         f"size ({world_size})")
    dp = world_size // (per_stage * pp)
    replica_of = tuple((r // per_stage) % dp for r in range(world_size))
    collect_from = tuple(per_stage * (d + dp * (pp - 1)) for d in range(dp))
    return DataParallelLayout(replica_of, collect_from)
