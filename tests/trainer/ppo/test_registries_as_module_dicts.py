"""core_algos' two registries behave as upstream's module-level dicts (issue 27): users and upstream's own tests
clear ``ADV_ESTIMATOR_REGISTRY`` or rebind it to a dict of their own, then register and look up through the
module's functions, which must use the dict the attribute names at call time."""

from __future__ import annotations

from enum import Enum

import pytest

import verl.trainer.ppo.core_algos as ca
from verl.trainer.config import ConfigValidationError, compose_config


def test_rebound_estimator_dict_is_registered_into_and_read(monkeypatch):
    mine = {"gae": lambda x: x * 2, "vtrace": lambda x: x + 1}
    monkeypatch.setattr(ca, "ADV_ESTIMATOR_REGISTRY", mine)

    @ca.register_adv_est("my_est")
    def my_est():
        return "mine"

    class Names(Enum):
        OTHER = "enum_est"

    ca.register_adv_est(Names.OTHER)(my_est)
    assert mine["my_est"] is my_est and mine["enum_est"] is my_est and len(mine) == 4
    assert ca.get_adv_estimator_fn("gae")(3) == 6  # the user's entry, not the built-in GAE
    assert ca.get_adv_estimator_fn(Names.OTHER)() == "mine"
    with pytest.raises(ValueError, match="grpo"):
        ca.get_adv_estimator_fn("grpo")  # not in the user's dict
    ca.register_adv_est("my_est")(my_est)  # the same function twice is fine
    with pytest.raises(ValueError, match="already registered"):
        ca.register_adv_est("my_est")(lambda: None)


def test_cleared_registry_is_empty_until_registered(monkeypatch):
    saved = dict(ca.ADV_ESTIMATOR_REGISTRY)
    try:
        ca.ADV_ESTIMATOR_REGISTRY.clear()
        with pytest.raises(ValueError):
            ca.get_adv_estimator_fn("grpo")
        ca.register_adv_est("grpo")(saved["grpo"])
        assert ca.get_adv_estimator_fn("grpo") is saved["grpo"]
    finally:
        ca.ADV_ESTIMATOR_REGISTRY.clear()
        ca.ADV_ESTIMATOR_REGISTRY.update(saved)


def test_rebound_policy_loss_dict_is_what_the_actor_and_validation_see(monkeypatch):
    def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        return (log_prob * 0).sum(), {}

    mine = {"vanilla": ca.POLICY_LOSS_REGISTRY["vanilla"]}
    monkeypatch.setattr(ca, "POLICY_LOSS_REGISTRY", mine)
    ca.register_policy_loss("mine_only")(my_loss)
    assert mine["mine_only"] is my_loss and ca.get_policy_loss_fn("mine_only") is my_loss
    # Validation asks the live (rebound) dict: the user's loss is accepted, a built-in left out is refused.
    compose_config("demo", ["actor_rollout_ref.actor.policy_loss.loss_mode=mine_only"])
    with pytest.raises(ConfigValidationError, match="gspo"):
        compose_config("demo", ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])


def test_replacing_a_registry_with_a_non_dict_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ca, "ADV_ESTIMATOR_REGISTRY", ["grpo"])
    with pytest.raises(TypeError, match="advantage estimator registry"):
        ca.get_adv_estimator_fn("grpo")
