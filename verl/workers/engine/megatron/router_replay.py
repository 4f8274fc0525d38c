"""``megatron.router_replay.mode`` (R2 / R3) on the Megatron engine, through megatron-core's own router replay.

With ``TransformerConfig.moe_enable_routing_replay`` every ``TopKRouter`` owns a ``RouterReplay`` whose action
decides its top-k: ``RECORD`` (route normally, keep the indices), ``REPLAY_FORWARD`` (take the target indices set
for this forward), ``REPLAY_BACKWARD`` (an activation-checkpointed router recomputed in backward takes the oldest
targets still queued: each ``set_target_indices`` also queues them for that). megatron-core leaves switching
the action to the caller; this module does it per model chunk around the pipeline schedule's steps:

* forward step of micro-batch i on a chunk: the chunk's routers get their slice of the batch's routes
  (:mod:`route_layout`) and ``REPLAY_FORWARD`` -- or ``RECORD`` in R2's old-log-prob pass;
* backward of that micro-batch: a gradient hook on the chunk's output runs before any of the chunk's
  recomputation (backward reaches the output first) and switches its routers to ``REPLAY_BACKWARD``. Backward
  visits micro-batches in forward order on every stage (1F1B and interleaved alike), so the queue's order is
  right; a router that is never recomputed never pops, and the queue is cleared when the batch ends.

The routers are found in the chunks themselves (module order = decoder order), not in megatron-core's global
instance list, which also holds the routers of any other model built in the process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .route_layout import join_shards, moe_slots, routes_for_router, routes_to_batch, sequence_shard, token_index

__all__ = ["MODES", "MegatronRouterReplay", "replay_transformer_overrides"]

MODES = ("disabled", "R2", "R3")


def replay_transformer_overrides(overrides: dict, prefix: str) -> dict:
    """TransformerConfig fields router replay needs: routers with a ``RouterReplay``, and the unfused top-k
    (megatron-core's fused top-k kernel bypasses the replay hook)."""
    if overrides.get("moe_router_fusion"):
        raise ValueError(f"{prefix}.router_replay.mode needs the unfused router: "
                         f"{prefix}.override_transformer_config.moe_router_fusion=true bypasses megatron-core's "
                         "router replay; set it to false")
    return {**overrides, "moe_enable_routing_replay": True, "moe_router_fusion": False}


class _Chunk:
    """The routers of one model chunk, in decoder order, with their MoE slots."""

    def __init__(self, replays: list, layer_numbers: list[int]):
        self.replays = replays
        self.layer_numbers = layer_numbers
        self.slots: list[int] = []


class MegatronRouterReplay:
    def __init__(self, mode: str, chunks: list[torch.nn.Module], top_k: int, sequence_parallel: bool):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        if mode not in ("R2", "R3"):
            raise ValueError(f"router_replay.mode={mode!r}; expected one of {MODES}")
        self.mode = mode
        self.top_k = int(top_k)
        self._action = RouterReplayAction
        self._chunks: dict[int, _Chunk] = {}
        for chunk in chunks:
            replays, numbers = [], []
            for module in chunk.modules():
                rr = getattr(module, "router_replay", None)
                if isinstance(rr, RouterReplay):
                    replays.append(rr)
                    numbers.append(int(module.layer_number))
            self._chunks[id(chunk)] = _Chunk(replays, numbers)
        mine = [n for c in self._chunks.values() for n in c.layer_numbers]
        if ps.get_pipeline_model_parallel_world_size() > 1:  # every stage's MoE layers, to number them globally
            everyone: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(everyone, mine, group=ps.get_pipeline_model_parallel_group())
        else:
            everyone = [mine]
        slot_of = moe_slots(everyone)
        if not slot_of:
            raise ValueError(f"router_replay.mode={mode} needs a MoE model (num_moe_experts > 0): no router with "
                             "replay was built")
        self.num_slots = len(slot_of)
        for c in self._chunks.values():
            c.slots = [slot_of[n] for n in c.layer_numbers]
        self._sp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()) \
            if sequence_parallel else (0, 1)
        self._recorded: dict[int, dict[int, torch.Tensor]] = {}  # micro-batch -> slot -> (T_local, k)
        self._index: dict[int, torch.Tensor] = {}  # micro-batch -> router-order token index (all tensor ranks)

    # ------------------------------------------------------------------ around one batch
    def begin_batch(self) -> None:
        self._clear()
        self._recorded, self._index = {}, {}

    def end_batch(self) -> None:
        self._clear()

    def _clear(self) -> None:
        for c in self._chunks.values():
            for rr in c.replays:
                rr.clear_indices()
                rr.clear_router_replay_action()

    # ------------------------------------------------------------------ around one forward step
    def before_forward(self, chunk, mb_index: int, mb: dict, packed, record: bool) -> None:
        """Arm ``chunk``'s routers for micro-batch ``mb_index``: record (R2's old-log-prob pass), replay the batch's
        ``routed_experts`` (R3's passes and R2's update), or route freely (a batch without routes)."""
        c = self._chunks[id(chunk)]
        bsz, seqlen = mb["input_ids"].shape
        if packed is not None:
            index = token_index(bsz, seqlen, packed.indices, packed.input_ids.shape[-1])
        else:
            index = token_index(bsz, seqlen)
        self._index[mb_index] = index.cpu()
        if record:
            action = self._action.RECORD
        elif "routed_experts" in mb:
            local = sequence_shard(index, *self._sp)
            for rr, routes in zip(c.replays, routes_for_router(mb["routed_experts"], local, c.slots, self.top_k)):
                rr.set_target_indices(routes)
            action = self._action.REPLAY_FORWARD
        else:
            action = None
        for rr in c.replays:
            if action is None:
                rr.clear_router_replay_action()
            else:
                rr.set_router_replay_action(action)

    def after_forward(self, chunk, mb_index: int, output, record: bool, forward_only: bool):
        """Collect what was recorded; in a training pass, have the chunk's backward replay the same routes."""
        c = self._chunks[id(chunk)]
        if record:
            got = self._recorded.setdefault(mb_index, {})
            for slot, rr in zip(c.slots, c.replays):
                indices = rr.get_recorded_indices()
                if indices is None:
                    raise RuntimeError(f"router replay: the router of MoE layer {slot} recorded nothing in this forward")
                got[slot] = indices.detach()
        if forward_only or record:
            for rr in c.replays:  # nothing of this forward is needed again
                rr.clear_indices()
            return output
        replaying = c.replays and c.replays[0].router_replay_action == self._action.REPLAY_FORWARD
        if replaying:
            def to_backward(_grad):
                for rr in c.replays:
                    rr.set_router_replay_action(self._action.REPLAY_BACKWARD)

            tensors = output.values() if isinstance(output, dict) else [output]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(to_backward)
        return output

    # ------------------------------------------------------------------ R2: the recorded routes
    def recorded_routes(self, micro: list[dict]) -> dict[int, torch.Tensor]:
        """Micro-batch -> its recorded routes ``(B, L, M, k)`` int16 on the CPU, on every rank (collective over the
        tensor group under sequence parallelism and over the pipeline group)."""
        from megatron.core import parallel_state as ps

        mine = {i: {s: t.cpu() for s, t in slots.items()} for i, slots in self._recorded.items()}
        if self._sp[1] > 1:
            shards: list[Any] = [None] * self._sp[1]
            dist.all_gather_object(shards, mine, group=ps.get_tensor_model_parallel_group())
            mine = join_shards(shards)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
            mine = {}
            for stage in stages:
                for i, slots in stage.items():
                    mine.setdefault(i, {}).update(slots)
        return {i: routes_to_batch(mine.get(i, {}), self._index[i], micro[i]["attention_mask"].cpu(), self.num_slots)
                for i in range(len(micro))}


def read_mode(engine_config: Any) -> str:
    """``<role>.megatron.router_replay.mode`` ('disabled' when the block is absent)."""
    from verl.utils.config import cfg_get

    block = cfg_get(engine_config, "router_replay", None) or {}
    mode = str(cfg_get(block, "mode", "disabled") or "disabled")
    if mode not in MODES:
        raise ValueError(f"megatron.router_replay.mode={mode!r}; expected one of {MODES}")
    return mode

