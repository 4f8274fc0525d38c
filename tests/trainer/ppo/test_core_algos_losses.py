"""Policy / value / entropy losses, agg_loss (incl. split invariance) and KL helpers."""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos as ca


def actor_cfg(**over):
    base = {
        "clip_ratio": 0.2,
        "clip_ratio_low": None,
        "clip_ratio_high": None,
        "clip_ratio_c": 3.0,
        "global_batch_info": {},
        "policy_loss": {"clip_cov_ratio": 0.25, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.25,
                        "ppo_kl_coef": 2.0},
    }
    base.update(over)
    return OmegaConf.create(base)


# ----------------------------------------------------------------------------- agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row fully masked


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 7 / 3),
        ("token-sum", 7.0),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / 2 / 3),
    ],
)
def test_agg_loss_modes(mode, expected):
    assert ca.agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected, rel=1e-6)
    assert ca.agg_loss(LOSS, MASK.bool(), mode).item() == pytest.approx(expected, rel=1e-6)


def test_agg_loss_scale_factor_and_errors():
    assert ca.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(0.5)
    with pytest.raises(ValueError) as err:
        ca.agg_loss(LOSS, MASK, "seq-sum")
    assert "token-mean" in str(err.value) and "seq-mean-token-sum-norm" in str(err.value)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        ca.agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        ca.agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2)


@pytest.mark.parametrize("mode", list(ca.AGG_LOSS_MODES))
@pytest.mark.parametrize("dp_size,micro", [(1, 2), (2, 1), (2, 3), (4, 2)])
def test_agg_loss_split_invariance(mode, dp_size, micro):
    """sum over micro-batches, mean over DP ranks == loss of the whole mini-batch."""
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(12, 5, generator=g)
    mask = (torch.rand(12, 5, generator=g) > 0.4).float()
    mask[:, 0] = 1.0  # every sequence has at least one token
    full = ca.agg_loss(loss, mask, mode)
    info = {"batch_num_tokens": mask.sum().item(), "global_batch_size": 12}

    rank_losses = []
    for shard_rows in torch.arange(12).chunk(dp_size):
        total = 0.0
        for mb in shard_rows.split(micro):
            total = total + ca.agg_loss(loss[mb], mask[mb], mode, dp_size=dp_size, **info)
        rank_losses.append(total)
    torch.testing.assert_close(torch.stack(rank_losses).mean(), full, atol=1e-5, rtol=1e-5)


def test_policy_loss_split_invariance_through_global_batch_info():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(8, 6, generator=g)
    new = old + 0.3 * torch.randn(8, 6, generator=g)
    adv = torch.randn(8, 6, generator=g)
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    fn = ca.get_policy_loss_fn("vanilla")
    full, _ = fn(old, new, adv, mask, "token-mean", actor_cfg())
    cfg = actor_cfg(global_batch_info={"dp_size": 1, "batch_num_tokens": mask.sum().item(), "global_batch_size": 8})
    parts = [fn(old[s], new[s], adv[s], mask[s], "token-mean", cfg)[0] for s in torch.arange(8).split(3)]
    torch.testing.assert_close(sum(parts), full, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- policy losses


def vanilla_case():
    # tokens: (A, ratio) = (+2, 1.5), (-1, 0.5), (-1, 5.0), (+1, 1.0), masked junk
    adv = torch.tensor([[2.0, -1.0, -1.0, 1.0, 100.0]])
    ratio = torch.tensor([[1.5, 0.5, 5.0, 1.0, 7.0]])
    old = torch.full((1, 5), -1.0)
    new = (old + ratio.log()).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    return old, new, adv, mask, ratio


def test_vanilla_ppo_clip_and_dual_clip():
    old, new, adv, mask, ratio = vanilla_case()
    loss, metrics = ca.compute_policy_loss_vanilla(old, new, adv, mask, "token-sum", actor_cfg())
    # -2*1.2 (upper clip) + 0.8 (lower clip) + 3 (dual clip caps 5) + -1
    assert loss.item() == pytest.approx(-2.4 + 0.8 + 3.0 - 1.0, abs=1e-5)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 4)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 4)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 4, abs=1e-6)
    loss.backward()
    # clipped and dual-clipped tokens carry no gradient; token 3: d(-A*r)/dlogp = -1
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0, 0.0, -1.0, 0.0]]))


