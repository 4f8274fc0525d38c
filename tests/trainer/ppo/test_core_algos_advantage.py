"""Advantage estimators and their registry, checked against hand-computed values."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos as ca

EPS = 1e-6


def outcome(scores, lengths, width=4):
    """Reward on the last valid token of each response, plus the matching mask."""
    bs = len(scores)
    rewards = torch.zeros(bs, width)
    mask = torch.zeros(bs, width)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


# ----------------------------------------------------------------------------- registry


def test_enum_is_str_and_builtins_registered():
    assert ca.AdvantageEstimator.GRPO == "grpo"
    assert isinstance(ca.AdvantageEstimator.GAE, str)
    assert ca.get_adv_estimator_fn(ca.AdvantageEstimator.GRPO) is ca.compute_grpo_outcome_advantage
    assert ca.get_adv_estimator_fn("rloo_vectorized") is ca.compute_rloo_vectorized_outcome_advantage
    for name in ["gae", "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus",
                 "reinforce_plus_plus_baseline", "remax", "opo", "grpo_passk", "gpg"]:
        assert name in ca.ADV_ESTIMATOR_REGISTRY


def test_register_custom_estimator_and_conflicts():
    name = "unit_test_custom_est"

    def my_est(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards * 2, token_level_rewards

    def other(**kwargs):
        return None

    try:
        assert ca.register_adv_est(name)(my_est) is my_est
        assert ca.get_adv_estimator_fn(name) is my_est
        ca.register_adv_est(name)(my_est)  # same function again is fine
        with pytest.raises(ValueError, match="already registered"):
            ca.register_adv_est(name)(other)
    finally:
        ca.ADV_ESTIMATOR_REGISTRY.pop(name, None)


def test_unknown_estimator_lists_choices():
    with pytest.raises(ValueError) as err:
        ca.get_adv_estimator_fn("no_such_estimator")
    assert "no_such_estimator" in str(err.value) and "grpo" in str(err.value)


# ----------------------------------------------------------------------------- GRPO family


@pytest.mark.parametrize("fn", [ca.compute_grpo_outcome_advantage, ca.compute_grpo_vectorized_outcome_advantage])
def test_grpo_hand_values(fn):
    # group a: [1, 0, 2] -> mean 1, unbiased std 1; group b: single response 3 -> mean 0, std 1
    rewards, mask = outcome([1.0, 0.0, 2.0, 3.0], [4, 2, 3, 1])
    index = np.array(["a", "a", "a", "b"], dtype=object)
    adv, ret = fn(rewards, mask, index)
    expected = torch.tensor([0.0, -1 / (1 + EPS), 1 / (1 + EPS), 3 / (1 + EPS)])
    torch.testing.assert_close(adv, expected.unsqueeze(-1) * mask)
    torch.testing.assert_close(ret, adv)

    adv, _ = fn(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.0, 1.0, 3.0]).unsqueeze(-1) * mask)


def test_grpo_loop_and_vectorized_agree_with_mixed_index_types():
    torch.manual_seed(0)
    rewards = torch.randn(9, 5)
    mask = (torch.rand(9, 5) > 0.3).float()
    mask[:, 0] = 1
    uids = ["p", "q", "p", "r", "q", "p", "s", "q", "r"]
    for index in (np.array(uids, dtype=object), uids, torch.tensor([ord(u) for u in uids])):
        a, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index)
        b, _ = ca.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_grpo_passk():
    rewards, mask = outcome([1.0, 3.0, 2.0], [2, 2, 2])
    index = np.array(["g", "g", "g"], dtype=object)
    cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": True})
    adv, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, index, config=cfg)
    # only the best gets r_max - r_2nd = 1, divided by std([1,3,2]) = 1
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 1 / (1 + EPS), 0.0]))
    cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": False})
    adv, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, index, config=cfg)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="at least 2"):
        ca.compute_grpo_passk_outcome_advantage(rewards[:1], mask[:1], index[:1], config=cfg)
    with pytest.raises(AssertionError):
        ca.compute_grpo_passk_outcome_advantage(rewards, mask, index)


def test_gdpo_single_component_is_whitened_grpo():
    rewards, mask = outcome([0.0, 1.0, 0.0, 1.0], [1, 1, 1, 1], width=1)
    adv, ret = ca.compute_gdpo_outcome_advantage(rewards, mask, np.array([0, 0, 1, 1]))
    # grpo gives ~[-1, 1, -1, 1]; whitening with unbiased var 4/3 -> +-sqrt(3)/2
    s = math.sqrt(3) / 2
    torch.testing.assert_close(adv[:, 0], torch.tensor([-s, s, -s, s]), atol=1e-4, rtol=0)
    torch.testing.assert_close(ret, adv)


# ----------------------------------------------------------------------------- leave-one-out / baselines


def test_rloo_loop_and_vectorized():
    rewards, mask = outcome([1.0, 0.0, 2.0, 3.0], [1, 2, 3, 4])
    index = ["a", "a", "a", "b"]
    adv, _ = ca.compute_rloo_outcome_advantage(rewards, mask, index)
    # r_i - mean(others): 1-1, 0-1.5, 2-0.5; singleton keeps its raw score
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.5, 1.5, 3.0]).unsqueeze(-1) * mask)
    adv_v, _ = ca.compute_rloo_vectorized_outcome_advantage(rewards, mask, np.array(index, dtype=object))
    # vectorised variant zeroes singleton groups (upstream behaviour)
    torch.testing.assert_close(adv_v, torch.tensor([0.0, -1.5, 1.5, 0.0]).unsqueeze(-1) * mask)


def test_opo_length_weighted_baseline():
    rewards, mask = outcome([1.0, 0.0, 4.0], [2, 4, 3])
    adv, _ = ca.compute_opo_outcome_advantage(rewards, mask, ["g", "g", "solo"])
    # baseline (2*1 + 4*0) / 6 = 1/3; singleton baseline 0
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, 4.0]).unsqueeze(-1) * mask)


def test_gpg_alpha_rescaling():
    rewards, mask = outcome([1.0, 0.0, 2.0, 0.0], [1, 1, 1, 1], width=2)
    adv, _ = ca.compute_gpg_outcome_advantage(rewards, mask, ["a", "a", "a", "b"])
    # alpha = bs / #nonzero = 4 / 2; group a mean 1; singleton mean 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, -2.0, 2.0, 0.0]))


def test_reinforce_pp_baseline():
    rewards, mask = outcome([1.0, 3.0, 5.0], [1, 1, 1], width=1)
    adv, _ = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["a", "a", "b"])
    x = [-1.0, 1.0, 5.0]  # group-centred (singleton untouched)
    mu = sum(x) / 3
    sd = math.sqrt(sum((v - mu) ** 2 for v in x) / 2)
    torch.testing.assert_close(adv[:, 0], torch.tensor([(v - mu) / sd for v in x]), atol=1e-5, rtol=1e-5)


def test_reinforce_pp_discount_skips_masked_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=OmegaConf.create({"gamma": 0.5}))
    # row 0: t2 -> 1, t1 masked (0, running return carried), t0 -> 0 + 0.5 * 1
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 1.0], [2.0, 0.0, 0.0]]))
    vals = [0.5, 1.0, 2.0]
    mu = sum(vals) / 3
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / 2)
    exp = torch.tensor([[(0.5 - mu) / sd, 0.0, (1.0 - mu) / sd], [(2.0 - mu) / sd, 0.0, 0.0]])
    torch.testing.assert_close(adv, exp, atol=1e-5, rtol=1e-5)


def test_remax():
    rewards = torch.tensor([[0.0, 1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = ca.compute_remax_outcome_advantage(rewards, torch.tensor([0.5]), mask)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0]]))


# ----------------------------------------------------------------------------- GAE


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2]])
    mask = torch.ones(1, 2)
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # t1: delta = 1 - 0.2 = 0.8 ; t0: delta = 0.9*0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72*0.8 = 0.256
    torch.testing.assert_close(ret, torch.tensor([[0.756, 1.0]]))
    # whitening two values gives -+1/sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[-(0.5**0.5), 0.5**0.5]]), atol=1e-5, rtol=0)


def test_gae_skips_observation_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.2]])  # the masked value must be ignored
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret[0, [0, 2]], torch.tensor([0.756, 1.0]))
    torch.testing.assert_close(adv[0, [0, 2]], torch.tensor([-(0.5**0.5), 0.5**0.5]), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- PF-PPO resampling


def test_pf_ppo_max_min_resamples_only_extremes():
    from types import SimpleNamespace

    scores = torch.tensor([[0.0, 1.0], [0.0, 5.0], [0.0, 3.0], [0.0, -2.0]])
    data = SimpleNamespace(
        batch={"token_level_scores": scores, "ids": torch.arange(4)},
        non_tensor_batch={"uid": np.array(["a", "b", "c", "d"], dtype=object)},
        meta_info={"per_sample": [10, 11, 12, 13], "global": 7},
    )
    torch.manual_seed(0)
    out = ca.compute_pf_ppo_reweight_data(data, reweight_method="max_min")
    ids = out.batch["ids"].tolist()
    assert len(ids) == 4 and set(ids) <= {1, 3}  # only max (row 1) and min (row 3) survive
    assert list(out.non_tensor_batch["uid"]) == [["a", "b", "c", "d"][i] for i in ids]
    assert out.meta_info["per_sample"] == [10 + i for i in ids] and out.meta_info["global"] == 7
    assert data.batch["ids"].tolist() == [0, 1, 2, 3]  # input untouched
    with pytest.raises(ValueError, match="max_random"):
        ca.compute_pf_ppo_reweight_data(data, reweight_method="bogus")
