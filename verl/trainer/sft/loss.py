"""The SFT loss: mean negative log-likelihood of the assistant tokens of the whole global batch.

The engine returns next-token log-probs in the padded layout: ``log_probs[:, t]`` is log p(token t+1).
``loss_mask[:, t + 1]`` says whether token t+1 is a target, so the loss reads ``log_probs[:, :-1]`` against
``loss_mask[:, 1:]``.
"""

from __future__ import annotations

import torch

__all__ = ["make_sft_loss", "token_nll_sum"]


def token_nll_sum(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of -log p over target tokens, number of target tokens) of a (B, L) batch."""
    mask = loss_mask[:, 1:].to(log_probs.dtype)
    return -(log_probs[:, :-1] * mask).sum(), mask.sum()


def make_sft_loss(global_num_tokens: int, dp_size: int):
    """The engine loss function for one global batch with ``global_num_tokens`` target tokens in all.

    Each micro-batch contributes its own token sum divided by the global count, times ``dp_size`` because
    data-parallel gradient reduction averages over ranks: summed over micro-batches and averaged over
    ranks the gradient is that of the global per-token mean, however the batch was split."""
    if global_num_tokens <= 0:
        raise ValueError("the global batch has no assistant tokens to train on")
    scale = float(dp_size) / float(global_num_tokens)

    def sft_loss(outputs: dict, micro_batch: dict):
        nll, count = token_nll_sum(outputs["log_probs"], micro_batch["loss_mask"].to(outputs["log_probs"].device))
        return nll * scale, {}

    return sft_loss