def test_vanilla_asymmetric_clip_and_mean_mode():
    old, new, adv, mask, _ = vanilla_case()
    # the actor's actor.clip_ratio_low / actor.clip_ratio_high (distillation_loss has keys of the same names)
    cfg = actor_cfg(clip_ratio_low=0.1, clip_ratio_high=0.3)
    loss, _ = ca.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", cfg)
    assert loss.item() == pytest.approx((-2.6 + 0.9 + 3.0 - 1.0) / 4, abs=1e-5)
    with pytest.raises(AssertionError):
        ca.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", actor_cfg(clip_ratio_c=1.0))


def test_vanilla_rollout_is_weights_and_plain_namespace_config():
    old, new, adv, mask, _ = vanilla_case()
    cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                          global_batch_info={})
    w = torch.tensor([[0.5, 2.0, 1.0, 3.0, 1.0]])
    loss, _ = ca.compute_policy_loss_vanilla(old, new, adv, mask, "token-sum", cfg, rollout_is_weights=w)
    assert loss.item() == pytest.approx(-2.4 * 0.5 + 0.8 * 2 + 3.0 - 3.0, abs=1e-5)


def test_deprecated_compute_policy_loss_returns_four_tuple():
    old, new, adv, mask, _ = vanilla_case()
    out = ca.compute_policy_loss(old, new, adv, mask, cliprange=0.2, loss_agg_mode="token-sum")
    assert len(out) == 4
    assert out[0].item() == pytest.approx(0.4, abs=1e-5)
    assert out[1].item() == pytest.approx(0.5) and out[3].item() == pytest.approx(0.25)


def test_gspo_sequence_ratio():
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.1, 0.3]], requires_grad=True)  # mean log-ratio 0.2
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    s = math.exp(0.2)
    loss, m = ca.compute_policy_loss_gspo(old, new, adv, mask, "token-mean", actor_cfg())
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)  # clipped at 1 + 0.2
    assert m["actor/pg_clipfrac"] == pytest.approx(1.0)
    loss, _ = ca.compute_policy_loss_gspo(old, new, adv, mask, "token-mean", actor_cfg(clip_ratio=0.3))
    assert loss.item() == pytest.approx(-s, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.full((1, 2), -s / 2))


def test_geo_mean():
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.1, 0.3]])
    mask = torch.ones(1, 2)
    loss, m = ca.compute_policy_loss_geo_mean(old, new, torch.ones(1, 2), mask, "token-mean", actor_cfg())
    assert loss.item() == pytest.approx(-math.exp(0.15), abs=1e-6)  # second token clipped to 0.2
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5) and m["actor/pg_clipfrac_lower"] == 0.0
    loss, m = ca.compute_policy_loss_geo_mean(old, new, -torch.ones(1, 2), mask, "token-mean", actor_cfg())
    assert loss.item() == pytest.approx(math.exp(0.2), abs=1e-6)  # negative A: no optimistic clip
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(0.5)


