"""SAPO's temperatures (actor_rollout_ref.actor.tau_pos / tau_neg, also spelled policy_loss.tau_pos as in
upstream's SAPO script) and DRO's actor_rollout_ref.actor.policy_loss.dro_beta reach the loss the actor trains
with (issue 27). Each test composes the trainer config with the key set, builds the actor's PolicyLoss from
the composed actor section and checks the loss against a value worked out here by hand."""

from __future__ import annotations

import warnings

import pytest
import torch

from verl.trainer.config import ConfigValidationError, compose_config
from verl.workers.actor.ppo_actor import PolicyLoss

B, P, R = 2, 2, 3


def _actor(*overrides, validate=True):
    # the demo config validates as it is, so a refusal here is the key's own
    return compose_config("demo", list(overrides), validate=validate).actor_rollout_ref.actor


def _batch():
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]])
    new = old + torch.tensor([[0.3, -0.4, 0.1], [-0.2, 0.5, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    full = torch.zeros(B, P + R)
    full[:, P - 1: P - 1 + R] = new
    mb = {"responses": torch.zeros(B, R, dtype=torch.long), "response_mask": mask, "old_log_probs": old,
          "advantages": adv,
          "global_batch_info": {"dp_size": 1, "batch_num_tokens": float(mask.sum()), "global_batch_size": float(B)}}
    return {"log_probs": full}, mb, new


def _loss(actor_cfg):
    outputs, mb, _ = _batch()
    return float(PolicyLoss(actor_cfg)(outputs, mb)[0])


def _sapo_expected(tau_pos, tau_neg):
    _, mb, new = _batch()
    ratio = torch.exp(new - mb["old_log_probs"])
    adv, mask = mb["advantages"], mb["response_mask"]
    tau = torch.where(adv > 0, torch.tensor(tau_pos), torch.tensor(tau_neg))
    token = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    return float(((token * mask).sum(-1) / mask.sum(-1)).mean())  # SAPO always aggregates seq-mean-token-mean


def test_sapo_defaults_are_upstreams():
    actor = _actor("actor_rollout_ref.actor.policy_loss.loss_mode=sapo")
    assert (actor.tau_pos, actor.tau_neg) == (1.0, 1.05)
    assert _loss(actor) == pytest.approx(_sapo_expected(1.0, 1.05), rel=1e-6)


def test_sapo_tau_pos_and_tau_neg_change_the_loss():
    actor = _actor("actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_pos=3.0",
                   "actor_rollout_ref.actor.tau_neg=0.5")
    got = _loss(actor)
    assert got == pytest.approx(_sapo_expected(3.0, 0.5), rel=1e-6)
    assert got != pytest.approx(_sapo_expected(1.0, 1.05), rel=1e-3)


def test_upstream_scripts_policy_loss_spelling_sets_the_actor_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actor = _actor("actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
                       "+actor_rollout_ref.actor.policy_loss.tau_pos=2.0",
                       "+actor_rollout_ref.actor.policy_loss.tau_neg=1.5")
    assert (actor.tau_pos, actor.tau_neg) == (2.0, 1.5) and "tau_pos" not in actor.policy_loss
    assert _loss(actor) == pytest.approx(_sapo_expected(2.0, 1.5), rel=1e-6)
    assert any("is read as `actor_rollout_ref.actor.tau_pos`" in str(w.message) for w in caught)


def test_sapo_refuses_a_non_positive_temperature():
    with pytest.raises(ConfigValidationError, match=r"actor_rollout_ref.actor.tau_neg` must be > 0"):
        _actor("actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=0")


def _dro_expected(beta):
    _, mb, new = _batch()
    log_ratio = new - mb["old_log_probs"]
    token = -(mb["advantages"] * new - 0.5 * beta * log_ratio.square())
    mask = mb["response_mask"]
    return float((token * mask).sum() / mask.sum())


def test_dro_beta_weights_the_squared_log_ratio():
    small = _loss(_actor("actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                         "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"))
    large = _loss(_actor("actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                         "actor_rollout_ref.actor.policy_loss.dro_beta=5.0"))
    assert small == pytest.approx(_dro_expected(0.1), rel=1e-6)
    assert large == pytest.approx(_dro_expected(5.0), rel=1e-6) and large > small


def test_dro_without_dro_beta_is_refused_naming_it():
    # upstream's default is null, which its DRO loss rejects at the first step; here validation says so
    with pytest.raises(ConfigValidationError, match=r"policy_loss.dro_beta` is None.*positive number"):
        _actor("actor_rollout_ref.actor.policy_loss.loss_mode=dro")
