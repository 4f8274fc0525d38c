"""The optimal token baseline (``algorithm.adv_estimator=optimal_token_baseline`` / ``tir_optimal_token_baseline``)
and the actor key it needs, ``actor_rollout_ref.actor.calculate_sum_pi_squared``.

The estimator is checked on a hand-computed two-response group, against GRPO on the same batch, with rollout IS
weights, and in its multi-turn form; the actor worker's old-log-prob pass is checked to return sum_pi_squared
equal to sum_v softmax(logits)^2 of the plain HF model; validation and the trainer's advantage step close it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage

HALF = float(np.log(0.5))


def _hand_batch():
    """Two responses to one prompt, two tokens each, pi(y_t) = 0.5 everywhere, so |score_t|^2 = sum_pi_squared.

    row 0: score 1, sum_pi_squared [0.5, 0.5]  -> W = [0.5, 1.0]
    row 1: score 0, sum_pi_squared [0.25, 0.75] -> W = [0.25, 1.0]
    B_0 = (1 * 0.5 + 0 * 0.25) / 0.75 = 2/3,  B_1 = (1 * 1 + 0 * 1) / 2 = 1/2
    """
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    old_log_probs = torch.full((2, 2), HALF)
    sum_pi_squared = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    return rewards, mask, old_log_probs, sum_pi_squared, np.array(["p", "p"], dtype=object)


def test_hand_checked_group_and_it_differs_from_grpo():
    rewards, mask, lp, s, index = _hand_batch()
    fn = core_algos.get_adv_estimator_fn("optimal_token_baseline")
    adv, ret = fn(token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=lp, sum_pi_squared=s)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1 / 3, 1 / 2], [-2 / 3, -1 / 2]]), rtol=1e-6, atol=1e-6)
    grpo, _ = core_algos.get_adv_estimator_fn("grpo")(token_level_rewards=rewards, response_mask=mask, index=index,
                                                      norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(grpo, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))  # one baseline per response
    assert not torch.allclose(adv, grpo)


def test_singleton_group_keeps_its_return_and_padding_stays_zero():
    rewards = torch.tensor([[0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, _ = core_algos.get_adv_estimator_fn("optimal_token_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=np.array(["a"], dtype=object),
        old_log_probs=torch.zeros(1, 3), sum_pi_squared=torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.tensor([[2.0, 2.0, 0.0]]))


def test_rollout_is_weights_scale_each_step_by_the_weight_squared():
    rewards, mask, lp, s, index = _hand_batch()
    fn = core_algos.get_adv_estimator_fn("optimal_token_baseline")
    # row 1's weight 2 makes its W four times larger: B_0 = 0.5 / (0.5 + 4 * 0.25) = 1/3, B_1 = 1 / (1 + 4) = 1/5
    w = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=lp, sum_pi_squared=s,
                rollout_is_weights=w)
    torch.testing.assert_close(adv[0], torch.tensor([2 / 3, 4 / 5]), rtol=1e-6, atol=1e-6)


def test_multi_turn_variant_counts_generated_tokens_and_zeroes_the_lone_tail():
    fn = core_algos.get_adv_estimator_fn("tir_optimal_token_baseline")
    # row 0 has a masked tool span at position 1: its generated tokens are positions 0 and 2
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    lp = torch.full((2, 4), HALF)
    s = torch.full((2, 4), 0.5)  # every generated step adds 0.5 to W
    index = np.array(["p", "p"], dtype=object)
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=lp, sum_pi_squared=s)
    # compacted: row 0 G = [1, 1], W = [.5, 1]; row 1 G = [0, 0, 0], W = [.5, 1, 1.5]
    # B = [1*.5/(.5+.5), 1*1/(1+1), -] = [.5, .5]; row 1's third step runs on alone: no baseline there
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5, 0.0], [-0.5, -0.5, 0.0, 0.0]]))
    plain, _ = core_algos.get_adv_estimator_fn("optimal_token_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=lp, sum_pi_squared=s)
    assert not torch.allclose(adv, plain)  # the plain form compares positions, tool span included


def test_missing_sum_pi_squared_is_a_clear_error():
    rewards, mask, lp, _, index = _hand_batch()
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=true"):
        core_algos.get_adv_estimator_fn("optimal_token_baseline")(
            token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=lp)


def test_trainer_advantage_step_reads_the_batch_fields():
    rewards, mask, lp, s, index = _hand_batch()
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask, "old_log_probs": lp,
                                        "sum_pi_squared": s}, non_tensors={"uid": index})
    out = compute_advantage(data, "optimal_token_baseline", num_repeat=2)
    torch.testing.assert_close(out.batch["advantages"][:, 0], torch.tensor([1 / 3, -2 / 3]), rtol=1e-6, atol=1e-6)


def test_sum_pi_squared_from_logits():
    from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits

    logits = torch.randn(3, 5, 11)
    torch.testing.assert_close(calculate_sum_pi_squared_from_logits(logits), logits.softmax(-1).pow(2).sum(-1))
    one_hot = torch.full((1, 6), -1e4)
    one_hot[0, 2] = 1e4
    assert calculate_sum_pi_squared_from_logits(one_hot).item() == pytest.approx(1.0)  # no overflow at extremes


# ------------------------------------------------------------------------------------------- the actor
def _config(model_dir, *overrides):
    from verl.trainer.config.checks import compose_config

    return compose_config("ppo_trainer", [
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", *overrides])


def test_actor_old_log_prob_pass_returns_sum_pi_squared(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.engine_utils import single_rank_gloo
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.workers.engine_workers import ActorRolloutRefWorker

    model_dir = str(tmp_path / "m")
    build_tiny_qwen3_5(model_dir, kind="dense", seed=0)
    prompt, response, n = 4, 3, 4
    ids = torch.randint(20, 100, (n, prompt + response), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -1] = 0  # a shorter response
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:],
                                         "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                                         "response_mask": mask[:, prompt:].clone()})
    with single_rank_gloo():
        on = ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
        cfg = _config(model_dir, *on)
        worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor", full_config=cfg)
        worker.init_model()
        out = worker.compute_log_prob(batch)
        off_cfg = _config(model_dir, "algorithm.adv_estimator=grpo")
        off = ActorRolloutRefWorker(off_cfg.actor_rollout_ref, role="actor", full_config=off_cfg)
        off.init_model()
        assert "sum_pi_squared" not in off.compute_log_prob(batch).batch.keys()  # the key is what asks for it
    got = out.batch["sum_pi_squared"]
    assert got.shape == (n, response)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask).logits.float()
    expected = logits[:, prompt - 1:-1].softmax(-1).pow(2).sum(-1)
    valid = batch.batch["response_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=2e-3, atol=2e-4)
    assert ((got[valid] > 0) & (got[valid] <= 1)).all()


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("extra, key", [
    ([], "algorithm.adv_estimator"),  # the estimator without the actor computing its input
    (["actor_rollout_ref.actor.calculate_sum_pi_squared=true", "actor_rollout_ref.model.use_fused_kernels=true"],
     "actor_rollout_ref.actor.calculate_sum_pi_squared"),
])
def test_validation_names_the_key(extra, key):
    from verl.trainer.config import ConfigValidationError
    from verl.trainer.config.checks import compose_config

    base = ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"]
    with pytest.raises(ConfigValidationError, match=key.replace(".", r"\.")):
        compose_config("ppo_trainer", [*base, *extra])
    compose_config("ppo_trainer", [*base, "actor_rollout_ref.actor.calculate_sum_pi_squared=true"])
