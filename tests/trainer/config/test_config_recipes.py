"""DAPO and rollout-correction keys: accepted with upstream's spellings, checked, refused when inconsistent."""

import warnings

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import ConfigKeyError, ConfigValidationError, ConfigWarning, check_overrides, validate_config
from verl.trainer.config.checks import upstream_only_keys

UPSTREAM_DAPO = [
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_num_gen_batches=10",
    "data.gen_batch_size=24",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "reward.reward_manager.name=dapo",
    "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
    "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
    "+reward.reward_kwargs.max_resp_len=16",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
    "algorithm.rollout_correction.rollout_rs=token_k1",
    "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
    "algorithm.rollout_correction.bypass_mode=False",
    "algorithm.rollout_correction.rollout_is_batch_normalize=False",
]


def test_keys_are_no_longer_upstream_only(base_cfg):
    for key in ("data.gen_batch_size", "algorithm.filter_groups.enable", "algorithm.rollout_correction.rollout_is"):
        assert key not in upstream_only_keys()
    check_overrides(base_cfg, UPSTREAM_DAPO)
    # not implemented here, so still refused by name
    with pytest.raises(ConfigKeyError, match="upstream verl option"):
        check_overrides(base_cfg, ["algorithm.filter_groups.max_inflight_gen_batches=2"])


def test_dapo_setup_validates(compose_fn, valid_overrides):
    cfg = compose_fn(overrides=valid_overrides + UPSTREAM_DAPO + ["algorithm.adv_estimator=grpo"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        validate_config(cfg)


@pytest.mark.parametrize("changes, key", [
    ({"algorithm.rollout_correction.rollout_is": "tokens"}, "algorithm.rollout_correction.rollout_is"),
    ({"algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_threshold": "3_1"},
     "algorithm.rollout_correction.rollout_is_threshold"),
    ({"algorithm.rollout_correction.rollout_rs": "seq_k1"}, "algorithm.rollout_correction.rollout_rs"),
    ({"algorithm.rollout_correction.rollout_rs": "token_k2"}, "algorithm.rollout_correction.rollout_rs"),
    ({"algorithm.rollout_correction.loss_type": "reinforce"}, "algorithm.rollout_correction.loss_type"),
    ({"algorithm.rollout_correction.bypass_mode": True, "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"},
     "algorithm.rollout_correction.bypass_mode"),
    ({"data.gen_batch_size": 0}, "data.gen_batch_size"),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": ""}, "algorithm.filter_groups.metric"),
])
def test_bad_settings_name_their_key(valid_cfg, changes, key):
    for k, v in changes.items():
        OmegaConf.update(valid_cfg, k, v)
    with pytest.raises(ConfigValidationError) as info:
        validate_config(valid_cfg)
    assert any(f"`{key}`" in p for p in info.value.problems), info.value.problems


def test_overlong_buffer_needs_dapo_and_max_resp_len(compose_fn, valid_overrides):
    cfg = compose_fn(overrides=valid_overrides + ["+reward.reward_kwargs.overlong_buffer_cfg.enable=True"])
    with pytest.raises(ConfigValidationError, match="read only by the dapo reward manager"):
        validate_config(cfg)
    cfg = compose_fn(overrides=valid_overrides + ["reward.reward_manager.name=dapo",
                                                  "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                                                  "+reward.reward_kwargs.overlong_buffer_cfg.len=4"])
    with pytest.raises(ConfigValidationError, match="max_resp_len"):
        validate_config(cfg)


def test_function_tool_path_keys(base_cfg):
    check_overrides(base_cfg, ["actor_rollout_ref.rollout.multi_turn.function_tool_path=/x/tools.py"])
    check_overrides(base_cfg, ["data.function_tool_path=/x/tools.py"])
    assert "data.function_tool_path" not in upstream_only_keys()
