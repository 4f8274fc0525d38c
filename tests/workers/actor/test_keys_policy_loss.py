"""The actor's loss keys reach the loss the actor trains with.

Each test composes ``ppo_trainer`` with the key changed, builds the actor's :class:`PolicyLoss` from the
composed ``actor_rollout_ref.actor`` section (what the actor worker does) and checks the loss on a fixed
batch against a value worked out here by hand, or against the default config where the key's effect is
a selection (clip-cov / kl-cov). The key names are spelled out so key_status.txt can point here.
"""

from __future__ import annotations

import pytest
import torch

from verl.trainer.config.checks import compose_config
from verl.workers.actor.ppo_actor import PolicyLoss

B, P, R = 3, 2, 4  # rows, prompt length, response length


def _actor(*overrides):
    return compose_config("ppo_trainer", list(overrides), validate=False).actor_rollout_ref.actor


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, R, generator=g) * 2
    # log-ratios spread over [-0.6, 0.6]: some tokens inside any clip range, some outside a narrow one
    log_ratio = (torch.rand(B, R, generator=g) - 0.5) * 1.2
    new = old + log_ratio
    full = torch.zeros(B, P + R)
    full[:, P - 1: P - 1 + R] = new  # next-token aligned: the response's log-probs end one before the end
    mask = torch.ones(B, R)
    mask[0, -1] = 0  # one padded token
    adv = torch.tensor([[1.0] * R, [-1.0] * R, [0.5, -2.0, 1.5, -0.5]])
    mb = {"responses": torch.zeros(B, R, dtype=torch.long), "response_mask": mask, "old_log_probs": old,
          "advantages": adv,
          "global_batch_info": {"dp_size": 1, "batch_num_tokens": float(mask.sum()), "global_batch_size": float(B)}}
    return {"log_probs": full}, mb, new


def _loss(actor_cfg, seed=0):
    outputs, mb, _ = _batch(seed)
    loss, metrics = PolicyLoss(actor_cfg)(outputs, mb)
    return float(loss), metrics


def _ppo_token_losses(new, old, adv, low, high, c):
    ratio = torch.exp(new - old)
    clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    return torch.where(adv < 0, torch.minimum(clipped, -adv * c), clipped)


