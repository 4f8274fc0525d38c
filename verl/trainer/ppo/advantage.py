"""Advantage estimators (plain functions; the registry lives in core_algos).

Every estimator returns ``(advantages, returns)``, both ``(bs, response_length)``.
Outcome-only estimators reduce ``token_level_rewards`` to one score per
response (sum over tokens) and broadcast the resulting scalar over the
response mask.  ``index`` holds the group id (prompt uid) of each response.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

from verl.utils.py_functional import config_get
from verl.utils.torch_functional import masked_whiten

__all__ = [
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_gpg_outcome_advantage",
]


# group label per response: numpy array (usually uid strings), list, or tensor
GroupIndex = Union[np.ndarray, list, Tensor]

# ----------------------------------------------------------------------------- helpers


def _labels(index) -> list:
    """Group labels as hashable Python values (0-d tensors hash by identity, so unwrap them)."""
    if isinstance(index, torch.Tensor):
        return index.reshape(-1).tolist()
    if isinstance(index, np.ndarray):
        return index.reshape(-1).tolist()
    return list(index)


def _members(index) -> dict[Any, list[int]]:
    """Map each group label to the row positions that carry it (insertion ordered)."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, label in enumerate(_labels(index)):
        groups[label].append(row)
    return groups


def _dense_group_ids(index, device) -> torch.Tensor:
    """Contiguous 0..G-1 ids for arbitrary labels, for scatter-style group reductions."""
    lookup: dict[Any, int] = {}
    ids = [lookup.setdefault(label, len(lookup)) for label in _labels(index)]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _group_mean_std(scores: Tensor, rows: list[int]):
    """Mean and unbiased std of one group; a singleton group uses mean 0, std 1 (as upstream)."""
    if len(rows) == 1:
        return torch.tensor(0.0, dtype=scores.dtype), torch.tensor(1.0, dtype=scores.dtype)
    vals = scores[rows]
    return vals.mean(), vals.std()


# ----------------------------------------------------------------------------- estimators


def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: Tensor,
    lam: Tensor,
    **kwargs,
):
    """Generalised Advantage Estimation (Schulman et al., arXiv:1506.02438).

    Backward recursion ``A_t = delta_t + gamma*lam*A_{t+1}`` with
    ``delta_t = r_t + gamma*V_{t+1} - V_t``.  Masked positions (e.g. tool
    observations inside a multi-turn response) are skipped: the running value
    and advantage pass through them unchanged.  ``returns = A + V`` is taken
    before the advantages are whitened over the response mask.
    """
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        steps = token_level_rewards.shape[-1]
        next_v = torch.zeros_like(values[:, 0])
        running = torch.zeros_like(values[:, 0])
        adv = torch.zeros_like(values)
        for t in range(steps - 1, -1, -1):
            m = mask[:, t]
            delta = token_level_rewards[:, t] + gamma * next_v - values[:, t]
            candidate = delta + gamma * lam * running
            running = m * candidate + (1 - m) * running
            next_v = m * values[:, t] + (1 - m) * next_v
            adv[:, t] = running
        returns = adv + values
        adv = masked_whiten(adv, response_mask)
    return adv, returns


def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """GRPO: ``(r - mean_g) / (std_g + epsilon)`` within each group.

    ``std_g`` is the unbiased (n-1) standard deviation.  With
    ``norm_adv_by_std_in_grpo=False`` only the mean is subtracted (Dr.GRPO,
    arXiv:2503.20783).  A group of one uses mean 0 and std 1.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        out = torch.empty_like(scores)
        for rows in _members(index).values():
            mean, std = _group_mean_std(scores, rows)
            centred = scores[rows] - mean
            out[rows] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """Same maths as :func:`compute_grpo_outcome_advantage`, with scatter reductions instead of a Python loop."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).float()
        gid = _dense_group_ids(index, scores.device)
        n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
        count = torch.zeros(n_groups, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
        total = torch.zeros(n_groups, device=scores.device).index_add_(0, gid, scores)
        mean = total / count.clamp(min=1.0)
        sq_dev = torch.zeros(n_groups, device=scores.device).index_add_(0, gid, (scores - mean[gid]) ** 2)
        std = (sq_dev / (count - 1.0).clamp(min=1.0)).sqrt()
        lonely = count <= 1
        mean = torch.where(lonely, torch.zeros_like(mean), mean)
        std = torch.where(lonely, torch.ones_like(std), std)
        centred = scores - mean[gid]
        scalars = centred / (std[gid] + epsilon) if norm_adv_by_std_in_grpo else centred
        adv = scalars.unsqueeze(-1) * response_mask
    return adv, adv


def compute_gdpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
    non_tensor_batch: Optional[dict] = None,
    batch: Optional[dict] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """GDPO (arXiv:2601.05242): GRPO-normalise each reward component separately, take the
    weighted sum, then whiten over the batch.

    Components come from ``non_tensor_batch[key]`` for each key in
    ``config.gdpo_reward_keys`` (placed on the last valid response token);
    weights from ``config.gdpo_reward_weights`` (default all ones).  Without
    config/batch data the single ``token_level_rewards`` component is used.
    """
    components = [token_level_rewards]
    weights = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = config_get(config, "gdpo_reward_keys")
        if not keys:
            raise ValueError("adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward components (keys "
                             "of the reward function's returned dict) to normalise separately.")
        prompt_len = batch["prompts"].size(1)
        last_tok = batch["attention_mask"][:, prompt_len:].sum(dim=1) - 1
        rows = torch.arange(response_mask.shape[0], device=response_mask.device)
        components = []
        for key in keys:
            if key not in non_tensor_batch:
                raise ValueError(
                    f"algorithm.gdpo_reward_keys names {key!r}, but the reward function returned no such key "
                    f"(per-sample keys: {sorted(non_tensor_batch)}); return it in reward_extra_info."
                )
            comp = torch.zeros_like(response_mask, dtype=torch.float32)
            vals = torch.as_tensor(np.asarray(non_tensor_batch[key], dtype=np.float32), device=comp.device)
            comp[rows, last_tok] = vals
            components.append(comp)
        w = config_get(config, "gdpo_reward_weights")
        weights = list(w) if w is not None else None
    if weights is None:
        weights = [1.0] * len(components)

    combined = None
    for w, comp in zip(weights, components, strict=True):
        part, _ = compute_grpo_outcome_advantage(
            comp, response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
        )
        combined = w * part if combined is None else combined + w * part
    adv = masked_whiten(combined, response_mask) * response_mask
    return adv, adv


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """Pass@k advantage (arXiv:2503.19595): only the best response of each group gets
    ``r_max - r_second_max`` (divided by the group's unbiased std + epsilon when
    ``config.norm_adv_by_std_in_grpo``, default True); all others get 0.
    ``config`` is required and its flag takes precedence over the argument."""
    assert config is not None, "grpo_passk needs the algorithm config"
    norm_by_std = config_get(config, "norm_adv_by_std_in_grpo", True)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        out = torch.zeros_like(scores)
        for label, rows in _members(index).items():
            if len(rows) < 2:
                raise ValueError(f"Pass@k requires at least 2 samples per group. Got {len(rows)} for group {label}.")
            vals = scores[rows]
            top2 = torch.topk(vals, 2)
            gap = top2.values[0] - top2.values[1]
            if norm_by_std:
                gap = gap / (vals.std() + epsilon)
            out[rows[int(top2.indices[0])]] = gap
        adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262): subtract the group mean (0 for a
    singleton group), broadcast over tokens, then whiten over the whole batch."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        centred = scores.clone()
        for rows in _members(index).values():
            if len(rows) > 1:
                centred[rows] = scores[rows] - scores[rows].mean()
        tiled = centred.unsqueeze(-1).expand_as(token_level_rewards) * response_mask
        adv = masked_whiten(tiled, response_mask) * response_mask
    return adv, adv


