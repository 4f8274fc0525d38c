"""KL estimators, KL-coefficient controllers and the in-reward KL penalty.

Estimators follow http://joschu.net/blog/kl-approx.html, with ``x = logprob - ref_logprob``:

* ``kl`` / ``k1``        : x
* ``abs``                : |x|
* ``mse`` / ``k2``       : x^2 / 2
* ``low_var_kl`` / ``k3``: exp(-x) + x - 1  (clamped to [-10, 10])

Appending ``+`` (e.g. ``"low_var_kl+"``) keeps the forward value of the chosen
estimator but routes the gradient through k2, whose gradient is an unbiased
estimate of the true KL gradient (k1/k3 are unbiased in value only).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl.utils.py_functional import config_get
from verl.utils.registry import Registry
from verl.utils.torch_functional import masked_mean

__all__ = [
    "KL_PENALTY_TYPES",
    "KL_ESTIMATOR_REGISTRY",
    "register_kl_estimator",
    "kl_penalty",
    "kl_penalty_forward",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "compute_rewards",
    "apply_kl_penalty",
]

# KL estimators by canonical name; upstream's spellings are aliases. "full" (exact KL over the whole
# vocabulary) is upstream's too, but it needs full-vocabulary logits, so it is not registered: validation
# refuses it by name instead of the run failing later.
KL_ESTIMATOR_REGISTRY = Registry(
    "KL estimator",
    aliases={"kl": "k1", "mse": "k2", "low_var_kl": "k3"},
)


def register_kl_estimator(name: str, fn=None, *, override: bool = False):
    """Register ``fn(logprob, ref_logprob) -> per-token KL`` under ``name`` (decorator-friendly)."""
    return KL_ESTIMATOR_REGISTRY.register(name, fn, override=override)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # r = ref/pi; clamp the exponent so exp() cannot overflow, then clamp the
    # estimate itself because k3 can still be huge for very unlikely tokens.
    neg = torch.clamp(-log_ratio, min=-20.0, max=20.0)
    est = torch.exp(neg) - neg - 1.0
    return torch.clamp(est, min=-10.0, max=10.0).contiguous()


register_kl_estimator("k1", lambda logprob, ref: logprob - ref)
register_kl_estimator("abs", lambda logprob, ref: (logprob - ref).abs())
register_kl_estimator("k2", lambda logprob, ref: 0.5 * (logprob - ref).square())
register_kl_estimator("k3", lambda logprob, ref: _k3(logprob - ref))


def kl_type_names() -> tuple[str, ...]:
    """Every accepted spelling (registered names and their aliases)."""
    return tuple(sorted(set(KL_ESTIMATOR_REGISTRY) | set(KL_ESTIMATOR_REGISTRY.aliases)))


def __getattr__(name: str):
    # KL_PENALTY_TYPES is computed on access so estimators registered later are listed too.
    if name == "KL_PENALTY_TYPES":
        return kl_type_names()
    raise AttributeError(name)


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Evaluate one KL estimator (no ``+`` suffix handling)."""
    if not KL_ESTIMATOR_REGISTRY.known(kl_penalty):
        raise ValueError(
            f"Unknown kl_penalty type {kl_penalty!r}. Valid choices: {list(kl_type_names())} "
            "(optionally with a '+' suffix for a k2 straight-through gradient, e.g. 'low_var_kl+')."
        )
    return KL_ESTIMATOR_REGISTRY.get_or_raise(kl_penalty)(logprob, ref_logprob)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    ``kl_penalty`` may end with ``+``: the returned tensor then has the value of
    the base estimator but the gradient of k2 (straight-through trick).
    """
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    value = kl_penalty_forward(logprob, ref_logprob, base)
    if not straight_through or KL_ESTIMATOR_REGISTRY.canonical(base) == "k2":
        return value
    surrogate = 0.5 * (logprob - ref_logprob).square()
    # value of `value`, gradient of `surrogate`
    return value.detach() + (surrogate - surrogate.detach())


# apply_kl_penalty's ``kl_penalty`` argument shadows the function name (upstream signature).
_estimate_kl = kl_penalty


class AdaptiveKLController:
    """Proportional KL-coefficient controller (Ziegler et al., 2019, arXiv:1909.08593).

    The coefficient moves by ``clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon``
    (multiplicatively) after each update.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        err = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + err * n_steps / self.horizon


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


def get_kl_controller(kl_ctrl: Any):
    """Build a KL controller from a config with ``type`` ("fixed" | "adaptive"), ``kl_coef``,
    and for adaptive also ``target_kl`` and ``horizon``."""
    kind = config_get(kl_ctrl, "type")
    if kind == "fixed":
        return FixedKLController(kl_coef=config_get(kl_ctrl, "kl_coef"))
    if kind == "adaptive":
        horizon = config_get(kl_ctrl, "horizon")
        assert horizon > 0, f"horizon must be larger than 0. Got {horizon}"
        return AdaptiveKLController(
            init_kl_coef=config_get(kl_ctrl, "kl_coef"), target_kl=config_get(kl_ctrl, "target_kl"), horizon=horizon
        )
    raise NotImplementedError(f"Unknown kl_ctrl.type {kind!r}. Valid choices: ['fixed', 'adaptive']")


def compute_rewards(token_level_scores, old_log_prob, ref_log_prob, kl_ratio):
    """Token-level scores minus ``kl_ratio`` times the k1 estimate (old - ref)."""
    return token_level_scores - kl_ratio * (old_log_prob - ref_log_prob)


def apply_kl_penalty(data, kl_ctrl, kl_penalty: str = "kl"):
    """Subtract ``beta * KL`` from the token-level scores (in-reward KL).

    ``data`` needs ``.batch`` with ``response_mask``, ``token_level_scores``,
    ``old_log_probs`` and ``ref_log_prob``.  Writes ``token_level_rewards``,
    updates the controller with the batch's mean per-sequence KL, and returns
    ``(data, metrics)`` with ``actor/reward_kl_penalty`` and
    ``actor/reward_kl_penalty_coeff``.
    """
    batch = data.batch
    mask = batch["response_mask"]
    scores = batch["token_level_scores"]
    kld = _estimate_kl(batch["old_log_probs"], batch["ref_log_prob"], kl_penalty) * mask
    beta = kl_ctrl.value
    batch["token_level_rewards"] = scores - beta * kld

    # mean over each sequence's tokens, then over sequences
    current_kl = masked_mean(kld, mask, axis=-1).mean(dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return data, metrics
