"""On-policy distillation's loss and config (verl/trainer/distillation, the actor's PolicyLoss, validation):
upstream verl 0.9.1's ``distillation.*`` keys and what each does. The end-to-end run is test_distillation_e2e.py."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.config import ConfigKeyError, ConfigValidationError, compose_config
from verl.trainer.demo import register_resolver
from verl.trainer.distillation import distillation_loss
from verl.trainer.distillation.losses import policy_loss_config_for
from verl.workers.actor.ppo_actor import PolicyLoss

ENABLE = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/teacher"]


@pytest.fixture(scope="module")
def cfg():
    register_resolver()
    return compose_config("demo", ["actor_rollout_ref.model.path=/m", "data.train_files=x", "data.val_files=x",
                                   *ENABLE])


def _loss_cfg(**kw):
    base = {"loss_mode": "k3", "topk": 32, "use_task_rewards": True, "distillation_loss_coef": 1.0,
            "loss_max_clamp": None, "log_prob_min_clamp": None, "use_policy_gradient": False,
            "policy_loss_mode": "vanilla", "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
    base.update(kw)
    return OmegaConf.create(base)


P = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])  # student log-probs of the sampled tokens
Q = torch.tensor([[-1.5, -0.5, -0.5, -9.0]])  # teacher's
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding
INFO = {"dp_size": 1, "batch_num_tokens": 3, "global_batch_size": 1}


def _k3(p, q):
    return torch.exp(q - p) - (q - p) - 1


@pytest.mark.parametrize("mode, per_token", [
    ("k3", _k3(P, Q)), ("low_var_kl", _k3(P, Q)), ("abs", (P - Q).abs()), ("k2", 0.5 * (P - Q) ** 2)])
def test_loss_mode_picks_the_estimator(mode, per_token):
    loss, metrics = distillation_loss(_loss_cfg(loss_mode=mode), P, Q, MASK, "token-mean", INFO)
    want = (per_token * MASK).sum() / 3
    assert torch.allclose(loss, want), (mode, loss, want)
    assert metrics["actor/distillation/abs_loss"] == pytest.approx(per_token[MASK.bool()].abs().mean().item())
    assert metrics["actor/distillation/loss_max"] == pytest.approx(per_token[MASK.bool()].max().item())


def test_supervised_k3_gradient_moves_each_token_towards_the_teacher():
    p = P.clone().requires_grad_(True)
    loss, _ = distillation_loss(_loss_cfg(), p, Q, MASK, "token-mean", INFO)
    loss.backward()
    # d/dp of k3 is 1 - exp(q - p): positive (push down) where the student is above the teacher
    assert torch.allclose(p.grad, (1 - torch.exp(Q - P)) * MASK / 3)
    assert p.grad[0, 0] > 0 and p.grad[0, 1] < 0 and p.grad[0, 2] == 0


def test_loss_max_clamp_bounds_each_token():
    big_q = torch.tensor([[-1.0, 4.0, -0.5, -9.0]])  # k3 of token 1 is e^6 - 7: far above the clamp
    unclamped, _ = distillation_loss(_loss_cfg(), P, big_q, MASK, "token-mean", INFO)
    clamped, _ = distillation_loss(_loss_cfg(loss_max_clamp=2.0), P, big_q, MASK, "token-mean", INFO)
    per_token = _k3(P, big_q)
    # kl_penalty's own k3 caps at 10 (upstream's too); loss_max_clamp=2 caps lower
    assert torch.allclose(unclamped, (per_token.clamp(max=10) * MASK).sum() / 3)
    assert torch.allclose(clamped, (per_token.clamp(max=2.0) * MASK).sum() / 3)


def _pg(cfg, loss_cfg, old):
    pg_cfg = policy_loss_config_for(cfg.actor_rollout_ref.actor, loss_cfg, INFO)
    return distillation_loss(loss_cfg, P, Q, MASK, "token-mean", INFO, old_log_prob=old, policy_loss_config=pg_cfg)


def test_use_policy_gradient_uses_minus_the_estimate_as_advantage(cfg):
    loss_cfg = _loss_cfg(loss_mode="k1", use_policy_gradient=True)
    # on-policy (ratio 1) the vanilla loss is -mean(advantage) = mean(k1)
    loss, metrics = _pg(cfg, loss_cfg, old=P.clone())
    assert torch.allclose(loss, ((P - Q) * MASK).sum() / 3)
    assert "actor/distillation/pg_clipfrac" in metrics


@pytest.mark.parametrize("name, ratio, value, factor", [
    # token 0 has advantage -(p - q) = -0.5 (< 0); token 1 has +1.5 (> 0); token 2 has 0
    ("distillation_loss.clip_ratio_high", 1.5, 0.2, 1.2), ("distillation_loss.clip_ratio_high", 1.5, 0.6, 1.5),
    ("distillation_loss.clip_ratio_low", 0.5, 0.2, 0.8), ("distillation_loss.clip_ratio_low", 0.5, 0.6, 0.5),
])
def test_clip_ratios_bound_the_distillation_policy_gradient(cfg, name, ratio, value, factor):
    key = name.split(".")[-1]
    loss_cfg = _loss_cfg(loss_mode="k1", use_policy_gradient=True, **{key: value})
    old = P - torch.log(torch.tensor(ratio))
    loss, _ = _pg(cfg, loss_cfg, old=old)
    adv = -(P - Q)
    token = 1 if key == "clip_ratio_high" else 0  # the token whose advantage sign the bound applies to
    # the other non-zero token's term: unclipped side of the min/max
    other = 1 - token
    other_term = -adv[0, other] * ratio if (ratio > 1) == (adv[0, other] < 0) else None
    got_token_term = loss * 3 - (other_term if other_term is not None else -adv[0, other] * ratio)
    assert torch.allclose(got_token_term, -adv[0, token] * factor), (loss, key, value)


def test_clip_ratio_is_the_bound_when_low_and_high_are_null(cfg):
    # distillation_loss.clip_ratio, with distillation_loss.clip_ratio_low / _high null
    old = P - torch.log(torch.tensor(1.5))
    narrow, _ = _pg(cfg, _loss_cfg(loss_mode="k1", use_policy_gradient=True, clip_ratio=0.2,
                                   clip_ratio_low=None, clip_ratio_high=None), old)
    wide, _ = _pg(cfg, _loss_cfg(loss_mode="k1", use_policy_gradient=True, clip_ratio=0.6,
                                 clip_ratio_low=None, clip_ratio_high=None), old)
    # token 1 (advantage 1.5 > 0, ratio 1.5): capped at 1.2 with 0.2, at 1.5 (uncapped) with 0.6
    assert torch.allclose(wide - narrow, torch.tensor(-1.5 * (1.5 - 1.2) / 3))


def _micro_batch():
    return {"responses": torch.zeros(1, 4, dtype=torch.long), "response_mask": MASK.clone(),
            "old_log_probs": P.clone(), "advantages": torch.tensor([[2.0, 2.0, 2.0, 2.0]]),
            "teacher_logprobs": Q.clone(), "global_batch_info": dict(INFO)}


@pytest.mark.parametrize("use_task_rewards, coef", [(True, 1.0), (True, 0.25), (False, 0.25)])
def test_use_task_rewards_and_distillation_loss_coef_combine_as_upstream(cfg, use_task_rewards, coef):
    actor = cfg.actor_rollout_ref.actor
    dist = OmegaConf.create(OmegaConf.to_container(cfg.distillation, resolve=True))
    dist.distillation_loss.use_task_rewards = use_task_rewards
    dist.distillation_loss.distillation_loss_coef = coef
    # next-token-aligned over the whole sequence: the response's values are the last R before the final one
    outputs = {"log_probs": torch.cat([torch.zeros(1, 2), P, torch.zeros(1, 1)], dim=1)}
    rl_only, rl_metrics = PolicyLoss(actor)(outputs, _micro_batch())
    combined, metrics = PolicyLoss(actor, distillation=dist)(outputs, _micro_batch())
    d = (_k3(P, Q) * MASK).sum() / 3
    if use_task_rewards:
        assert torch.allclose(combined, rl_only + coef * d)
        assert metrics["actor/pg_loss"] == rl_metrics["actor/pg_loss"]
    else:  # the distillation term alone, coefficient 1 (upstream ignores the coefficient then)
        assert torch.allclose(combined, d)
        assert "actor/pg_loss" not in metrics
    assert metrics["actor/distillation/loss"] == pytest.approx(d.item())


# ------------------------------------------------------------------------------------------ validation
def _refusal(*overrides) -> str:
    register_resolver()
    with pytest.raises((ConfigKeyError, ConfigValidationError)) as info:
        compose_config("demo", list(overrides))
    return str(info.value)


def test_defaults_are_upstreams(cfg):
    d = cfg.distillation
    assert d.distillation_loss.loss_mode == "k3" and d.distillation_loss.topk == 32
    assert d.distillation_loss.use_task_rewards is True and d.distillation_loss.use_policy_gradient is False
    assert d.distillation_loss.loss_max_clamp is None and d.nnodes == 0 and d.n_gpus_per_node == 8
    assert d.teacher_key == "data_source"
    assert d.teacher_models.teacher_model.inference.temperature == cfg.actor_rollout_ref.rollout.temperature


def test_forward_kl_topk_is_refused_by_name():
    err = _refusal(*ENABLE, "distillation.distillation_loss.loss_mode=forward_kl_topk")
    assert "distillation.distillation_loss.loss_mode" in err and "top-k" in err


def test_k1_backpropagated_directly_is_refused_as_upstream():
    err = _refusal(*ENABLE, "distillation.distillation_loss.loss_mode=k1")
    assert "distillation.distillation_loss.loss_mode" in err and "use_policy_gradient" in err
    register_resolver()
    compose_config("demo", [*ENABLE, "distillation.distillation_loss.loss_mode=k1",
                            "distillation.distillation_loss.use_policy_gradient=true"])


def test_a_separate_teacher_pool_is_refused_by_name():
    assert "distillation.nnodes" in _refusal(*ENABLE, "distillation.nnodes=1")


def test_teacher_path_is_required():
    assert "distillation.teacher_models.teacher_model.model_path" in _refusal("distillation.enabled=true")


def test_a_second_teacher_is_refused_by_name():
    err = _refusal(*ENABLE, "+distillation.teacher_models.teacher_model2.model_path=/t2")
    assert "teacher_model2" in err


def test_teacher_context_must_fit_max_model_len():
    err = _refusal(*ENABLE, "distillation.teacher_models.teacher_model.inference.max_model_len=8")
    assert "distillation.teacher_models.teacher_model.inference.max_model_len" in err


def test_serving_knobs_warn_that_they_are_not_read():
    register_resolver()
    with pytest.warns(Warning, match="inference.gpu_memory_utilization"):
        compose_config("demo", [*ENABLE, "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.9"])
