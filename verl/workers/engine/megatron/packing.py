"""Packed (THD) micro-batches for megatron-core, and the way back to the padded (B, L) layout.

A padded micro-batch becomes one row of real tokens with ``cu_seqlens`` marking where each sequence starts,
which megatron-core takes as ``PackedSeqParams(qkv_format="thd")``: attention and the Gated DeltaNet
recurrences restart at every boundary. With sequence parallelism the row is split over the TP ranks, so its
length is padded to a multiple of ``align``; the padding forms one extra sequence of its own at the end (it
attends only to itself and its outputs are dropped).

Under context parallelism (``cp`` > 1) every sequence is also padded, after its last real token, to a multiple
of ``2 * cp`` (the unit :class:`verl.models.mcore.context_parallel.CPShard` cuts it into); the padding sits after
every real token of its sequence, so causal attention, the conv and the delta rule never let it reach a real
token, and its outputs are dropped. ``cu_seqlens`` are then the padded boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["PackedMicroBatch", "pack_thd", "unpack_thd", "next_token_labels"]


@dataclass
class PackedMicroBatch:
    input_ids: torch.Tensor  # (1, T) real tokens back to back (+ alignment padding)
    position_ids: torch.Tensor  # (1, T), or (C, 1, T) for mRoPE
    labels: torch.Tensor  # (1, T): the token after each position in the padded row (0 past a row's end)
    cu_seqlens: torch.Tensor  # (n + 1,) int32, or (n + 2,) with an alignment-padding sequence at the end
    max_seqlen: int
    indices: torch.Tensor  # (T_real,) flat positions of the real tokens in the (B * L) padded layout
    batch_size: int
    seq_len: int
    num_real: int  # T_real; positions >= num_real are alignment padding (when token_index is None)
    token_index: Optional[torch.Tensor] = None  # (T_real,) packed positions of the real tokens (per-sequence pad)
    cp_shard: Optional[Any] = None  # the CPShard of this row under context parallelism (set by the engine)

    def packed_seq_params(self):
        """megatron-core's ``PackedSeqParams`` for this micro-batch (imports megatron-core). Under context
        parallelism the boundaries stay global (megatron-core's convention); the shard rides along so the
        layers do not rebuild it."""
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                                 max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)
        if self.cp_shard is not None:
            params._verl_cp_shard = self.cp_shard
        return params


def next_token_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B, L): at each position the next token of the same row (0 at the last position)."""
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def pack_thd(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             align: int = 1, cp: int = 1) -> PackedMicroBatch:
    """Pack a right- or left-padded (B, L) micro-batch into one THD row. ``align`` is the multiple the
    packed length must have (the TP size under sequence parallelism); with ``cp`` > 1 each sequence is padded to a
    multiple of ``2 * cp`` and the row to a multiple of ``2 * cp * align``."""
    if cp > 1:
        return _pack_thd_cp(input_ids, attention_mask, position_ids, align, cp)
    bsz, seqlen = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(-1).to(torch.int32)
    indices = mask.reshape(-1).nonzero(as_tuple=False).squeeze(-1)
    labels_padded = next_token_labels(input_ids, attention_mask)
    ids = input_ids.reshape(-1)[indices]
    labels = labels_padded.reshape(-1)[indices]
    if position_ids.dim() == 3:  # (B, C, L) mRoPE -> (C, T)
        pos = position_ids.transpose(0, 1).reshape(position_ids.size(1), -1)[:, indices]
    else:
        pos = position_ids.reshape(-1)[indices]
    num_real = int(ids.numel())
    cu = torch.zeros(bsz + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = torch.cumsum(lengths, 0)
    # Rows with no tokens would give empty sequences, which varlen kernels reject: drop their boundaries.
    cu = torch.unique_consecutive(cu)
    pad = (-num_real) % max(int(align), 1)
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        labels = torch.cat([labels, labels.new_zeros(pad)])
        pad_pos = torch.arange(pad, device=pos.device, dtype=pos.dtype)
        pos = torch.cat([pos, pad_pos.expand(*pos.shape[:-1], pad)], dim=-1)
        cu = torch.cat([cu, cu.new_tensor([num_real + pad])])
    max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    pos = pos.unsqueeze(-2) if pos.dim() == 2 else pos.unsqueeze(0)
    return PackedMicroBatch(ids.unsqueeze(0), pos, labels.unsqueeze(0), cu, max_seqlen, indices, bsz, seqlen,
                            num_real)


def _pack_thd_cp(input_ids, attention_mask, position_ids, align: int, cp: int) -> PackedMicroBatch:
    """:func:`pack_thd` for context parallelism: every sequence padded to a multiple of ``2 * cp``."""
    from verl.models.mcore.context_parallel import cp_pad_length

    bsz, seqlen = input_ids.shape
    dev = input_ids.device
    mask = attention_mask.bool()
    indices = mask.reshape(-1).nonzero(as_tuple=False).squeeze(-1)
    lengths = mask.sum(-1).tolist()
    padded = [cp_pad_length(n, cp) if n else 0 for n in lengths]
    total_real = sum(padded)
    unit = 2 * cp * max(int(align), 1)
    tail = (-total_real) % unit  # one trailing padding sequence, itself a multiple of 2 * cp
    total = total_real + tail
    starts = torch.tensor([0] + padded, device=dev).cumsum(0)[:-1]
    # packed position of every real token: its sequence's padded start + its rank within the row's real tokens
    row = indices // seqlen
    rank_in_row = torch.cat([torch.arange(n, device=dev) for n in lengths]) if indices.numel() else indices
    token_index = starts[row] + rank_in_row
    ids = input_ids.new_zeros(total)
    ids[token_index] = input_ids.reshape(-1)[indices]
    labels = input_ids.new_zeros(total)
    labels[token_index] = next_token_labels(input_ids, attention_mask).reshape(-1)[indices]
    bounds = [0]
    for n in padded:
        if n:
            bounds.append(bounds[-1] + n)
    if tail:
        bounds.append(total)
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    # padding positions continue their sequence's count (they sit after its real tokens and are dropped)
    seq_of = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=dev),
                                     (cu[1:] - cu[:-1]).long(), output_size=total)
    base = torch.arange(total, device=dev) - cu.long()[seq_of]
    if position_ids.dim() == 3:  # (B, C, L) mRoPE -> (C, T)
        real_pos = position_ids.transpose(0, 1).reshape(position_ids.size(1), -1)[:, indices]
        pos = base.to(position_ids.dtype).expand(position_ids.size(1), total).clone()
        pos[:, token_index] = real_pos
        pos = pos.unsqueeze(-2)
    else:
        pos = base.to(position_ids.dtype)
        pos[token_index] = position_ids.reshape(-1)[indices]
        pos = pos.unsqueeze(0)
    max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    return PackedMicroBatch(ids.unsqueeze(0), pos, labels.unsqueeze(0), cu, max_seqlen, indices, bsz, seqlen,
                            int(indices.numel()), token_index)


def unpack_thd(values: torch.Tensor, packed: PackedMicroBatch, fill: float = 0.0,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Per-token values (1, T) or (T,) of a packed row -> (B, L) padded layout (``fill`` elsewhere)."""
    if packed.token_index is not None:
        flat = values.reshape(-1).index_select(0, packed.token_index)
    else:
        flat = values.reshape(-1)[: packed.num_real]
    out = flat.new_full((packed.batch_size * packed.seq_len,), fill, dtype=dtype or flat.dtype)
    out = out.index_put((packed.indices,), flat.to(out.dtype))
    return out.view(packed.batch_size, packed.seq_len)
