"""Where each token of a micro-batch sits for megatron-core's MoE routers, so router replay can hand every router
exactly the routes of the tokens it sees, and put what it recorded back into the batch's layout.

Pure torch (no megatron-core import): the seams of :mod:`router_replay` that can be checked on any machine.

The batch carries ``routed_experts`` laid out like ``input_ids``: ``(B, L, moe_layers, top_k)``, ``-1`` where a
token has no route (padding, and the rollout's last response token, which was never fed back to the model).
A megatron-core router sees something else:

* the decoder's token order: the packed THD row (``packing.pack_thd``: the real tokens of the padded rows back to
  back, then the alignment padding that sequence parallelism needs), or without packing the padded batch
  transposed to megatron's ``[S, B]`` and flattened sequence-major;
* under sequence parallelism only its tensor rank's contiguous slice of that order: the embedding (or the
  previous pipeline stage) hands each rank ``[S / tp, B, H]`` and ``MoELayer`` routes those local tokens before
  its token dispatcher exchanges anything;
* only the MoE layers of its pipeline stage (and virtual stage), numbered by the decoder layer they sit in.

A *token index* describes the first two: for every token in router order, its flat position ``b * L + l`` in
the padded layout, or ``-1`` for alignment padding.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

__all__ = ["NO_ROUTE", "token_index", "sequence_shard", "moe_slots", "routes_for_router", "routes_to_batch",
           "join_shards"]

NO_ROUTE = -1


def token_index(bsz: int, seqlen: int, packed_indices: Optional[torch.Tensor] = None,
                packed_len: Optional[int] = None) -> torch.Tensor:
    """Router-order token index of one micro-batch (before any sequence-parallel split).

    Packed (THD): ``packed_indices`` are the flat positions of the real tokens in packing order
    (``PackedMicroBatch.indices``) and ``packed_len`` the row's length with alignment padding. Not packed: the
    decoder runs on ``[L, B]``, so the order is position-major."""
    if packed_indices is not None:
        total = int(packed_len if packed_len is not None else packed_indices.numel())
        pad = total - packed_indices.numel()
        if pad < 0:
            raise ValueError(f"packed row of {total} tokens is shorter than its {packed_indices.numel()} real tokens")
        return torch.cat([packed_indices.long(), packed_indices.new_full((pad,), NO_ROUTE, dtype=torch.long)])
    return torch.arange(bsz * seqlen).view(bsz, seqlen).t().reshape(-1)


def sequence_shard(index: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The slice of router order that tensor rank ``rank`` of ``size`` routes under sequence parallelism
    (megatron's scatter to the sequence-parallel region splits dim 0 into equal contiguous parts)."""
    if size <= 1:
        return index
    if index.numel() % size:
        raise ValueError(f"sequence parallelism splits {index.numel()} tokens over {size} tensor ranks unevenly; "
                         "the packed row must be padded to a multiple of the tensor-parallel size")
    part = index.numel() // size
    return index[rank * part:(rank + 1) * part]


def moe_slots(layer_numbers: Sequence[Sequence[int]]) -> dict[int, int]:
    """Decoder layer number -> MoE layer slot (the third axis of ``routed_experts``), from the layer numbers of
    the MoE routers that every pipeline rank holds (``layer_numbers[pp_rank]``; megatron numbers layers from 1
    across stages). MoE layers are counted in decoder order, as the rollout numbers them."""
    flat = [int(n) for rank in layer_numbers for n in rank]
    if len(set(flat)) != len(flat):
        raise ValueError(f"two MoE routers claim the same decoder layer: {sorted(flat)}")
    return {n: slot for slot, n in enumerate(sorted(flat))}


def routes_for_router(routed_experts: torch.Tensor, index: torch.Tensor, slots: Sequence[int],
                      top_k: int) -> list[torch.Tensor]:
    """``routed_experts`` (B, L, M, k) -> one ``(T_local, k)`` int64 tensor per slot in ``slots``, for the tokens of
    ``index`` (this rank's router order).

    megatron-core replays a whole layer at once (it cannot keep a token's own top-k), so a token without a route
    gets experts ``0 .. k-1``: the alignment padding (a sequence of its own whose outputs are dropped), padding
    tokens of an unpacked batch, and the rollout's last response token. Routing is per token, so that choice
    changes only those tokens' own hidden states, which no scored log-prob reads (a last token's logits predict
    past the response; the others are masked)."""
    bsz, seqlen, n_slots, k = routed_experts.shape
    if k != top_k:
        raise ValueError(f"router replay: routed_experts has top_k={k}, the model's routers pick {top_k}")
    if slots and max(slots) >= n_slots:
        raise ValueError(f"router replay: routed_experts holds {n_slots} MoE layers, this rank routes MoE layer "
                         f"{max(slots)} (0-based): the rollout model and the trainer's differ")
    flat = routed_experts.reshape(bsz * seqlen, n_slots, k)
    index = index.to(flat.device)
    picked = flat[index.clamp(min=0)][:, list(slots)].long()  # (T, len(slots), k)
    missing = (index < 0)[:, None] | (picked < 0).any(-1)  # (T, len(slots))
    filler = torch.arange(k, device=flat.device).expand_as(picked)
    picked = torch.where(missing[..., None], filler, picked)
    return [picked[:, j].contiguous() for j in range(len(slots))]


def join_shards(shards: Sequence[Mapping[int, Mapping[int, torch.Tensor]]]) -> dict[int, dict[int, torch.Tensor]]:
    """Recorded routes of the tensor ranks of one stage, ``shards[tp_rank][micro_batch][slot] = (T/tp, k)``, back
    into router order ``[micro_batch][slot] = (T, k)`` (the inverse of :func:`sequence_shard`)."""
    out: dict[int, dict[int, torch.Tensor]] = {}
    for mb in shards[0]:
        out[mb] = {slot: torch.cat([s[mb][slot] for s in shards], dim=0) for slot in shards[0][mb]}
    return out


def routes_to_batch(recorded: Mapping[int, torch.Tensor], index: torch.Tensor, attention_mask: torch.Tensor,
                    num_slots: int) -> torch.Tensor:
    """Recorded routes ``{slot: (T, k)}`` in router order (all tensor ranks joined, every pipeline stage's slots)
    -> ``(B, L, M, k)`` int16 like ``input_ids``, ``-1`` at padding and alignment padding."""
    missing = [s for s in range(num_slots) if s not in recorded]
    if missing:
        raise RuntimeError(f"router replay: no routes recorded for MoE layers {missing}")
    bsz, seqlen = attention_mask.shape
    stacked = torch.stack([recorded[s] for s in range(num_slots)], dim=1).to(torch.int16)  # (T, M, k)
    if stacked.shape[0] != index.numel():
        raise RuntimeError(f"router replay: routers recorded {stacked.shape[0]} tokens, the micro-batch has "
                           f"{index.numel()} in router order")
    index = index.to(stacked.device)
    out = torch.full((bsz * seqlen, num_slots, stacked.shape[-1]), NO_ROUTE, dtype=torch.int16,
                     device=stacked.device)
    real = index >= 0
    out[index[real]] = stacked[real]
    out[~attention_mask.reshape(-1).bool().to(out.device)] = NO_ROUTE  # an unpacked batch routes its padding too
    return out.view(bsz, seqlen, num_slots, -1)
