"""Policy-gradient losses.

The functions here are plain; :mod:`verl.trainer.ppo.core_algos` owns the
registry and registers them under their loss-mode names.

Every registered loss has the signature::

    fn(old_log_prob, log_prob, advantages, response_mask,
       loss_agg_mode="token-mean", config=None, rollout_is_weights=None)
        -> (pg_loss: scalar tensor, metrics: dict[str, float])

``config`` is the actor config (dataclass, DictConfig or dict).  Fields read:
``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``,
``policy_loss.*`` (mode-specific knobs) and ``global_batch_info`` - a dict of
``agg_loss`` keyword arguments (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, ``loss_scale_factor``) that the actor fills per
mini-batch so the loss does not depend on the micro-batch / DP split.
``rollout_is_weights`` (same shape as the loss matrix) multiplies the
per-token loss for rollout/training mismatch correction.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import Tensor

from verl.trainer.ppo.loss_agg import agg_loss
from verl.utils.py_functional import config_get
from verl.utils.torch_functional import masked_mean

__all__ = [
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_cispo",
    "compute_policy_loss_dro",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_reinforce",
]

# ----------------------------------------------------------------------------- config helpers


def _clip_bounds(config) -> tuple[float, float]:
    eps = config_get(config, "clip_ratio", 0.2)
    low = config_get(config, "clip_ratio_low")
    high = config_get(config, "clip_ratio_high")
    return (eps if low is None else low), (eps if high is None else high)


def _batch_info(config) -> dict:
    return dict(config_get(config, "global_batch_info", None) or {})


def _pl_field(config, key: str, default):
    value = config_get(config_get(config, "policy_loss"), key)
    return default if value is None else value


def _require(config, mode: str):
    if config is None:
        raise ValueError(f"policy loss {mode!r} needs the actor config (clip ratios, global_batch_info)")


def _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights):
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **_batch_info(config))


def _log_ratio(log_prob, old_log_prob, clamp: bool = True):
    # clamp keeps exp() finite when the policies drift far apart
    diff = log_prob - old_log_prob
    return torch.clamp(diff, min=-20.0, max=20.0) if clamp else diff


def _metrics(**values) -> dict[str, float]:
    return {f"actor/{k}": float(v.detach().item() if torch.is_tensor(v) else v) for k, v in values.items()}


def _ppo_clip_losses(ratio, advantages, low, high, clip_ratio_c, response_mask):
    """Token losses of (dual-)clip PPO and the two clip fractions.

    Standard clip: ``max(-A*r, -A*clip(r, 1-low, 1+high))``.  Dual clip (arXiv:1912.09729):
    for ``A < 0`` the loss is additionally capped at ``-A*c`` so a huge ratio on a
    bad action cannot blow up the update.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    ppo = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    cap = -advantages * clip_ratio_c
    negative = advantages < 0
    clipfrac_lower = masked_mean(((ppo > cap) & negative).float(), response_mask)
    losses = torch.where(negative, torch.minimum(ppo, cap), ppo)
    return losses, clipfrac, clipfrac_lower


def _check_dual_clip(c):
    assert c > 1.0, (
        f"The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0, but get the value: {c}."
    )


