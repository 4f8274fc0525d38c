"""Optimal token baseline (OTB): a per-token, per-group baseline weighted by a path-variance proxy.

Upstream verl's ``optimal_token_baseline`` / ``tir_optimal_token_baseline`` estimators. GRPO subtracts one
scalar (the group's mean score) from every token of a response. OTB subtracts, at response position ``t``, the
group's return-to-go at ``t`` averaged with weights ``W_t``: the variance a trajectory's score function has built
up by ``t``. For a softmax policy the squared norm of the score (gradient of log pi(y_j) w.r.t. the logits) at
step ``j`` is ``1 - 2 pi(y_j) + sum_v pi(v)^2``; ``W_t`` sums it over ``j <= t``. Trajectories that reached ``t``
through uncertain choices (large ``W_t``) carry the baseline there: that is where a baseline removes the most
gradient variance.

``sum_v pi(v)^2`` needs the full distribution, so the actor computes it in its old-log-prob pass
(``actor.calculate_sum_pi_squared``; the batch field ``sum_pi_squared``). With rollout importance weights
(``rollout_is_weights``) each step's term is scaled by the weight squared, as upstream does.

The tool-integrated variant (``tir_``) first moves each response's valid tokens to the front (multi-turn
responses have masked tool-output spans in between), so step ``t`` means the ``t``-th generated token, and by
default gives the longest trajectory of a group no baseline past the second longest's end (no other trajectory
is there to form one).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["compute_optimal_token_baseline_advantage", "compute_multi_turn_optimal_token_baseline_advantage",
           "path_variance_per_token"]


def path_variance_per_token(old_log_probs: Tensor, sum_pi_squared: Tensor,
                            rollout_is_weights: Optional[Tensor] = None) -> Tensor:
    """``|score_t|^2 = 1 - 2 pi(y_t) + sum_v pi(v)^2`` per token (times the IS weight squared, if given)."""
    w = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.pow(2)
    return w


def _returns_to_go(rewards: Tensor, mask: Tensor) -> Tensor:
    masked = rewards * mask
    return masked.sum(-1, keepdim=True) - masked.cumsum(-1) + masked


def _group_rows(index) -> dict[Any, list[int]]:
    from verl.trainer.ppo.advantage import _members  # the estimators' one notion of a group

    return _members(index)


def _baselines(returns: Tensor, weights: Tensor, mask: Tensor, index, epsilon: float,
               zero_tail: bool) -> Tensor:
    """``B_t = sum_i G_it W_it / sum_i W_it`` over the valid rows of each group; zero for a singleton group."""
    baselines = torch.zeros_like(returns)
    lengths = mask.sum(-1)
    for rows in _group_rows(index).values():
        rows = [r for r in rows if lengths[r] > 0]
        if len(rows) < 2:  # no other trajectory to compare with: the return is the advantage
            continue
        sel = torch.tensor(rows, device=returns.device)
        w = weights[sel] * mask[sel]
        b = (returns[sel] * w).sum(0) / (w.sum(0) + epsilon)
        baselines[sel] = b.to(baselines.dtype).expand(len(rows), -1)
        if zero_tail:
            group_lengths = lengths[sel]
            top2 = torch.topk(group_lengths, 2).values
            longest = (group_lengths == top2[0]).nonzero(as_tuple=True)[0]
            if longest.numel() == 1 and top2[0] > top2[1]:  # one trajectory runs on alone
                baselines[rows[int(longest)], int(top2[1]):] = 0.0
    return baselines


def _check(sum_pi_squared, old_log_probs, token_level_rewards, name: str) -> None:
    if sum_pi_squared is None or old_log_probs is None:
        raise ValueError(f"algorithm.adv_estimator={name} needs the batch fields sum_pi_squared and old_log_probs: "
                         "set actor_rollout_ref.actor.calculate_sum_pi_squared=true (the actor's old-log-prob pass "
                         "computes sum_pi_squared) and do not use rollout_correction.bypass_mode")
    if sum_pi_squared.shape != token_level_rewards.shape or old_log_probs.shape != token_level_rewards.shape:
        raise ValueError(f"{name}: sum_pi_squared {tuple(sum_pi_squared.shape)} and old_log_probs "
                         f"{tuple(old_log_probs.shape)} must have the rewards' shape {tuple(token_level_rewards.shape)}")


def compute_optimal_token_baseline_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index, old_log_probs: Tensor = None,
    sum_pi_squared: Tensor = None, rollout_is_weights: Optional[Tensor] = None, handle_zero_tail: bool = False,
    epsilon: float = 1e-8, config: Any = None, **_: Any,
) -> tuple[Tensor, Tensor]:
    """Advantages ``G_t - B_t`` (masked) and returns ``G_t`` (reward to go), both ``(bs, response_length)``."""
    _check(sum_pi_squared, old_log_probs, token_level_rewards, "optimal_token_baseline")
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = _returns_to_go(token_level_rewards, mask)
        w = (path_variance_per_token(old_log_probs, sum_pi_squared, rollout_is_weights) * mask).cumsum(-1)
        advantages = (returns - _baselines(returns, w, mask, index, epsilon, handle_zero_tail)) * mask
    return advantages, returns


def _compact(values: Tensor, mask: Tensor, width: int) -> Tensor:
    """Each row's values at its mask's positions, moved to the front (zeros after)."""
    out = values.new_zeros(values.shape[0], width)
    for row in range(values.shape[0]):
        picked = values[row, mask[row]]
        out[row, : picked.numel()] = picked
    return out


def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index, old_log_probs: Tensor = None,
    sum_pi_squared: Tensor = None, rollout_is_weights: Optional[Tensor] = None, handle_zero_tail: bool = True,
    epsilon: float = 1e-8, config: Any = None, **_: Any,
) -> tuple[Tensor, Tensor]:
    """OTB over generated-token positions (tool spans skipped); see the module docstring."""
    _check(sum_pi_squared, old_log_probs, token_level_rewards, "tir_optimal_token_baseline")
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        valid = response_mask.bool()
        returns = _returns_to_go(token_level_rewards, mask)
        w = (path_variance_per_token(old_log_probs, sum_pi_squared, rollout_is_weights) * mask).cumsum(-1)
        width = int(valid.sum(-1).max().item()) if valid.numel() else 0
        c_returns, c_w = _compact(returns, valid, width), _compact(w, valid, width)
        c_mask = (torch.arange(width, device=mask.device) < valid.sum(-1, keepdim=True)).to(mask.dtype)
        c_adv = c_returns - _baselines(c_returns, c_w, c_mask, index, epsilon, handle_zero_tail)
        advantages = torch.zeros_like(returns)
        for row in range(advantages.shape[0]):
            n = int(valid[row].sum())
            advantages[row, valid[row]] = c_adv[row, :n]
    return advantages * mask, returns