def _expected(low, high, c, mode="token-mean", scale=None):
    _, mb, new = _batch()
    losses = _ppo_token_losses(new, mb["old_log_probs"], mb["advantages"], low, high, c)
    mask = mb["response_mask"]
    if mode == "token-mean":
        return float((losses * mask).sum() / mask.sum())
    per_seq = (losses * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return float(per_seq.mean())
    if mode == "seq-mean-token-mean":
        return float(((losses * mask).sum(-1) / mask.sum(-1)).mean())
    if mode == "seq-mean-token-sum-norm":
        return float(per_seq.mean() / (R if scale is None else scale))
    raise AssertionError(mode)


def test_default_loss_is_the_ppo_clip_loss():
    assert _loss(_actor())[0] == pytest.approx(_expected(0.2, 0.2, 3.0), rel=1e-5)


def test_clip_ratio_is_the_range_when_low_and_high_are_unset():
    # clip_ratio_low / clip_ratio_high default to 0.2 themselves; clip_ratio is their fallback
    cfg = _actor("actor_rollout_ref.actor.clip_ratio=0.05", "actor_rollout_ref.actor.clip_ratio_low=null",
                 "actor_rollout_ref.actor.clip_ratio_high=null")
    got = _loss(cfg)[0]
    assert got == pytest.approx(_expected(0.05, 0.05, 3.0), rel=1e-5)
    assert got != pytest.approx(_expected(0.2, 0.2, 3.0), rel=1e-3)


def test_clip_ratio_c_caps_negative_advantage_tokens():
    cfg = _actor("actor_rollout_ref.actor.clip_ratio_c=1.05")
    got, metrics = _loss(cfg)
    assert got == pytest.approx(_expected(0.2, 0.2, 1.05), rel=1e-5)
    assert got != pytest.approx(_expected(0.2, 0.2, 3.0), rel=1e-3)
    assert metrics["actor/pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_agg_mode(mode):
    got = _loss(_actor(f"actor_rollout_ref.actor.loss_agg_mode={mode}"))[0]
    assert got == pytest.approx(_expected(0.2, 0.2, 3.0, mode), rel=1e-5)


def test_loss_scale_factor_divides_seq_mean_token_sum_norm():
    cfg = _actor("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                 "actor_rollout_ref.actor.loss_scale_factor=10")
    assert _loss(cfg)[0] == pytest.approx(_expected(0.2, 0.2, 3.0, "seq-mean-token-sum-norm", 10), rel=1e-5)


def _cov(new, adv, mask):
    mean_a = (adv * mask).sum() / mask.sum()
    mean_l = (new * mask).sum() / mask.sum()
    return (adv - mean_a) * (new - mean_l)


def test_clip_cov_band_selects_the_tokens_whose_loss_is_dropped():
    _, mb, new = _batch()
    cov = _cov(new, mb["advantages"], mb["response_mask"])
    base = ["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.5"]
    # the default band (1, 5) holds no token of this batch: nothing is dropped, the loss is PPO's
    assert not ((cov > 1) & (cov < 5)).any()
    torch.manual_seed(0)
    assert _loss(_actor(*base))[0] == pytest.approx(_expected(0.2, 0.2, 1e9), rel=1e-5)
    lo, hi = float(cov.min()) - 1, float(cov.max()) + 1
    torch.manual_seed(0)
    widened, metrics = _loss(_actor(*base, f"actor_rollout_ref.actor.policy_loss.clip_cov_lb={lo}",
                                    f"actor_rollout_ref.actor.policy_loss.clip_cov_ub={hi}"))
    assert metrics["actor/pg_clipfrac"] > 0 and widened != pytest.approx(_expected(0.2, 0.2, 1e9), rel=1e-4)
    # an upper bound below every covariance empties the band again
    torch.manual_seed(0)
    closed = _loss(_actor(*base, f"actor_rollout_ref.actor.policy_loss.clip_cov_lb={lo}",
                          f"actor_rollout_ref.actor.policy_loss.clip_cov_ub={lo + 1e-6}"))[0]
    assert closed == pytest.approx(_expected(0.2, 0.2, 1e9), rel=1e-5)


def _kl_cov_expected(k, coef):
    _, mb, new = _batch()
    old, adv, mask = mb["old_log_probs"], mb["advantages"], mb["response_mask"]
    losses = -adv * torch.exp(new - old)
    valid = mask.reshape(-1) > 0
    a, lp = adv.reshape(-1)[valid], new.reshape(-1)[valid]
    cov = (a - a.mean()) * (lp - lp.mean())
    flat_index = torch.nonzero(valid).squeeze(-1)[torch.topk(cov, k).indices]
    flat = losses.reshape(-1).clone()
    flat[flat_index] += coef * (new - old).abs().reshape(-1)[flat_index]
    return float((flat.reshape(B, R) * mask).sum() / mask.sum())


def test_kl_cov_ratio_and_ppo_kl_coef_penalise_the_top_covariance_tokens():
    base = ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"]
    n_valid = int(_batch()[1]["response_mask"].sum())
    # default ratio (0.0002) still picks one token; default coefficient 0.1
    assert _loss(_actor(*base))[0] == pytest.approx(_kl_cov_expected(1, 0.1), rel=1e-5)
    got = _loss(_actor(*base, "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.5"))[0]
    assert got == pytest.approx(_kl_cov_expected(int(n_valid * 0.5), 0.1), rel=1e-5)
    got = _loss(_actor(*base, "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.5",
                       "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=4.0"))[0]
    assert got == pytest.approx(_kl_cov_expected(int(n_valid * 0.5), 4.0), rel=1e-5)
    assert _kl_cov_expected(int(n_valid * 0.5), 4.0) != pytest.approx(_kl_cov_expected(int(n_valid * 0.5), 0.1))
