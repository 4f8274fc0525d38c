"""Log-probs and entropy from vocab-parallel logits, without gathering the vocabulary on one rank.

Each tensor-parallel rank holds logits for a contiguous slice of the vocabulary (megatron-core's output
layer does not gather them). The softmax statistics need three reductions over the TP group: the max (for
stability; no gradient flows through it, the result does not depend on it), the sum of exponentials and the
probability-weighted logit sum. The loss is replicated on every TP rank, so the sums are all-reduced in
the forward and passed through unchanged in the backward (each rank's gradient is already the full
gradient with respect to its own slice).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

__all__ = ["vocab_parallel_log_probs_and_entropy"]


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    return _AllReduceSumIdentityGrad.apply(x, group) if _group_size(group) > 1 else x


def _stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group, want_entropy: bool):
    x = logits.float()
    with torch.no_grad():
        m = x.max(dim=-1).values
        if _group_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    x = x - m.unsqueeze(-1)
    exp = x.exp()
    sum_exp = _sum(exp.sum(-1), group)
    log_z = sum_exp.log()
    local = labels - vocab_start
    outside = (local < 0) | (local >= x.size(-1))
    picked = x.gather(-1, local.clamp(0, x.size(-1) - 1).unsqueeze(-1)).squeeze(-1)
    picked = _sum(picked.masked_fill(outside, 0.0), group)
    log_probs = picked - log_z
    if not want_entropy:
        return log_probs, None
    expected = _sum((exp * x).sum(-1), group) / sum_exp
    return log_probs, log_z - expected


def vocab_parallel_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                                         temperature: float = 1.0, calculate_entropy: bool = False,
                                         chunk_size: Optional[int] = None):
    """``logits`` (..., V / tp) of this rank's vocabulary slice, ``labels`` (...) global token ids ->
    (log_probs (...), entropy (...) or None), both float32 and identical on every TP rank.

    ``chunk_size`` computes the statistics ``chunk_size`` tokens at a time (recomputed in the backward), so
    the float32 working copies never exceed one chunk."""
    tp_rank = dist.get_rank(tp_group) if _group_size(tp_group) > 1 else 0
    vocab_start = tp_rank * logits.size(-1)
    if temperature != 1.0:
        logits = logits / temperature
    shape = labels.shape
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_labels = labels.reshape(-1)
    if not chunk_size or flat_labels.numel() <= chunk_size:
        lp, ent = _stats(flat_logits, flat_labels, vocab_start, tp_group, calculate_entropy)
    else:
        lps, ents = [], []
        for start in range(0, flat_labels.numel(), chunk_size):
            sl = slice(start, start + chunk_size)
            if torch.is_grad_enabled() and flat_logits.requires_grad:
                out = checkpoint(_stats, flat_logits[sl], flat_labels[sl], vocab_start, tp_group,
                                 calculate_entropy, use_reentrant=False)
            else:
                out = _stats(flat_logits[sl], flat_labels[sl], vocab_start, tp_group, calculate_entropy)
            lps.append(out[0])
            if calculate_entropy:
                ents.append(out[1])
        lp = torch.cat(lps)
        ent = torch.cat(ents) if calculate_entropy else None
    return lp.view(shape), (ent.view(shape) if ent is not None else None)
