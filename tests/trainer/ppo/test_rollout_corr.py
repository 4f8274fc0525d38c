"""Rollout correction: importance weights, rejection masks, off-policy metrics, bypass loss, the per-step gap."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo import rollout_corr as rc


def _mask(lengths, width):
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_gap_metrics_are_probability_differences_over_response_tokens():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.3]]))
    roll = torch.log(torch.tensor([[0.4, 0.2, 0.1], [0.3, 0.5, 0.3]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the 0.9 vs 0.1 pad position must not count
    m = rc.rollout_probs_diff_metrics(old, roll, mask)
    diffs = torch.tensor([0.1, 0.0, 0.0, 0.2, 0.0], dtype=torch.float64)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.2, abs=1e-6)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(diffs.mean().item(), abs=1e-6)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(diffs.std().item(), abs=1e-6)
    assert -1.0 <= m["training/rollout_actor_probs_pearson_corr"] <= 1.0
    empty = rc.rollout_probs_diff_metrics(old, roll, torch.zeros_like(mask))
    assert empty["training/rollout_probs_diff_valid"] == 0 and math.isnan(empty["training/rollout_probs_diff_max"])


def test_token_is_weights_are_truncated_ratios():
    log_ratio = torch.log(torch.tensor([[0.5, 1.0, 4.0], [3.0, 1.5, 9.0]]))
    mask = _mask([3, 2], 3)
    w, m = rc.compute_is_weights(log_ratio, mask, "token", 2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 1.0, 2.0], [2.0, 1.5, 0.0]]))
    assert m["rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # 0.5 is not below 1/2
    assert not w.requires_grad


def test_sequence_is_weights_use_the_product_over_the_response():
    log_ratio = torch.log(torch.tensor([[2.0, 0.75, 5.0], [1.2, 1.2, 1.2]]))
    mask = _mask([2, 3], 3)
    w, m = rc.compute_is_weights(log_ratio, mask, "sequence", 10.0)
    assert torch.allclose(w[0], torch.tensor([1.5, 1.5, 0.0]))
    assert torch.allclose(w[1], torch.full((3,), 1.2 ** 3))
    assert m["rollout_is_seq_max"] == pytest.approx(1.728, rel=1e-5)


def test_icepop_band_zeroes_weights_outside_it():
    log_ratio = torch.log(torch.tensor([[0.2, 1.0, 3.0]]))
    w, _ = rc.compute_is_weights(log_ratio, torch.ones(1, 3), "token", "0.5_2.0")
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0]]))


def test_batch_normalize_rescales_to_mean_one():
    log_ratio = torch.log(torch.tensor([[0.5, 1.0], [1.5, 1.0]]))
    w, m = rc.compute_is_weights(log_ratio, torch.ones(2, 2), "token", 5.0, batch_normalize=True)
    assert w.mean().item() == pytest.approx(1.0)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [True, None, "x", "3_1", -1.0, "1_2_3"])
def test_bad_is_thresholds_are_refused(bad):
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rc.parse_is_threshold(bad)


def test_token_rejection_masks_out_of_band_tokens_only():
    log_ratio = torch.log(torch.tensor([[1.0, 3.0, 1.0], [0.9, 1.1, 1.0]]))
    mask = torch.ones(2, 3, dtype=torch.long)
    keep, m = rc.compute_rejection_mask(log_ratio, mask, "token_k1", 2.0)
    assert keep.tolist() == [[1, 0, 1], [1, 1, 1]]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(1 / 6)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert keep.dtype == mask.dtype


def test_sequence_rejection_drops_whole_responses_and_options_combine():
    log_ratio = torch.tensor([[0.0, 0.0, 2.0], [0.1, -0.1, 0.0]])
    mask = _mask([3, 3], 3)
    keep, m = rc.compute_rejection_mask(log_ratio, mask, "seq_max_k2,token_k3", "1.0,5.0")
    assert keep.tolist() == [[0, 0, 0], [1, 1, 1]]  # row 0: 0.5*2^2 = 2 > 1
    assert "rollout_rs_seq_max_k2_masked_fraction" in m and "rollout_rs_token_k3_masked_fraction" in m
    with pytest.raises(ValueError, match="rollout_rs"):
        rc.compute_rejection_mask(log_ratio, mask, "seq_avg_k9", 1.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        rc.compute_rejection_mask(log_ratio, mask, "token_k2", None)


def test_offpolicy_metrics_vanish_when_policies_match():
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]]))
    m = rc.compute_offpolicy_metrics(lp, lp.clone(), torch.ones(2, 2))
    assert m["kl"] == pytest.approx(0.0) and m["k3_kl"] == pytest.approx(0.0)
    assert m["chi2_token"] == pytest.approx(0.0, abs=1e-6) and m["chi2_seq"] == pytest.approx(0.0, abs=1e-6)
    assert m["training_ppl"] == pytest.approx(m["rollout_ppl"])


def test_apply_rollout_correction_adds_weights_and_prefixed_metrics():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.9]]))
    roll = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.1]]))
    batch = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": roll,
                                 "response_mask": torch.ones(2, 2, dtype=torch.long)})
    cfg = OmegaConf.create({"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
                            "rollout_rs_threshold": 5.0})
    m = rc.apply_rollout_correction(batch, cfg)
    assert torch.allclose(batch.batch["rollout_is_weights"], torch.tensor([[2.0, 1.0], [1.0, 2.0]]))
    assert batch.batch["response_mask"].tolist() == [[1, 1], [1, 0]]  # ratio 9 is outside 1/5..5
    assert all(k.startswith("rollout_corr/") for k in m) and "rollout_corr/rollout_is_mean" in m
    assert "rollout_corr/kl" in m
    del batch.batch["rollout_log_probs"]
    with pytest.raises(ValueError, match="rollout_log_probs"):
        rc.apply_rollout_correction(batch, cfg)


def _actor_cfg(rc_cfg):
    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                             "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": rc_cfg},
                             "global_batch_info": {}})


def test_bypass_ppo_clip_is_the_vanilla_loss_against_the_rollout_policy():
    torch.manual_seed(0)
    roll = -torch.rand(3, 4)
    cur = roll + 0.3 * torch.randn(3, 4)
    adv = torch.randn(3, 4)
    mask = torch.ones(3, 4)
    cfg = _actor_cfg({"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": 2.0})
    fn = core_algos.get_policy_loss_fn("bypass_mode")
    loss, metrics = fn(roll, cur, adv, mask, "token-mean", cfg)
    ref, _ = core_algos.get_policy_loss_fn("vanilla")(roll, cur, adv, mask, "token-mean", cfg)
    assert torch.allclose(loss, ref)
    assert "rollout_corr/rollout_is_mean" in metrics


def test_bypass_reinforce_weights_the_log_prob_gradient():
    roll = torch.log(torch.tensor([[0.5, 0.5]]))
    cur = torch.log(torch.tensor([[0.9, 0.5]])).requires_grad_(True)
    adv = torch.ones(1, 2)
    cfg = _actor_cfg({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.5})
    loss, _ = core_algos.get_policy_loss_fn("bypass_mode")(roll, cur, adv, torch.ones(1, 2), "token-mean", cfg)
    loss.backward()
    # d/dlogp of -w*A*logp, token-mean over 2 tokens: weights 1.5 (1.8 truncated) and 1.0
    assert torch.allclose(cur.grad, torch.tensor([[-0.75, -0.5]]))


def test_prepare_bypass_config_sets_the_actor_loss():
    cfg = OmegaConf.create({"algorithm": {"rollout_correction": {"bypass_mode": True, "loss_type": "ppo_clip"}},
                            "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "vanilla"}}}})
    OmegaConf.set_struct(cfg, True)
    rc.prepare_bypass_config(cfg)
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    assert cfg.actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type == "ppo_clip"