def cov_case():
    adv = torch.tensor([[3.0, 0.0, 0.0, 0.0]])
    logp = torch.tensor([[-0.1, -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    return adv, logp, mask


def test_clip_cov_drops_high_covariance_token():
    adv, logp, mask = cov_case()
    new = logp.clone().requires_grad_(True)
    # cov = (A - 0.75)(logp + 0.775) = [1.51875, 0.16875, ...] -> only token 0 in (1, 5)
    loss, m = ca.compute_policy_loss_clip_cov(logp, new, adv, mask, "token-sum", actor_cfg())
    assert loss.item() == pytest.approx(0.0)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.25)
    loss.backward()
    assert new.grad[0, 0].item() == 0.0
    cfg = actor_cfg(policy_loss={"clip_cov_ratio": 0.25, "clip_cov_lb": 2.0, "clip_cov_ub": 5.0})
    loss, _ = ca.compute_policy_loss_clip_cov(logp, logp, adv, mask, "token-sum", cfg)
    assert loss.item() == pytest.approx(-3.0)  # nothing in the band -> plain PPO


def test_kl_cov_penalises_top_covariance_token():
    adv, logp, mask = cov_case()
    old = logp - torch.tensor([[0.5, 0.0, 0.0, 0.0]])
    loss, m = ca.compute_policy_loss_kl_cov(old, logp, adv, mask, "token-sum", actor_cfg())
    assert loss.item() == pytest.approx(-3 * math.exp(0.5) + 2.0 * 0.5, abs=1e-5)
    assert m == {"actor/ppo_kl": pytest.approx(0.125)}


def test_policy_loss_registry():
    for name in ["vanilla", "gspo", "clip_cov", "kl_cov", "geo_mean", "gpg", "cispo", "sapo", "dro"]:
        assert name in ca.POLICY_LOSS_REGISTRY
    assert ca.get_policy_loss_fn("vanilla") is ca.compute_policy_loss_vanilla
    name = "unit_test_custom_loss"
    try:

        @ca.register_policy_loss(name)
        def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None):
            return ca.agg_loss(-advantages * log_prob, response_mask, loss_agg_mode), {}

        assert ca.get_policy_loss_fn(name) is my_loss
    finally:
        ca.POLICY_LOSS_REGISTRY.pop(name, None)
    with pytest.raises(ValueError) as err:
        ca.get_policy_loss_fn("nope")
    assert "nope" in str(err.value) and "vanilla" in str(err.value)


def test_cispo_keeps_gradient_on_clipped_tokens():
    old, new, adv, mask, _ = vanilla_case()
    loss, _ = ca.compute_policy_loss_cispo(old, new, adv, mask, "token-sum", actor_cfg())
    loss.backward()
    # gradient = -sg[clip(r)] * A for every valid token
    torch.testing.assert_close(new.grad, torch.tensor([[-2 * 1.2, 0.8, 1.2, -1.0, 0.0]]))


# ----------------------------------------------------------------------------- value / entropy


def test_value_loss():
    vpreds = torch.tensor([[1.0, 2.0]])
    values = torch.tensor([[0.5, 0.5]])
    returns = torch.tensor([[1.5, 0.0]])
    loss, clipfrac = ca.compute_value_loss(vpreds, returns, values, torch.ones(1, 2), cliprange_value=0.2)
    # clipped preds 0.7, 0.7 -> errors max(0.25, 0.64), max(4, 0.49) -> 0.5 * mean
    assert loss.item() == pytest.approx(0.5 * (0.64 + 4.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)


def test_entropy_loss_uniform():
    logits = torch.zeros(2, 3, 4)
    assert ca.compute_entropy_loss(logits, torch.ones(2, 3)).item() == pytest.approx(math.log(4), rel=1e-6)


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize(
    "kind,value,grad",
    [
        ("kl", 0.5, 1.0),
        ("k1", 0.5, 1.0),
        ("abs", 0.5, 1.0),
        ("mse", 0.125, 0.5),
        ("k2", 0.125, 0.5),
        ("low_var_kl", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),
        ("k3", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),
        # '+' keeps the value but uses the k2 gradient (logprob - ref = 0.5)
        ("kl+", 0.5, 0.5),
        ("abs+", 0.5, 0.5),
        ("low_var_kl+", math.exp(-0.5) - 0.5, 0.5),
        ("k3+", math.exp(-0.5) - 0.5, 0.5),
        ("k2+", 0.125, 0.5),
    ],
)
def test_kl_penalty_values_and_gradients(kind, value, grad):
    logp = torch.tensor([-1.0], requires_grad=True)
    ref = torch.tensor([-1.5])
    out = ca.kl_penalty(logp, ref, kind)
    assert out.item() == pytest.approx(value, abs=1e-6)
    out.sum().backward()
    assert logp.grad.item() == pytest.approx(grad, abs=1e-6)


def test_low_var_kl_clamped():
    out = ca.kl_penalty(torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0]), "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))


def test_kl_penalty_bad_types():
    # "full" is upstream's name but not implemented here: refused like any unknown estimator (validation
    # refuses it by name before a run starts).
    with pytest.raises(ValueError, match="'full'"):
        ca.kl_penalty(torch.zeros(1), torch.zeros(1), "full")
    with pytest.raises(ValueError) as err:
        ca.kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    assert "low_var_kl" in str(err.value)


def test_kl_controllers():
    ctl = ca.get_kl_controller(OmegaConf.create({"type": "adaptive", "kl_coef": 0.1, "target_kl": 1.0,
                                                 "horizon": 10}))
    ctl.update(current_kl=2.0, n_steps=5)  # error clipped to 0.2 -> x1.1
    assert ctl.value == pytest.approx(0.11)
    ctl.update(current_kl=0.9, n_steps=10)  # error -0.1 -> x0.9
    assert ctl.value == pytest.approx(0.099)
    fixed = ca.get_kl_controller(OmegaConf.create({"type": "fixed", "kl_coef": 0.3}))
    fixed.update(current_kl=100.0, n_steps=10)
    assert isinstance(fixed, ca.FixedKLController) and fixed.value == 0.3
    with pytest.raises(AssertionError):
        ca.get_kl_controller(OmegaConf.create({"type": "adaptive", "kl_coef": 0.1, "target_kl": 1, "horizon": 0}))
    with pytest.raises(NotImplementedError):
        ca.get_kl_controller(OmegaConf.create({"type": "cosine", "kl_coef": 0.1}))


def test_apply_kl_penalty_and_compute_rewards():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    ref = torch.zeros(2, 3)
    old = torch.tensor([[0.2, -0.1, 0.3], [0.4, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    data = SimpleNamespace(batch={"token_level_scores": scores, "ref_log_prob": ref, "old_log_probs": old,
                                  "response_mask": mask})
    ctl = ca.FixedKLController(0.5)
    data, metrics = ca.apply_kl_penalty(data, ctl, kl_penalty="kl")
    torch.testing.assert_close(data.batch["token_level_rewards"],
                               torch.tensor([[-0.1, 0.05, 0.85], [-0.2, 2.0, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.4 / 3 + 0.4 / 2) / 2, abs=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    torch.testing.assert_close(ca.compute_rewards(scores, old, ref, 0.5), scores - 0.5 * old)


def test_dro_and_gpg_by_hand():
    old = torch.tensor([[-1.0, -0.5]])
    new = torch.tensor([[-0.8, -0.9]])
    adv = torch.tensor([[2.0, -1.0]])
    mask = torch.tensor([[1.0, 0.0]])
    cfg = actor_cfg(policy_loss={"dro_beta": 0.1})
    loss, m = ca.compute_policy_loss_dro(old, new, adv, mask, "token-mean", cfg)
    # only token 0: -(2 * -0.8 - 0.05 * 0.2^2)
    assert loss.item() == pytest.approx(1.6 + 0.05 * 0.04, abs=1e-6)
    assert m["actor/ppo_kl"] == pytest.approx(-0.2, abs=1e-6)
    with pytest.raises(ValueError, match="dro_beta"):
        ca.compute_policy_loss_dro(old, new, adv, mask, "token-mean", actor_cfg(policy_loss={"dro_beta": None}))
    loss, m = ca.compute_policy_loss_gpg(old, new, adv, mask, "token-mean", actor_cfg())
    assert loss.item() == pytest.approx(1.6, abs=1e-6) and m == {}
