"""Remove-padding ("packing"): a padded micro-batch becomes one row of real tokens, and back.

Packed layout: ``input_ids`` (1, T) holding every sequence's real tokens back to back, ``position_ids``
restarting at 0 at each sequence (or (C, 1, T) for mRoPE), which is how the patched models find sequence
boundaries. With Ulysses sequence parallelism each rank keeps a 1/sp slice of the packed row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (1, T_local)
    position_ids: torch.Tensor  # (1, T_local) or (C, 1, T_local)
    labels: torch.Tensor  # (1, T_local): the next real token of the same packed stream at each position
    indices: torch.Tensor  # (T,) flat positions of the real tokens in the (B*L) padded layout
    batch_size: int
    seq_len: int
    sp_pad: int = 0  # tokens appended so T divides by the sequence-parallel size


def pack_micro_batch(micro_batch: dict, sp_size: int = 1) -> PackedBatch:
    input_ids = micro_batch["input_ids"]
    attention_mask = micro_batch["attention_mask"]
    position_ids = micro_batch["position_ids"]
    bsz, seqlen = input_ids.shape
    indices = attention_mask.reshape(-1).nonzero(as_tuple=False).squeeze(-1)
    ids = input_ids.reshape(-1)[indices].unsqueeze(0)
    if position_ids.dim() == 3:  # (B, C, L) mRoPE -> (C, 1, T)
        pos = position_ids.transpose(0, 1).reshape(position_ids.size(1), -1)[:, indices].unsqueeze(1)
    else:
        pos = position_ids.reshape(-1)[indices].unsqueeze(0)
    labels = torch.roll(ids, shifts=-1, dims=-1)
    sp_pad = 0
    if sp_size > 1:
        from verl.utils.ulysses import ulysses_pad_and_slice_inputs

        ids_sliced, pos_sliced, sp_pad = ulysses_pad_and_slice_inputs(ids, pos, sp_size=sp_size)
        labels, _, _ = ulysses_pad_and_slice_inputs(labels, None, sp_size=sp_size)
        ids, pos = ids_sliced, pos_sliced
    return PackedBatch(ids, pos, labels, indices, bsz, seqlen, sp_pad)


def unpack_to_padded(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Scatter per-token values (1, T_local) back to the padded (B, L) layout (zeros at padding).

    Under Ulysses SP each rank first gathers the whole packed row (the gather's backward scales gradients so
    the FSDP average over dp*sp ranks comes out right)."""
    values = values.reshape(1, -1)
    if packed.sp_pad or _sp_world() > 1:
        from verl.utils.ulysses import gather_outputs_and_unpad

        values = gather_outputs_and_unpad(values, gather_dim=1, unpad_dim=1, padding_size=packed.sp_pad)
    values = values.reshape(-1)
    full = torch.zeros(packed.batch_size * packed.seq_len, dtype=values.dtype, device=values.device)
    full = full.index_put((packed.indices,), values)
    return full.view(packed.batch_size, packed.seq_len)


def _sp_world() -> int:
    try:
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size
    except ImportError:
        return 1
    return get_ulysses_sequence_parallel_world_size()
