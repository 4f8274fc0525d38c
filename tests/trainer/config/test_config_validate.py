"""validate_config: each rule fires, names the key to change, and all problems are listed."""

import warnings

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import ConfigValidationError, ConfigWarning, compute_world_size, validate_config
from verl.workers.reward_manager import NaiveRewardManager, register


@register("test_no_router")
class _NoRouterManager(NaiveRewardManager):
    """A reward manager that cannot pass a generative reward model's address on (validation refuses it then)."""

    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source"):
        super().__init__(tokenizer, num_examine, compute_score=compute_score, reward_fn_key=reward_fn_key)


def _problems(cfg, **changes):
    for key, value in changes.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=False)
    with pytest.raises(ConfigValidationError) as info:
        validate_config(cfg)
    return info.value.problems


def _assert_names(cfg, key, changes):
    problems = _problems(cfg, **{k.replace(".", "__"): v for k, v in changes.items()})
    assert any(f"`{key}`" in p for p in problems), problems


def test_reference_setup_is_valid(valid_cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warnings either
        validate_config(valid_cfg)
    assert compute_world_size(valid_cfg) == 2


def test_default_config_needs_rollout_name_and_micro_batches(base_cfg):
    with pytest.raises(ConfigValidationError) as info:
        validate_config(base_cfg)
    text = str(info.value)
    assert "`actor_rollout_ref.rollout.name` is required" in text
    assert "`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu` must be set" in text
    assert "`critic.ppo_micro_batch_size_per_gpu` must be set" in text


A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
RULES = [
    # (key expected in the message, overrides that break it)
    (A + ".ppo_mini_batch_size", {A + ".ppo_mini_batch_size": 16}),
    (A + ".ppo_mini_batch_size", {A + ".ppo_mini_batch_size": 3}),
    (A + ".ppo_micro_batch_size_per_gpu", {A + ".ppo_micro_batch_size_per_gpu": None}),
    (A + ".ppo_micro_batch_size", {A + ".ppo_micro_batch_size": 4}),
    (A + ".ppo_micro_batch_size_per_gpu", {A + ".ppo_micro_batch_size_per_gpu": 3}),
    ("data.train_batch_size", {"data.train_batch_size": 3, A + ".ppo_mini_batch_size": 1,
                               R + ".n": 1, A + ".ppo_micro_batch_size_per_gpu": 1}),
    (R + ".log_prob_micro_batch_size_per_gpu",
     {R + ".log_prob_micro_batch_size_per_gpu": None}),
    (R + ".log_prob_micro_batch_size",
     {R + ".log_prob_micro_batch_size": 8}),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
     {A + ".use_kl_loss": True, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None}),
    ("critic.ppo_micro_batch_size_per_gpu", {"critic.ppo_micro_batch_size_per_gpu": None}),
    ("critic.ppo_mini_batch_size", {"critic.ppo_mini_batch_size": 64}),
    (A + ".ulysses_sequence_parallel_size",
     {A + ".ulysses_sequence_parallel_size": 2, "actor_rollout_ref.model.use_remove_padding": False}),
    (A + ".ulysses_sequence_parallel_size", {A + ".ulysses_sequence_parallel_size": 3}),
    ("critic.ulysses_sequence_parallel_size",
     {"critic.ulysses_sequence_parallel_size": 2, "critic.model.use_remove_padding": False}),
    (R + ".val_kwargs.temperature", {R + ".val_kwargs.do_sample": True}),
    (A + ".loss_agg_mode", {A + ".loss_agg_mode": "mean"}),
    (A + ".policy_loss.loss_mode", {A + ".policy_loss.loss_mode": "ppo"}),
    ("critic.enable", {"critic.enable": False}),
    ("algorithm.adv_estimator", {"algorithm.adv_estimator": "grpoo"}),
    (R + ".name", {R + ".name": "trtllm"}),
    (R + ".mode", {R + ".mode": "sync"}),
    (R + ".multi_turn.format", {R + ".multi_turn.format": "xml", R + ".multi_turn.enable": True}),
    (R + ".multi_turn.tool_response_truncate_side",
     {R + ".multi_turn.tool_response_truncate_side": "both"}),
    (A + ".clip_ratio_low", {A + ".clip_ratio_low": 0}),
    (A + ".clip_ratio", {A + ".clip_ratio": -0.2}),
    (A + ".clip_ratio_c", {A + ".clip_ratio_c": 1.0}),
    ("critic.cliprange_value", {"critic.cliprange_value": 0}),
    ("trainer.total_epochs", {"trainer.total_epochs": 0}),
    ("actor_rollout_ref.model.lora_rank", {"actor_rollout_ref.model.lora_rank": -1}),
    ("actor_rollout_ref.model.lora_alpha", {"actor_rollout_ref.model.lora_rank": 8,
                                            "actor_rollout_ref.model.lora_alpha": 0}),
    (A + ".strategy", {A + ".strategy": "ddp"}),
    ("critic.strategy", {"critic.strategy": "deepspeed"}),
    ("trainer.n_gpus_per_node", {"trainer.n_gpus_per_node": 0}),
    ("trainer.nnodes", {"trainer.nnodes": 0}),
    ("trainer.nnodes", {"trainer.nnodes": 2, "trainer.launcher": "local"}),
    ("trainer.launcher", {"trainer.launcher": "slurm"}),
    ("trainer.resume_from_path", {"trainer.resume_mode": "resume_path"}),
    ("algorithm.gamma", {"algorithm.gamma": 1.5}),
    ("algorithm.kl_penalty", {"algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "k4"}),
    ("algorithm.kl_ctrl.target_kl", {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
                                     "algorithm.kl_ctrl.target_kl": 0}),
    (A + ".kl_loss_type", {A + ".use_kl_loss": True,
                                              A + ".kl_loss_type": "l2"}),
    (R + ".temperature", {R + ".temperature": -1.0}),
    (R + ".top_p", {R + ".top_p": 0}),
    (R + ".n", {R + ".n": 0}),
    (R + ".max_model_len", {R + ".max_model_len": 600}),
    (R + ".tensor_model_parallel_size",
     {R + ".name": "vllm", R + ".tensor_model_parallel_size": 4}),
    (A + ".optim.lr_scheduler_type", {A + ".optim.lr_scheduler_type": "linear"}),
    (A + ".checkpoint.save_contents", {A + ".checkpoint.save_contents": ["weights"]}),
    ("data.truncation", {"data.truncation": "cut"}),
    ("data.train_batch_size", {"data.train_batch_size": "eight"}),
    ("reward.reward_manager.module.path", {"reward.reward_manager.source": "importlib"}),
    # reward.reward_model.enable=true needs a checkpoint and an engine name; its own GPUs are not implemented; with a
    # custom function (upstream's generative-RM route) the reward manager must hand the function the judge's address.
    ("reward.reward_model.model_path", {"reward.reward_model.enable": True, "reward.reward_model.rollout.name": "hf"}),
    ("reward.reward_model.rollout.name", {"reward.reward_model.enable": True, "reward.reward_model.model_path": "/m"}),
    ("reward.reward_model.enable_resource_pool",
     {"reward.reward_model.enable": True, "reward.reward_model.model_path": "/m", "reward.reward_model.rollout.name":
      "hf", "reward.reward_model.enable_resource_pool": True}),
    ("reward.reward_manager.name",
     {"reward.reward_model.enable": True, "reward.reward_model.model_path": "/m", "reward.reward_model.rollout.name":
      "hf", "reward.custom_reward_function.path": "a.py", "reward.reward_manager.name": "test_no_router"}),
    ("custom_reward_function.path",
     {"custom_reward_function.path": "a.py", "reward.custom_reward_function.path": "b.py"}),
]


@pytest.mark.parametrize("key,changes", RULES, ids=[f"{i}-{k}" for i, (k, _) in enumerate(RULES)])
def test_rule_fires_and_names_key(valid_cfg, key, changes):
    _assert_names(valid_cfg, key, changes)


def test_dynamic_bsz_skips_micro_batch_rules(valid_cfg):
    for section, key in (("actor", "ppo_micro_batch_size_per_gpu"), ("rollout", "log_prob_micro_batch_size_per_gpu")):
        OmegaConf.update(valid_cfg, f"actor_rollout_ref.{section}.{key}", None)
    OmegaConf.update(valid_cfg, "critic.ppo_micro_batch_size_per_gpu", None)
    OmegaConf.update(valid_cfg, "actor_rollout_ref.actor.use_dynamic_bsz", True)  # the others follow by interpolation
    validate_config(valid_cfg)


def test_critic_inherits_loss_agg_mode(valid_cfg):
    # The critic inherits the actor's (explicit) setting; only an explicit critic value is checked there.
    OmegaConf.update(valid_cfg, "critic.loss_agg_mode", "bogus")
    problems = _problems(valid_cfg)
    assert any("`critic.loss_agg_mode`" in p for p in problems)


def test_critic_legacy_micro_batch_alone_is_not_a_conflict(valid_cfg):
    # critic.ppo_micro_batch_size_per_gpu defaults to an interpolation of the legacy key;
    # setting only the legacy key must not count as "both set".
    OmegaConf.update(valid_cfg, "critic.ppo_micro_batch_size_per_gpu", "${oc.select:.ppo_micro_batch_size,null}")
    OmegaConf.update(valid_cfg, "critic.ppo_micro_batch_size", 2)
    validate_config(valid_cfg)


def test_grpo_runs_without_critic(valid_cfg):
    OmegaConf.update(valid_cfg, "algorithm.adv_estimator", "grpo")
    OmegaConf.update(valid_cfg, "critic.ppo_micro_batch_size_per_gpu", None)  # critic unused, so not checked
    validate_config(valid_cfg)


def test_soft_issues_warn(valid_cfg):
    OmegaConf.update(valid_cfg, "algorithm.use_kl_in_reward", True)
    OmegaConf.update(valid_cfg, "actor_rollout_ref.actor.use_kl_loss", True)
    OmegaConf.update(valid_cfg, "algorithm.adv_estimator", "grpo")
    OmegaConf.update(valid_cfg, "actor_rollout_ref.rollout.n", 1)
    OmegaConf.update(valid_cfg, "critic.enable", True)
    with pytest.warns(ConfigWarning) as record:
        validate_config(valid_cfg)
    text = " ".join(str(w.message) for w in record)
    assert "use_kl_in_reward" in text and "rollout.n=1" in text and "critic.enable=true" in text


def test_all_problems_reported_together(valid_cfg):
    problems = _problems(valid_cfg, trainer__total_epochs=0, actor_rollout_ref__rollout__name="tgi",
                         actor_rollout_ref__actor__loss_agg_mode="x")
    assert len(problems) == 3


def test_megatron_layout_rules(compose_fn, valid_overrides):
    cfg = compose_fn("ppo_megatron_trainer", valid_overrides)
    validate_config(cfg)
    OmegaConf.update(cfg, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 4)
    OmegaConf.update(cfg, "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size", 2)
    with pytest.raises(ConfigValidationError) as info:
        validate_config(cfg)
    text = str(info.value)
    assert "`actor_rollout_ref.actor.megatron.tensor_model_parallel_size`" in text
    assert "`actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size`" in text