def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """RLOO (arXiv:2402.14740): ``r_i - mean(r_j, j != i)`` = ``n/(n-1) * (r_i - mean_g)``.

    A singleton group has no leave-one-out baseline and keeps its raw score."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        out = scores.clone()
        for rows in _members(index).values():
            n = len(rows)
            if n > 1:
                vals = scores[rows]
                out[rows] = (vals - vals.mean()) * n / (n - 1)
        adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """Vectorised RLOO: ``(n*r_i - sum_g) / (n-1)``.  Unlike the loop version, a
    singleton group gets advantage 0 (upstream behaviour)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid = _dense_group_ids(index, scores.device)
        n = torch.bincount(gid).to(scores.dtype)[gid]
        group_sum = torch.bincount(gid, weights=scores).to(scores.dtype)[gid]
        loo = (n * scores - group_sum) / (n - 1).clamp(min=1)
        loo = torch.where(n > 1, loo, torch.zeros_like(loo))
        adv = loo.unsqueeze(-1) * response_mask
    return adv, adv


def compute_opo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """OPO (arXiv:2505.23585): baseline = length-weighted mean score of the group
    (``sum(len*r)/sum(len)``); a singleton group uses baseline 0."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        lengths = response_mask.sum(dim=-1).to(scores.dtype)
        out = scores.clone()
        for rows in _members(index).values():
            if len(rows) > 1:
                ln = lengths[rows]
                out[rows] = scores[rows] - (ln * scores[rows]).sum() / ln.sum()
        adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, config: Optional[Any] = None, **kwargs
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted return-to-go with ``config.gamma``,
    whitened over the batch.  Masked positions get return 0 but let the running
    return pass through, so a reward after an observation span reaches earlier tokens."""
    assert config is not None, "reinforce_plus_plus needs the algorithm config (for gamma)"
    gamma = config_get(config, "gamma")
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in range(token_level_rewards.shape[1] - 1, -1, -1):
            m = mask[:, t]
            candidate = token_level_rewards[:, t] + gamma * running
            returns[:, t] = candidate * m
            running = m * candidate + (1 - m) * running
        adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns


def compute_remax_outcome_advantage(
    token_level_rewards: Tensor,
    reward_baselines: Tensor,
    response_mask: Tensor,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """ReMax (arXiv:2310.10505): return-to-go (undiscounted) minus the greedy-rollout
    reward ``reward_baselines`` (shape ``(bs,)``) on every valid token."""
    with torch.no_grad():
        masked = token_level_rewards * response_mask
        returns = torch.flip(torch.cumsum(torch.flip(masked, dims=[-1]), dim=-1), dims=[-1])
        adv = returns - reward_baselines.unsqueeze(-1) * response_mask
    return adv, returns


def compute_gpg_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """GPG: ``alpha * (r - mean_g) / f_norm`` where ``alpha = bs / #nonzero scores``
    (the ``alpha`` argument is overridden, as upstream); singleton groups use mean 0."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        bsz = scores.shape[0]
        alpha = bsz / torch.count_nonzero(scores).clamp(min=1)
        out = torch.empty_like(scores)
        for rows in _members(index).values():
            mean, _ = _group_mean_std(scores, rows)
            out[rows] = alpha * (scores[rows] - mean) / f_norm
        adv = out.unsqueeze(-1) * response_mask
    return adv, adv
