"""Preference-feedback PPO (PF-PPO) resampling of a rollout batch by its scores."""

from __future__ import annotations

import copy

import numpy as np
import torch

__all__ = ["PF_PPO_REWEIGHT_METHODS", "compute_pf_ppo_reweight_data"]

PF_PPO_REWEIGHT_METHODS = ("pow", "max_min", "max_random")


@torch.no_grad()
def _sample_weights(scores: torch.Tensor, method: str, weight_pow: float) -> torch.Tensor:
    if method == "pow":
        return scores.abs().pow(weight_pow)
    if method == "max_min":
        extreme = (scores == scores.max()) | (scores == scores.min())
        return extreme.to(scores.dtype)
    if method == "max_random":
        # best responses are 4x as likely as the rest
        return torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    raise ValueError(f"Unsupported reweight_method: {method!r}. Valid choices: {list(PF_PPO_REWEIGHT_METHODS)}")


def compute_pf_ppo_reweight_data(data, reweight_method: str = "pow", weight_pow: float = 2.0):
    """Resample ``len(batch)`` rows with replacement, with probability from the sequence scores.

    ``data`` is DataProto-like (``.batch`` with ``token_level_scores``,
    ``.non_tensor_batch``, ``.meta_info``).  Per-sample lists in ``meta_info``
    (length == batch size) are resampled too; everything else is kept.
    Returns a new object; ``data`` is not modified.
    """
    scores = data.batch["token_level_scores"].sum(dim=-1)
    weights = torch.clamp(_sample_weights(scores, reweight_method, weight_pow) + 1e-8, min=1e-8)
    n = scores.shape[0]
    picks = torch.multinomial(weights, n, replacement=True)
    picks_np = picks.cpu().numpy()

    out = copy.deepcopy(data)
    if hasattr(data.batch, "batch_size"):  # TensorDict supports fancy indexing directly
        out.batch = data.batch[picks]
    else:
        out.batch = {k: v[picks] for k, v in data.batch.items()}
    out.non_tensor_batch = {
        k: (v[picks_np] if isinstance(v, np.ndarray) else [v[i] for i in picks_np])
        for k, v in data.non_tensor_batch.items()
    }
    out.meta_info = {
        k: ([v[i] for i in picks_np] if isinstance(v, list) and len(v) == n else v) for k, v in data.meta_info.items()
    }
    return out
