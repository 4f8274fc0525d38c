"""Core PPO-family algorithms: the public entry point.

This module owns the two registries (advantage estimators, policy losses) and
re-exports the implementations, which live in:

* :mod:`verl.trainer.ppo.advantage`   - advantage estimators
* :mod:`verl.trainer.ppo.policy_loss` - policy losses
* :mod:`verl.trainer.ppo.loss_agg`    - ``agg_loss``, entropy and value losses
* :mod:`verl.trainer.ppo.kl`          - KL estimators, controllers, in-reward KL
* :mod:`verl.trainer.ppo.pf_ppo`      - PF-PPO batch resampling
* :mod:`verl.trainer.ppo.token_baseline` - the optimal token baseline estimators

Both registries are :class:`verl.utils.registry.Registry` instances (dict
subclasses, so code reading ``core_algos.ADV_ESTIMATOR_REGISTRY[...]`` keeps
working); config validation asks them, so whatever is registered before
``main_ppo`` runs is accepted. As with upstream's module-level dicts, a user may
clear them or rebind the module attribute to a dict of their own: the functions
here (and validation) read the attribute at call time, so later registrations go
into, and lookups read, whatever dict it names then.
"""

from enum import Enum
from typing import Any, Callable

import torch

from verl.utils.registry import Registry, as_registry
from verl.trainer.ppo.advantage import (
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from verl.trainer.ppo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from verl.trainer.ppo.loss_agg import AGG_LOSS_MODES, agg_loss, compute_entropy_loss, compute_value_loss
from verl.trainer.ppo.pf_ppo import compute_pf_ppo_reweight_data
from verl.trainer.ppo.token_baseline import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from verl.trainer.ppo.rollout_corr import compute_policy_loss_bypass_mode
from verl.trainer.ppo.policy_loss import (
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_reinforce,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)

# Upstream advertises only these three in __all__; everything else is importable by name.
__all__ = ["register_adv_est", "get_adv_estimator_fn", "AdvantageEstimator"]

# ----------------------------------------------------------------------------- policy-loss registry

# (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
#   -> (scalar loss, metrics dict)
PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]

_POLICY_LOSS_KIND = Registry("policy loss", config_key="actor_rollout_ref.actor.policy_loss.loss_mode")
POLICY_LOSS_REGISTRY = _POLICY_LOSS_KIND


def policy_loss_registry():
    """The policy-loss registry the module attribute names now (a user may have rebound it)."""
    return as_registry(POLICY_LOSS_REGISTRY, like=_POLICY_LOSS_KIND)


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``.

    Like every registry here, binding a taken name to a different function raises unless ``override=True``.
    """
    return policy_loss_registry().register(name, override=override)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """Look up a policy loss; an unknown name raises ``ValueError`` listing the registered modes."""
    return policy_loss_registry().get_or_raise(name)


# ----------------------------------------------------------------------------- advantage registry


class AdvantageEstimator(str, Enum):
    """Names of the built-in estimators (a str Enum: members compare equal to their strings).

    Custom estimators need no member here; register them by string with
    :func:`register_adv_est`.
    """

    # critic-based
    GAE = "gae"
    # group-relative baselines
    GRPO = "grpo"
    GRPO_VECTORIZED = "grpo_vectorized"
    GRPO_PASSK = "grpo_passk"
    GDPO = "gdpo"
    RLOO = "rloo"
    RLOO_VECTORIZED = "rloo_vectorized"
    OPO = "opo"
    GPG = "gpg"
    # REINFORCE-style
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    # per-token baselines; they read the actor's sum_pi_squared (actor.calculate_sum_pi_squared)
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"


_ADV_ESTIMATOR_KIND = Registry("advantage estimator", config_key="algorithm.adv_estimator")
ADV_ESTIMATOR_REGISTRY = _ADV_ESTIMATOR_KIND


def adv_estimator_registry():
    """The estimator registry the module attribute names now (a user may have rebound it)."""
    return as_registry(ADV_ESTIMATOR_REGISTRY, like=_ADV_ESTIMATOR_KIND)


def _estimator_name(name_or_enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum: str | AdvantageEstimator, *, override: bool = False) -> Any:
    """Decorator registering an advantage estimator under a string or enum name.

    Registering the same function twice is a no-op; binding a taken name to a *different* function raises
    (unless ``override=True``), so plugins cannot silently replace each other.
    """
    return adv_estimator_registry().register(_estimator_name(name_or_enum), override=override)


def get_adv_estimator_fn(name_or_enum):
    """Look up an estimator; an unknown name raises ``ValueError`` listing the registered ones."""
    return adv_estimator_registry().get_or_raise(_estimator_name(name_or_enum))


# ----------------------------------------------------------------------------- built-in registrations

_E = AdvantageEstimator
for _name, _fn in (
    (_E.GAE, compute_gae_advantage_return),
    (_E.GRPO, compute_grpo_outcome_advantage),
    (_E.GRPO_VECTORIZED, compute_grpo_vectorized_outcome_advantage),
    (_E.GDPO, compute_gdpo_outcome_advantage),
    (_E.GRPO_PASSK, compute_grpo_passk_outcome_advantage),
    (_E.REINFORCE_PLUS_PLUS_BASELINE, compute_reinforce_plus_plus_baseline_outcome_advantage),
    (_E.RLOO, compute_rloo_outcome_advantage),
    (_E.OPO, compute_opo_outcome_advantage),
    (_E.REINFORCE_PLUS_PLUS, compute_reinforce_plus_plus_outcome_advantage),
    (_E.REMAX, compute_remax_outcome_advantage),
    (_E.GPG, compute_gpg_outcome_advantage),
    (_E.RLOO_VECTORIZED, compute_rloo_vectorized_outcome_advantage),
    (_E.OPTIMAL_TOKEN_BASELINE, compute_optimal_token_baseline_advantage),
    (_E.TIR_OPTIMAL_TOKEN_BASELINE, compute_multi_turn_optimal_token_baseline_advantage),
):
    register_adv_est(_name)(_fn)

for _name, _fn in (
    ("vanilla", compute_policy_loss_vanilla),
    ("dppo_tv", compute_policy_loss_dppo_tv),
    ("dppo_kl", compute_policy_loss_dppo_kl),
    ("gspo", compute_policy_loss_gspo),
    ("sapo", compute_policy_loss_sapo),
    ("gpg", compute_policy_loss_gpg),
    ("clip_cov", compute_policy_loss_clip_cov),
    ("kl_cov", compute_policy_loss_kl_cov),
    ("geo_mean", compute_policy_loss_geo_mean),
    ("dro", compute_policy_loss_dro),
    ("cispo", compute_policy_loss_cispo),
    ("bypass_mode", compute_policy_loss_bypass_mode),  # set by algorithm.rollout_correction.bypass_mode
):
    register_policy_loss(_name)(_fn)

del _E, _name, _fn

# referenced so linters keep the pure re-exports
_REEXPORTED = (
    AGG_LOSS_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_entropy_loss,
    compute_pf_ppo_reweight_data,
    compute_policy_loss,
    compute_policy_loss_reinforce,
    compute_rewards,
    compute_value_loss,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
