"""Loss aggregation (token matrix -> scalar) plus the entropy and value losses.

Split invariance
----------------
A mini-batch is sharded over ``dp_size`` data-parallel ranks and each shard is
cut into micro-batches; every micro-batch loss is back-propagated separately,
gradients are *summed* over micro-batches and *averaged* over ranks.  For the
result to equal the loss of the whole mini-batch, each micro-batch must be
normalised by a **global** count, and multiplied by ``dp_size`` to undo the
rank average:

* ``batch_num_tokens``  - valid tokens in the whole mini-batch (all ranks);
* ``global_batch_size`` - sequences in the whole mini-batch (all ranks);
* ``dp_size``           - number of data-parallel ranks.

Without them (single process, one micro-batch) the local counts are used.
The actor passes these as ``**config.global_batch_info``.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from verl.utils.torch_functional import clip_by_value, entropy_from_logits, masked_mean, masked_sum

__all__ = ["AGG_LOSS_MODES", "agg_loss", "compute_entropy_loss", "compute_value_loss"]

AGG_LOSS_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _local_seq_count(loss_mask: Tensor, dp_size: int, global_batch_size):
    if global_batch_size is not None:
        return global_batch_size
    if dp_size > 1:
        raise ValueError("global_batch_size is required when dp_size > 1")
    # sequences whose mask is empty contribute nothing and are not counted
    return (loss_mask.sum(dim=-1) > 0).sum()


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Union[int, float, Tensor, None] = None,
    global_batch_size: Union[int, float, Tensor, None] = None,
    loss_scale_factor: Union[int, float, Tensor, None] = None,
) -> Tensor:
    """Reduce a ``(bs, response_length)`` loss matrix to a scalar.

    Modes:
        ``token-mean``              sum of valid tokens / tokens in the (global) batch
        ``token-sum``               sum of valid tokens (no normalisation)
        ``seq-mean-token-sum``      per-sequence token sum, averaged over sequences
        ``seq-mean-token-mean``     per-sequence token mean, averaged over sequences
        ``seq-mean-token-sum-norm`` like seq-mean-token-sum, divided by
                                    ``loss_scale_factor`` (default: response_length)

    All modes multiply by ``dp_size`` so the data-parallel gradient average gives
    back the global-batch loss (see module docstring).
    """
    mask = loss_mask.to(loss_mat.dtype) if loss_mask.dtype == torch.bool else loss_mask

    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            # clamp: an all-padding micro-batch yields 0 instead of 0/0 = NaN
            batch_num_tokens = mask.sum().clamp(min=1)
        return masked_sum(loss_mat, mask) / batch_num_tokens * dp_size

    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size

    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens_per_seq = mask.sum(dim=-1)
        per_seq = masked_sum(loss_mat, mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            per_seq = per_seq / (tokens_per_seq + 1e-8)
        has_tokens = (tokens_per_seq > 0).to(loss_mat.dtype)
        n_seq = _local_seq_count(mask, dp_size, global_batch_size)
        loss = masked_sum(per_seq, has_tokens) / n_seq * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            # a fixed factor keeps the scale constant across steps; default = padded length
            scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
            loss = loss / scale
        return loss

    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode!r}. Valid choices: {list(AGG_LOSS_MODES)}")


def compute_entropy_loss(logits: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean"):
    """Aggregated categorical entropy of ``logits`` (bs, response_length, vocab)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: Union[int, float, Tensor, None] = None,
    global_batch_size: Union[int, float, Tensor, None] = None,
    loss_scale_factor: Union[int, float, Tensor, None] = None,
):
    """PPO clipped value loss.

    ``0.5 * agg(max((v - R)^2, (clip(v, old - c, old + c) - R)^2))``; returns
    ``(vf_loss, vf_clipfrac)`` where the clip fraction is the masked share of
    tokens where the clipped branch is strictly larger.
    """
    v_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    err_raw = (vpreds - returns) ** 2
    err_clip = (v_clipped - returns) ** 2
    normalisers = {
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }
    vf_loss = 0.5 * agg_loss(torch.maximum(err_raw, err_clip), response_mask, loss_agg_mode, **normalisers)
    vf_clipfrac = masked_mean((err_clip > err_raw).float(), response_mask)
    return vf_loss, vf_clipfrac
