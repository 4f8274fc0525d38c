"""Splitting a rank's batch into micro-batches: fixed size, or balanced under a token budget (dynamic bsz)."""

from __future__ import annotations

from typing import Optional

import torch

from verl.protocol import DataProto


def merge_mm_inputs(rows: list[dict]) -> dict:
    """Concatenate per-row processor outputs (pixel_values, image_grid_thw, ...) along dim 0."""
    rows = [r for r in rows if r]
    if not rows:
        return {}
    keys = rows[0].keys()
    return {k: torch.cat([r[k] for r in rows if k in r], dim=0) for k in keys}


def split_micro_batches(data: DataProto, micro_batch_size: Optional[int], use_dynamic_bsz: bool,
                        max_token_len: Optional[int], sp_size: int, device: torch.device, with_mm: bool = True,
                        budget_key: Optional[str] = None) -> tuple[list[dict], Optional[list[int]]]:
    """``(micro-batches as dicts of device tensors, flat row order or None)``.

    Fixed size keeps the row order. Dynamic bsz packs rows into micro-batches of at most ``max_token_len``
    real tokens per rank (times the SP size: each SP rank holds 1/sp of a packed row) and returns the order
    the rows were visited in, which the caller inverts. ``budget_key`` names the budget's config key in errors."""
    batch = data.batch
    n = len(data)
    if use_dynamic_bsz:
        if not max_token_len:
            keys = budget_key or "ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu"
            raise ValueError(f"use_dynamic_bsz needs a token budget ({keys})")
        from verl.utils.seqlen_balancing import rearrange_micro_batches

        # Every rank must run the same number of micro-batches: FSDP2 gathers parameters in each forward, so a
        # rank with one micro-batch fewer would leave the others waiting in a collective for ever.
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        micro_tds, groups = rearrange_micro_batches(batch, max_token_len=int(max_token_len) * sp_size,
                                                    dp_group=group,
                                                    **({"budget_key": budget_key} if budget_key else {}))
        order = [i for g in groups for i in g]
    else:
        size = int(micro_batch_size or n)
        groups = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        micro_tds = [batch[g[0] : g[-1] + 1] for g in groups]
        order = None
    has_mm = with_mm and "multi_modal_inputs" in data.non_tensor_batch
    micro = []
    for td, g in zip(micro_tds, groups):
        # Batches travel on CPU between controller and workers; compute happens on the model's device.
        mb = {k: td[k].to(device) for k in td.keys()}
        if has_mm:
            mm = merge_mm_inputs([data.non_tensor_batch["multi_modal_inputs"][i] for i in g])
            mb["multi_modal_inputs"] = {k: v.to(device) for k, v in mm.items()}
        micro.append(mb)
    return micro, order