# ----------------------------------------------------------------------------- losses


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cliprange: Optional[float] = None,
    cliprange_low: Optional[float] = None,
    cliprange_high: Optional[float] = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Deprecated explicit-argument PPO loss; returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``.

    Use :func:`compute_policy_loss_vanilla` (via ``get_policy_loss_fn("vanilla")``) instead.
    """
    warnings.warn(
        "compute_policy_loss is deprecated; use verl.trainer.ppo.core_algos.compute_policy_loss_vanilla",
        DeprecationWarning,
        stacklevel=2,
    )
    _check_dual_clip(clip_ratio_c)
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    losses, clipfrac, clipfrac_lower = _ppo_clip_losses(
        torch.exp(log_ratio), advantages, low, high, clip_ratio_c, response_mask
    )
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode)
    return pg_loss, clipfrac, ppo_kl, clipfrac_lower


def compute_policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Any]]:
    """PPO clipped surrogate (arXiv:1707.06347) with asymmetric clip (``clip_ratio_low`` /
    ``clip_ratio_high``, defaulting to ``clip_ratio``) and dual clip ``clip_ratio_c`` (default 3).

    Metrics: ``actor/pg_clipfrac``, ``actor/ppo_kl`` (mean of old - new log-prob),
    ``actor/pg_clipfrac_lower`` (share of tokens capped by the dual clip).
    """
    _require(config, "vanilla")
    low, high = _clip_bounds(config)
    clip_ratio_c = config_get(config, "clip_ratio_c", 3.0)
    _check_dual_clip(clip_ratio_c)

    log_ratio = _log_ratio(log_prob, old_log_prob)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    losses, clipfrac, clipfrac_lower = _ppo_clip_losses(
        torch.exp(log_ratio), advantages, low, high, clip_ratio_c, response_mask
    )
    pg_loss = _aggregate(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(pg_clipfrac=clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=clipfrac_lower)


def _dppo_truncated_ratio(log_prob, old_log_prob, config):
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    # truncated importance weight instead of dual clip; large default limits truncation bias
    cap = config_get(config, "clip_ratio_c", 20.0)
    return log_ratio, ratio, torch.clamp(ratio, max=cap).detach(), cap


def _dppo_finish(valid, log_ratio, ratio, truncated, cap, log_prob, advantages, response_mask, mode, cfg, isw):
    valid = valid.detach().float()
    losses = -advantages * truncated * log_prob * valid
    pg_loss = _aggregate(losses, response_mask, mode, cfg, isw)
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean(1.0 - valid, response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=masked_mean((ratio > cap).float() * valid, response_mask),
    )


def compute_policy_loss_dppo_tv(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """DPPO-Binary-TV (arXiv:2602.04879): a token is trusted while ``p - p_old`` stays
    within ``clip_ratio_high`` (A > 0) / above ``-clip_ratio_low`` (A <= 0)."""
    _require(config, "dppo_tv")
    low, high = _clip_bounds(config)
    log_ratio, ratio, truncated, cap = _dppo_truncated_ratio(log_prob, old_log_prob, config)
    delta = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, delta <= high, delta >= -low)
    return _dppo_finish(
        valid, log_ratio, ratio, truncated, cap, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )


def compute_policy_loss_dppo_kl(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """DPPO-Binary-KL (arXiv:2602.04879): trust region on the Bernoulli KL between the
    old and new probability of the sampled token."""
    _require(config, "dppo_kl")
    low, high = _clip_bounds(config)
    log_ratio, ratio, truncated, cap = _dppo_truncated_ratio(log_prob, old_log_prob, config)
    p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
    bern_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(advantages > 0, (bern_kl <= high) | (p <= p_old), (bern_kl <= low) | (p >= p_old))
    return _dppo_finish(
        valid, log_ratio, ratio, truncated, cap, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )


def compute_policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Any]]:
    """GSPO (arXiv:2507.18071): clip the *sequence* ratio ``exp(mean_t log r_t)``.

    Token-level form: ``s_t = sg[s] * pi_t / sg[pi_t]`` so the value equals the
    sequence ratio while each token keeps its own gradient path.
    """
    _require(config, "gspo")
    low, high = _clip_bounds(config)
    log_ratio = log_prob - old_log_prob
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (log_ratio * response_mask).sum(dim=-1) / lengths
    token_log_s = seq_log_ratio.detach().unsqueeze(-1) + (log_prob - log_prob.detach())
    s = torch.exp(torch.clamp(token_log_s, max=10.0))
    unclipped = -advantages * s
    clipped = -advantages * torch.clamp(s, 1.0 - low, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)
    pg_loss = _aggregate(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((clipped > unclipped).float(), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=0.0,
    )


def compute_policy_loss_sapo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", config=None,
    rollout_is_weights=None,
):
    """SAPO (arXiv:2511.20347): soft gate ``4/tau * sigmoid(tau*(r-1))`` instead of a hard
    clip, ``tau = policy tau_pos`` for A > 0 else ``tau_neg``.  Always aggregated with
    ``seq-mean-token-mean`` (the ``loss_agg_mode`` argument is ignored, as upstream)."""
    _require(config, "sapo")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    tau_pos = torch.as_tensor(config_get(config, "tau_pos"), dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config_get(config, "tau_neg"), dtype=advantages.dtype, device=advantages.device)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    losses = -gate * advantages
    pg_loss = _aggregate(losses, response_mask, "seq-mean-token-mean", config, rollout_is_weights)
    return pg_loss, _metrics(pg_clipfrac=0.0, ppo_kl=masked_mean(-log_ratio, response_mask), pg_clipfrac_lower=0.0)


def compute_policy_loss_gpg(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """GPG: plain policy gradient ``-log_prob * A`` (no ratio, no clip); no metrics."""
    _require(config, "gpg")
    pg_loss = _aggregate(-log_prob * advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, {}


def compute_policy_loss_clip_cov(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """Clip-Cov (arXiv:2505.22617): on top of PPO clip, drop the gradient of a random
    ``clip_cov_ratio`` share of (unclipped) tokens whose centred covariance
    ``(A - mean A) * (logp - mean logp)`` lies in ``(clip_cov_lb, clip_cov_ub)``."""
    _require(config, "clip_cov")
    ratio_frac = _pl_field(config, "clip_cov_ratio", 0.0002)
    cov_lb = _pl_field(config, "clip_cov_lb", 1.0)
    cov_ub = _pl_field(config, "clip_cov_ub", 5.0)
    assert ratio_frac > 0, "clip_ratio should be larger than 0."
    low, high = _clip_bounds(config)

    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    valid = response_mask > 0
    cov = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask)
    )
    # candidates: valid, not already clipped by PPO, covariance inside the band
    candidates = valid & ~(clipped > unclipped) & (cov > cov_lb) & (cov < cov_ub)
    positions = torch.nonzero(candidates)
    budget = max(int(ratio_frac * response_mask.sum().item()), 1)
    keep = torch.ones_like(advantages)
    if len(positions) > 0:
        chosen = positions[torch.randperm(len(positions), device=positions.device)[:budget]]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    losses = torch.maximum(unclipped, clipped) * keep
    pg_loss = _aggregate(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((keep == 0).float(), response_mask), ppo_kl=masked_mean(-log_ratio, response_mask)
    )


def compute_policy_loss_kl_cov(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """KL-Cov (arXiv:2505.22617): unclipped ``-A*r``; the top ``kl_cov_ratio`` share of
    valid tokens by covariance get an extra ``ppo_kl_coef * |log r|`` penalty.
    Metric ``actor/ppo_kl`` is the mean *absolute* log-ratio."""
    _require(config, "kl_cov")
    ratio_frac = _pl_field(config, "kl_cov_ratio", 0.0002)
    coef = _pl_field(config, "ppo_kl_coef", 1.0)
    assert ratio_frac > 0, "kl_cov_ratio should be larger than 0."

    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    base = -advantages * ratio
    losses = base.clone()
    flat_valid = torch.nonzero((response_mask > 0).reshape(-1), as_tuple=True)[0]
    if flat_valid.numel() > 0:
        adv_v = advantages.detach().reshape(-1)[flat_valid].float()
        logp_v = log_prob.detach().reshape(-1)[flat_valid].float()
        cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
        k = max(1, int(flat_valid.numel() * ratio_frac))
        picked = flat_valid[torch.topk(cov, k).indices]
        rows, cols = picked // advantages.shape[1], picked % advantages.shape[1]
        losses[rows, cols] = base[rows, cols] + coef * abs_kl[rows, cols]
    pg_loss = _aggregate(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(ppo_kl=masked_mean(abs_kl, response_mask))


def compute_policy_loss_geo_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """GMPO (arXiv:2507.20673): per-sequence loss ``-A_seq * exp(mean_t clip(log r_t))``,
    averaged over sequences (``loss_agg_mode`` is ignored).

    Token log-ratios are clipped to ``[-clip_ratio_low, clip_ratio_high]`` pessimistically
    w.r.t. the sign of the advantage; ``A_seq`` is the mean token advantage.
    IS weights are folded in as their per-sequence geometric mean.
    """
    _require(config, "geo_mean")
    low, high = _clip_bounds(config)
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio, response_mask)
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    n_tok = response_mask.sum(dim=-1) + 1e-8
    seq_ratio = torch.exp((pessimistic * response_mask).sum(dim=-1) / n_tok)
    seq_adv = (advantages * response_mask).sum(dim=-1) / n_tok
    per_seq = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        per_seq = per_seq * torch.exp((torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / n_tok)
    pg_loss = per_seq.mean()
    was_clipped = log_ratio != bounded
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((was_clipped & (advantages > 0)).float(), response_mask),
        ppo_kl=ppo_kl,
        pg_clipfrac_lower=masked_mean((was_clipped & (advantages < 0)).float(), response_mask),
    )


def compute_policy_loss_dro(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """DRO: ``-(A * log_prob - beta/2 * (log r)^2)`` with ``beta = policy_loss.dro_beta > 0``."""
    _require(config, "dro")
    beta = config_get(config_get(config, "policy_loss"), "dro_beta")
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    log_ratio = log_prob - old_log_prob
    losses = -(advantages * log_prob - 0.5 * beta * log_ratio.square())
    pg_loss = _aggregate(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(ppo_kl=masked_mean(-log_ratio, response_mask))


def compute_policy_loss_cispo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """CISPO (arXiv:2506.13585): ``-sg[clip(r)] * A * log_prob`` - the clipped ratio is a
    detached weight, so every token keeps a gradient through ``log_prob``."""
    _require(config, "cispo")
    low, high = _clip_bounds(config)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses = -weight.detach() * advantages * log_prob
    pg_loss = _aggregate(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((ratio != weight).float(), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=0.0,
    )


def compute_policy_loss_reinforce(
    rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum", config=None,
    rollout_is_weights=None,
):
    """REINFORCE ``-A * log_prob`` (optionally IS-weighted); ``actor/ppo_kl`` is measured
    against the rollout policy.  Not registered: used by rollout-correction bypass mode."""
    _require(config, "reinforce")
    pg_loss = _aggregate(-advantages * log_prob, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(ppo_kl=masked_mean(rollout_log_prob - log_prob, response_mask))
