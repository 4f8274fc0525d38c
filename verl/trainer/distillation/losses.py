"""The distillation term of the actor's loss, with upstream verl 0.9.1's keys and semantics.

Per response token the student's log-prob ``log pi(a)`` and the teacher's ``log q(a)`` of the sampled token
``a`` give a single-sample estimate of the reverse KL(pi || q) through one of the KL estimators
(``distillation_loss.loss_mode``: k1/kl, abs, k2/mse, k3/low_var_kl, read from the live KL-estimator registry,
so an estimator registered with ``register_kl_estimator`` is a loss mode too). That estimate is used

* as a supervised loss (``use_policy_gradient=false``): aggregated with the actor's ``loss_agg_mode`` and
  back-propagated directly (k3's gradient depends on the teacher; k1's does not, so k1 is refused there), or
* as a reward (``use_policy_gradient=true``): ``-estimate`` (detached) is the per-token advantage of a
  clipped policy-gradient loss with the distillation section's own clip ratios.

``use_task_rewards=true`` adds ``distillation_loss_coef`` times that term to the RL loss (policy loss, entropy
and KL terms); ``false`` trains on the distillation term alone (coefficient 1, as upstream).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos

__all__ = ["distillation_loss", "distillation_loss_config", "is_distillation_enabled", "teacher_model_config"]

# The one teacher entry upstream's YAML declares; other entries select its multi-teacher routing (refused here).
TEACHER_ENTRY = "teacher_model"


def is_distillation_enabled(config) -> bool:
    """``distillation.enabled`` of the distillation section (None: no section, so off)."""
    if config is None:
        return False
    return bool(config.get("enabled", False))


def teacher_model_config(config):
    """The single teacher's section (``distillation.teacher_models.teacher_model``)."""
    return config.teacher_models[TEACHER_ENTRY]


def distillation_loss_config(config):
    return config.distillation_loss


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values[mask.bool()]


def distillation_loss(loss_cfg, log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
                      response_mask: torch.Tensor, loss_agg_mode: str, global_batch_info: dict,
                      old_log_prob: Optional[torch.Tensor] = None, policy_loss_config: Any = None,
                      rollout_is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The aggregated distillation term of one micro-batch and its metrics (upstream's names, ``actor/``-prefixed
    as the trainer logs them).

    ``log_prob`` / ``teacher_log_prob`` / ``response_mask`` are (B, R); ``policy_loss_config`` is what the
    policy-gradient form hands the policy loss (the actor config with the distillation clip ratios)."""
    mode = str(loss_cfg.loss_mode)
    per_token = core_algos.kl_penalty(log_prob, teacher_log_prob.to(log_prob.dtype), kl_penalty=mode)
    valid = _masked(per_token.detach(), response_mask)
    metrics: dict[str, float] = {}
    if valid.numel():
        # k1 can be negative, so the mean absolute value is what tracks the distance (upstream's abs_loss)
        metrics["actor/distillation/abs_loss"] = valid.abs().mean().item()
        metrics["actor/distillation/loss_min"] = valid.min().item()
        metrics["actor/distillation/loss_max"] = valid.max().item()
    clamp = loss_cfg.get("loss_max_clamp")
    if clamp is not None:
        # symmetric: k1 is signed
        per_token = per_token.clamp(min=-float(clamp), max=float(clamp))
    if bool(loss_cfg.use_policy_gradient):
        policy_loss_fn = core_algos.get_policy_loss_fn(str(loss_cfg.policy_loss_mode))
        loss, pg_metrics = policy_loss_fn(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=-per_token.detach(),
            response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=policy_loss_config,
            rollout_is_weights=rollout_is_weights)
        for k, v in pg_metrics.items():
            name = k[len("actor/"):] if k.startswith("actor/") else k
            metrics[f"actor/distillation/{name}"] = float(v)
    else:
        loss = core_algos.agg_loss(per_token, response_mask, loss_agg_mode, **global_batch_info)
    return loss, metrics


def policy_loss_config_for(actor_cfg, loss_cfg, global_batch_info: dict):
    """The actor section with the distillation section's clip ratios, as the policy-gradient form's config."""
    from verl.workers.config import actor_config_from_omegaconf

    data = OmegaConf.to_container(actor_cfg, resolve=True) if OmegaConf.is_config(actor_cfg) else dict(actor_cfg)
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        data[key] = loss_cfg.get(key)
    return actor_config_from_omegaconf(data, global_batch_info)
